"""`import runtime` imports no Triton, and a search and its post stage on the CPU run without it:
the kernels load on their first use on CUDA (or under TRITON_INTERPRET=1, where a test asks for
them). Checked in a fresh interpreter where Triton cannot be imported, as on a host without it
(pyproject installs Triton on Linux only)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.test_retrieve import CONFIG, build_root

ROOT = Path(__file__).resolve().parents[1]

NO_TRITON = textwrap.dedent("""
    import importlib.abc
    import sys


    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "triton":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, NoTriton())
""")


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TRITON + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_triton_cannot_be_imported_in_the_check():
    r = run_without_triton("import triton")
    assert r.returncode != 0 and "ModuleNotFoundError: No module named 'triton'" in r.stderr


def test_runtime_searches_on_the_cpu_without_triton(sample_dir, tmp_path):
    root = build_root(sample_dir, tmp_path, CONFIG)
    r = run_without_triton(f"""
        import pyarrow.parquet as pq

        import runtime

        assert "triton" not in sys.modules
        index = runtime.load({str(root)!r}, "cpu")
        table = pq.read_table({str(sample_dir / "requests.parquet")!r}).slice(0, 5)
        for mode in ("cd", "cd+gtm", "cd+gtm+kway"):
            out = runtime.Retriever(index, mode=mode, beams=(1, 8, 16, 16), batch_sizes=(4,)).retrieve(table)
            assert out.num_rows > 0, mode
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] == "triton")
        assert not loaded, loaded
    """)
    assert r.returncode == 0, r.stderr
