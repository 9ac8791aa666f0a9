"""An output file option (`--out` of retrieve and sid assign, `--report`, `--plot`) writes only to a
new path or over a regular file: a FIFO, a directory, a device or a socket there is refused
before any work, with one line naming it and exit 2, and left as it was."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from sidindex.errors import ConfigError
from sidindex_cli.options import output_file
from tests.conftest import run_cli


def _special(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"out-{kind}.parquet"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "kept").write_text("kept")
    return path


def _untouched(path: Path, kind: str) -> bool:
    mode = path.lstat().st_mode
    if kind == "fifo":
        return stat.S_ISFIFO(mode)
    return stat.S_ISDIR(mode) and (path / "kept").read_text() == "kept" and not Path(f"{path}.tmp").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_retrieve_refuses_an_out_that_is_not_a_regular_file(tmp_path, kind):
    out = _special(tmp_path, kind)
    # nothing else exists: the refusal comes first, before the snapshot is looked for
    r = run_cli("retrieve", tmp_path / "no-root", "--requests", tmp_path / "no-requests.parquet", "--out", out,
                timeout=120)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    said = {"fifo": "is a FIFO", "directory": "is a directory"}[kind]
    assert str(out) in r.stderr and said in r.stderr and "choose another path" in r.stderr, r.stderr
    assert _untouched(out, kind)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_every_single_file_output_option_refuses_it(tmp_path, kind):
    out = _special(tmp_path, kind)
    nothing = tmp_path / "nothing"
    for args in (("sid", "assign", "--catalog", nothing, "--codebook", nothing, "--out", out),
                 ("sid", "assign", "--catalog", nothing, "--codebook", nothing, "--out", tmp_path / "a.parquet",
                  "--report", out),
                 ("inspect", nothing, "--plot", out),
                 ("simulate", nothing, "--requests", nothing, "--plot", out)):
        r = run_cli(*args, timeout=120)
        assert r.returncode == 2 and str(out) in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
            (args, r.stderr)
        assert _untouched(out, kind)


def test_the_rule(tmp_path):
    new = tmp_path / "new.parquet"
    assert output_file(new) == new and output_file(None) is None
    regular = tmp_path / "regular.parquet"
    regular.write_bytes(b"old")
    assert output_file(regular) == regular
    link = tmp_path / "link.parquet"  # a link to a regular file: accepted (the written file replaces the link)
    link.symlink_to(regular)
    assert output_file(link) == link
    dangling = tmp_path / "dangling.parquet"  # a link to no file: a new path
    dangling.symlink_to(tmp_path / "gone")
    assert output_file(dangling) == dangling
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    to_fifo = tmp_path / "to-fifo.parquet"
    to_fifo.symlink_to(fifo)
    with pytest.raises(ConfigError, match="is a FIFO"):
        output_file(to_fifo)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(ConfigError, match="is a socket"):
            output_file(tmp_path / "sock")
    with pytest.raises(ConfigError, match="is a device"):
        output_file(Path("/dev/null"))
    blocked = tmp_path / "blocked.parquet"  # the temporary it is written to first is a FIFO
    os.mkfifo(f"{blocked}.tmp")
    with pytest.raises(ConfigError, match=r"blocked\.parquet\.tmp: the temporary that 'blocked.parquet' is written "
                                          r"to first, is a FIFO"):
        output_file(blocked)
