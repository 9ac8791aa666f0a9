"""The `sidindex` command line. Every command has --help; reporting commands take --json.

Errors a user can cause become one line on stderr and a non-zero exit code: 2 bad input, config,
artifact or usage, 3 a quality gate failed. Anything else reaching `main` is a bug.
"""

from __future__ import annotations

import sys

import typer
from rich.text import Text
from typer.exceptions import TyperException

from sidindex.errors import SidIndexError
from sidindex_cli import build, explain, serve, snapshot
from sidindex_cli.render import err

USAGE = 2

app = typer.Typer(help="Builds Semantic-ID indexes for eligibility-constrained generative ad retrieval.\n\n"
                  "Start with `sidindex sample`, then `sidindex build`, `sidindex inspect`, `sidindex validate`, "
                  "`sidindex explain`, `sidindex retrieve` and `sidindex simulate`.",
                  no_args_is_help=True, add_completion=False)
for group in (build, snapshot, explain, serve):
    app.add_typer(group.app)


def _fail(message: str, code: int) -> None:
    err.print(Text.assemble(("error: ", "bold red"), " ".join(message.split())), highlight=False, soft_wrap=True)
    sys.exit(code)


def main() -> None:
    try:
        app(standalone_mode=False)
    except SidIndexError as e:
        _fail(str(e), e.exit_code)
    except OSError as e:  # permissions, a full disk, a file where a directory should be
        _fail(str(e), USAGE)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except TyperException as e:  # usage errors: a mistyped flag, a bad option value, an unknown command
        message = e.format_message()
        if message:  # an empty message: the help was printed instead
            _fail(f"{message} (see --help)", USAGE)
        sys.exit(USAGE)
