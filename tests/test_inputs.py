"""Inputs are regular files: a FIFO, device, socket or directory given as any input path is refused
at once in one line naming it (never opened: opening a FIFO blocks), and a build or update refuses
it without waiting for ROOT's lock. Bad values in TOML inputs and output paths whose directory is
missing are one line and exit 2 too."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from sidindex.artifact import regular_input
from sidindex.config import load_config
from sidindex.errors import ConfigError, InputError
from sidindex.ingest import read_catalog
from sidindex.job import run_build
from sidindex.targeting import load_targeting
from tests.conftest import run_cli

TIMEOUT = 60  # generous: a refused input exits within a second of start-up; a hang fails here
CONFIG = "[sid]\nlevels = [8, 4]\nhash_size = 16\nniter = 4\nmin_points_per_centroid = 5\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory, sample_dir) -> Path:
    """A ROOT with a published snapshot of the sample catalog (small levels: quick to build)."""
    base = tmp_path_factory.mktemp("inputs")
    (base / "build.toml").write_text(CONFIG)
    run_build(sample_dir / "catalog.parquet", sample_dir / "targeting.toml", base / "root", config=base / "build.toml")
    return base / "root"


@contextmanager
def locked(root: Path):
    """Hold ROOT's build lock: a command that waited for it would hang until the timeout."""
    with open(root / ".lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def rebuild(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.rebuild", *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT)


def write_job(path: Path, root: Path, sample_dir: Path, **paths) -> Path:
    job = {"catalog": str(sample_dir / "catalog.parquet"), "targeting": str(sample_dir / "targeting.toml"),
           "root": str(root), "force": True} | {k: str(v) for k, v in paths.items()}
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in job.items()))
    return path


