"""Options shared by several commands, the progress bar they draw on stderr, and how they write
an output table."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sidindex.artifact import regular_output, replace_file
from sidindex.errors import ConfigError
from sidindex_cli.render import err

CATALOG_OPT = typer.Option(..., "--catalog", help="Catalog file (Parquet or Arrow IPC), see schemas/CONTRACTS.md.",
                           exists=False, dir_okay=False)
TARGETING_OPT = typer.Option(None, "--targeting",
                             help="Targeting spec (TOML). When given, the whole catalog is validated against it.")
CONFIG_OPT = typer.Option(None, "--config", help="Build config (TOML): \\[sid] scheme and \\[quality] gates. "
                                                 "Default: the built-in defaults (see sidindex.config).")
JSON_OPT = typer.Option(False, "--json", help="Print a JSON summary on stdout instead of tables.")
BEAMS_OPT = typer.Option("1,512,1024,1024", "--beams", help="Beam size per SID position: beams[0] is the root "
                         "(1), beams\\[d] are kept after step d-1, beams[-1] after the last step.")
DEVICE_OPT = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N. On cuda the mask is the Triton kernel.")
SNAPSHOT_ARG = typer.Argument(..., help="A ROOT (its published snapshot, named by ROOT/CURRENT) or a snapshot "
                              "directory.")


@contextmanager
def progress_bar(enabled: bool) -> Iterator:
    """A progress callback `(stage, done, total)` drawn on stderr when enabled (a terminal, no --json)."""
    if not enabled:
        yield lambda *_: None
        return
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def output_file(path: Path | None) -> Path | None:
    """`path` (None passes) when the directory it names a file in exists and the path is new or a
    regular file (links followed: a link to a regular file is accepted, and the written file
    replaces the link, its target left as it was); else a ConfigError naming the path: a typo in
    an output path must not create a tree of folders, and a FIFO, directory, device or socket
    must not be replaced by a file (nor a FIFO block the command). The temporary the file is
    written to first (`sidindex.artifact.temporary_file`) is held to the same rule. Also an
    option's callback, so that a command refuses the path before any work."""
    if path is None:
        return None
    if not path.parent.is_dir():
        problem = "is not a directory" if path.parent.exists() else "the directory does not exist"
        raise ConfigError(f"{path.parent}: {problem}, so {path.name!r} cannot be written there; "
                          "create the directory first or correct the path")
    return regular_output(path)


def write_table(table, path: Path) -> None:
    """Write a pyarrow table to `path` (.parquet, else uncompressed Arrow IPC; its directory checked
    by the option's `output_file`) in one step (`sidindex.artifact.replace_file`): a reader never sees
    half a file."""
    import pyarrow.parquet as pq
    from pyarrow import feather

    def write(tmp: Path) -> None:
        if path.suffix == ".parquet":
            pq.write_table(table, tmp)
        else:
            feather.write_feather(table, str(tmp), compression="uncompressed")

    replace_file(path, write)


SIGN_KEY_OPT = typer.Option(None, "--sign-key", metavar="FILE", help="Sign the published snapshot with this Ed25519 "
                            "private key (PEM: `openssl genpkey -algorithm ed25519 -out KEY`); the snapshot it "
                            "builds on must then be signed by it (or by --trust-key). Needs "
                            "pip install 'sidindex\\[sign]'.")
TRUST_KEY_OPT = typer.Option(None, "--trust-key", metavar="FILE", help="Refuse any snapshot this Ed25519 key did not "
                             "sign (PEM: the signing key's public half, `openssl pkey -in KEY -pubout`).")
ADOPT_OPT = typer.Option(False, "--adopt-unsigned", help="With --sign-key: accept the snapshot this one builds on "
                         "unsigned, once, to start signing a ROOT (a signed one is still checked).")