# each command and input: the arguments with the input at `bad`
COMMANDS = {
    "build --catalog": lambda s, root, bad: ["build", "--catalog", bad, "--targeting", s / "targeting.toml",
                                             "--out", root],
    "build --targeting": lambda s, root, bad: ["build", "--catalog", s / "catalog.parquet", "--targeting", bad,
                                               "--out", root],
    "build --config": lambda s, root, bad: ["build", "--catalog", s / "catalog.parquet", "--targeting",
                                            s / "targeting.toml", "--out", root, "--config", bad],
    "sid train --catalog": lambda s, root, bad: ["sid", "train", "--catalog", bad, "--out", root],
    "retrieve --requests": lambda s, root, bad: ["retrieve", root, "--requests", bad, "--out", root.parent / "o.arrow",
                                                 "--beams", "1,8,8"],
    "simulate --requests": lambda s, root, bad: ["simulate", root, "--requests", bad, "--beams", "1,8,8"],
    "explain --request": lambda s, root, bad: ["explain", root, "--request", bad, "--ad", "1"],
    "update --changes": lambda s, root, bad: ["update", root, "--changes", bad],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_fifo_as_an_input_is_refused_at_once(command, root, sample_dir, tmp_path):
    fifo = tmp_path / "input.fifo"
    os.mkfifo(fifo)
    with locked(root):
        line = one_line(run_cli(*COMMANDS[command](sample_dir, root, fifo), timeout=TIMEOUT))
    assert str(fifo) in line and "is a FIFO" in line


def test_a_fifo_as_a_job_file_or_a_jobs_catalog_is_refused_at_once(root, sample_dir, tmp_path):
    fifo = tmp_path / "input.fifo"
    os.mkfifo(fifo)
    line = one_line(rebuild(fifo))
    assert str(fifo) in line and "is a FIFO" in line
    with locked(root):
        r = rebuild(write_job(tmp_path / "job.toml", root, sample_dir, catalog=fifo))
    assert r.returncode == 2, (r.stdout, r.stderr)
    error = json.loads(r.stdout)["error"]  # the job's report, on stdout and in ROOT/reports
    assert str(fifo) in error and "is a FIFO" in error


@pytest.mark.parametrize("kind", ["device", "directory"])
@pytest.mark.parametrize("command", ["build --catalog", "build --config", "update --changes", "retrieve --requests"])
def test_a_device_or_a_directory_as_an_input_is_refused(command, kind, root, sample_dir, tmp_path):
    bad = Path("/dev/zero") if kind == "device" else tmp_path
    with locked(root):
        line = one_line(run_cli(*COMMANDS[command](sample_dir, root, bad), timeout=TIMEOUT))
    assert str(bad) in line and ("is a directory" if kind == "directory" else "is a device") in line


def test_regular_input_names_what_the_path_is(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a device"), (tmp_path, "a directory"),
                           (tmp_path / "sock", "a socket")):
            with pytest.raises(InputError, match=rf"^{path}: the change file is {kind}; it must be a regular file"):
                regular_input(path, "change file")
    with pytest.raises(InputError, match=r"nope.parquet: file not found \(no catalog at this path\)"):
        regular_input(tmp_path / "nope.parquet", "catalog")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(InputError, match=r"dangling: file not found \(a symbolic link to no file\)"):
        regular_input(tmp_path / "dangling", "catalog")
    (tmp_path / "to_fifo").symlink_to(fifo)
    with pytest.raises(InputError, match="is a FIFO"):
        regular_input(tmp_path / "to_fifo", "catalog")


def test_a_link_to_a_regular_file_is_read(sample_dir, tmp_path):
    """A link to the latest export is a common setup."""
    (tmp_path / "latest.parquet").symlink_to(sample_dir / "catalog.parquet")
    (tmp_path / "targeting.toml").symlink_to(sample_dir / "targeting.toml")
    assert regular_input(tmp_path / "latest.parquet", "catalog") == tmp_path / "latest.parquet"
    spec = load_targeting(tmp_path / "targeting.toml")
    assert len(read_catalog(tmp_path / "latest.parquet", spec=spec)) == 1200


# --- TOML inputs with bad values ------------------------------------------------------------------

CONFIG_CASES = [
    ("[sid]\npath_ratio = 1" + "0" * 400 + "\n", "[sid] path_ratio: expected a number >= 0"),
    ("[sid]\nlevels = -3\n", "[sid] levels: expected a non-empty list of sizes in 1..32768, got -3"),
    ("[sid]\nlevels = \"512\"\n", "[sid] levels: expected a non-empty list"),
    ("[sid]\nlevels = 512.0\n", "[sid] levels: expected a non-empty list"),
    ("[sid]\nlevels = true\n", "[sid] levels: expected a non-empty list"),
    ("[sid.levels]\na = 1\n", "[sid] levels: expected a non-empty list"),
    ("[sid]\nlevels = [[8], [4]]\n", "[sid] levels: expected a non-empty list"),
    ("[sid]\nhash_keys = \"advertiser_id\"\n", "[sid] hash_keys: expected a non-empty list of column names"),
    ("[sid]\nhash_size = 1.5\n", "[sid] hash_size: expected an integer"),
    ("[sid]\nhash_size = {a = 1}\n", "[sid] hash_size: expected an integer"),
    ("[sid]\npath_ratio = 99999999999999999999999999999999999\npaths = \"2\"\n", "[sid] paths: expected an integer"),
    ("[sid]\ncapacity = \"1.1\"\n", "[sid] capacity: expected a number"),
    ("[sid]\nbalanced = 1\n", "[sid] balanced: expected true or false"),
    ("[sid]\nniter = true\n", "[sid] niter: expected an integer >= 1"),
    ("[quality]\nmax_sid_share = \"half\"\n", "[quality] max_sid_share: expected a number"),
    ("[kway]\nk = 64\n", "[kway] k: expected a non-empty list of positive integers"),
    ("[kway]\nk = [true, 2]\n", "[kway] k: expected a non-empty list of positive integers"),
    ("[kway]\nk_max = true\n", "[kway] k_max: expected an integer >= 1"),
    ("[kway]\ntarget_fill = \"x\"\n", "[kway] target_fill: expected a number"),
    ("[kway]\nmode = [\"static\"]\n", "[kway] mode: expected 'static' or 'dynamic'"),
    ("sid = 3\n", "[sid] must be a table"),
]

TARGETING_CASES = [
    ("version = true\n[[attribute]]\nname = \"a\"\nkind = \"bloom\"\n", "version True is not supported"),
    ("version = 1.0\n[[attribute]]\nname = \"a\"\nkind = \"bloom\"\n", "version 1.0 is not supported"),
    ("[attribute]\nname = \"a\"\nkind = \"bloom\"\n", "'attribute' is one table; declare each attribute as an "
                                                       "[[attribute]] table"),
    ("attribute = [1]\n", "attribute #1: expected a table, got int"),
    ("[[attribute]]\nname = 3\nkind = \"bloom\"\n", "attribute #1: 'name' must be a non-empty string"),
    ("[[attribute]]\nname = \"a\"\nkind = [\"bloom\"]\n", "attribute 'a': kind must be 'bitmask' or 'bloom'"),
    ("[[attribute]]\nname = \"a\"\nkind = \"bitmask\"\nvalues = \"US\"\n", "needs a non-empty 'values' list"),
    ("[[attribute]]\nname = \"a\"\nkind = \"bitmask\"\nvalues = [1]\n", "every value must be a non-empty string"),
    ("[[attribute]]\nname = \"a\"\nkind = \"bloom\"\nbits = 256.0\n", "'bits' must be a positive multiple of 64"),
    ("[[attribute]]\nname = \"a\"\nkind = \"bloom\"\nhashes = true\n", "'hashes' must be an integer in 1..16"),
    ("[[attribute]]\nname = \"a\"\nkind = \"bloom\"\nbits = {x = 1}\n", "'bits' must be a positive multiple of 64"),
]


@pytest.mark.parametrize("load, error, text, where",
                         [(load_config, ConfigError, *c) for c in CONFIG_CASES] +
                         [(load_targeting, InputError, *c) for c in TARGETING_CASES])
def test_a_toml_value_of_the_wrong_type_is_one_line_naming_the_file(load, error, text, where, tmp_path):
    path = tmp_path / "input.toml"
    path.write_text(text)
    with pytest.raises(error) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: ") and where in str(e.value) and "\n" not in str(e.value)


BINARY = {
    "random bytes": bytes(range(256)) * 4,
    "UTF-16": "[sid]\nlevels = [8]\n".encode("utf-16"),
    "nested too deeply": b"a = " + b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("content", BINARY.values(), ids=BINARY)
def test_a_toml_input_that_is_not_utf8_toml_is_refused_naming_it(content, tmp_path):
    path = tmp_path / "input.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^{path}: "):
        load_config(path)
    with pytest.raises(InputError, match=rf"^{path}: "):
        load_targeting(path)


def test_bad_config_values_and_bytes_exit_2_in_one_line(sample_dir, tmp_path):
    (tmp_path / "levels.toml").write_text("[sid]\nlevels = -3\n")
    (tmp_path / "utf16.toml").write_bytes(BINARY["UTF-16"])
    for name, said in (("levels.toml", "[sid] levels"), ("utf16.toml", "not UTF-8 text")):
        line = one_line(run_cli(*COMMANDS["build --config"](sample_dir, tmp_path / "root", tmp_path / name),
                                timeout=TIMEOUT))
        assert str(tmp_path / name) in line and said in line
    assert not (tmp_path / "root").exists()


# --- output files -------------------------------------------------------------------------------

def test_an_output_file_in_a_missing_directory_is_refused_not_made(root, sample_dir, tmp_path):
    """A typo in an output path does not create a tree of folders."""
    missing = tmp_path / "typo" / "deeper"
    cases = [
        ["retrieve", root, "--requests", sample_dir / "requests.parquet", "--out", missing / "out.parquet",
         "--beams", "1,8,8"],
        ["inspect", root, "--plot", missing / "trie.png"],
        ["sid", "assign", "--catalog", sample_dir / "catalog.parquet", "--codebook", root, "--out",
         missing / "sids.parquet"],
    ]
    for args in cases:
        line = one_line(run_cli(*args, timeout=TIMEOUT))
        assert f"{missing}: the directory does not exist" in line, line
        assert not (tmp_path / "typo").exists()
    (tmp_path / "afile").write_text("")
    line = one_line(run_cli("inspect", root, "--plot", tmp_path / "afile" / "trie.png", timeout=TIMEOUT))
    assert f"{tmp_path / 'afile'}: is not a directory" in line
