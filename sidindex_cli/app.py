"""The `sidindex` command line. Every command has --help; reporting commands take --json.

Errors a user can cause become one line on stderr and a non-zero exit code: 2 bad input, config,
artifact or usage, a failing scorer of the user's, or memory running out; 3 a quality gate failed;
128 + the signal's number when SIGINT (130) or SIGTERM (143) stopped the command. Anything else
reaching `main` is a bug.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NoReturn

import typer
from rich.text import Text
from typer.exceptions import TyperException

from sidindex.errors import SidIndexError
from sidindex.interrupts import Interrupted, interrupts_raise
from sidindex_cli import build, explain, serve, snapshot
from sidindex_cli.render import err

USAGE = 2
SIGINT_EXIT = 130  # what typer returns for a KeyboardInterrupt it caught

app = typer.Typer(help="Builds Semantic-ID indexes for eligibility-constrained generative ad retrieval.\n\n"
                  "Start with `sidindex sample`, then `sidindex build`, `sidindex inspect`, `sidindex validate`, "
                  "`sidindex explain`, `sidindex retrieve` and `sidindex simulate`.",
                  no_args_is_help=True, add_completion=False)
for group in (build, snapshot, explain, serve):
    app.add_typer(group.app)


@dataclass(frozen=True)
class _Outcome:
    """What a command stopped half way leaves, and how it needs less memory, for its one line."""

    left: str = "nothing published"  # build, update and sid train publish into a ROOT by rename
    smaller: str = "a smaller input file"


# The commands that write files write each under a temporary name and rename it into place,
# except sample; the others write nothing.
OUTCOMES = {
    "sample": _Outcome("the --out directory may hold some of its files", "fewer --ads or --requests"),
    "retrieve": _Outcome("nothing written", "fewer requests per file, or per search (--batch-size)"),
    "simulate": _Outcome("nothing written", "fewer requests (--max-requests)"),
    "serve": _Outcome("nothing written", "smaller --beams or --max-batch"),
    **{c: _Outcome("nothing written") for c in ("explain", "inspect", "validate")},
}


def _out_of_memory(e: BaseException) -> str | None:
    """Which memory ran out ("host" or "GPU"), when `e` says one did: a MemoryError (Python,
    numpy, pyarrow), or torch's (torch.OutOfMemoryError on a GPU, a RuntimeError from its CPU
    allocator); else None."""
    torch = sys.modules.get("torch")  # loaded by the commands that use it
    if torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return "GPU"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        return "host"
    return None


def _fail(message: str, code: int, label: str = "error: ") -> NoReturn:
    err.print(Text.assemble((label, "bold red"), " ".join(message.split())), highlight=False, soft_wrap=True)
    sys.exit(code)


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    outcome = OUTCOMES.get(command, _Outcome())
    try:
        with interrupts_raise():  # SIGINT and SIGTERM unwind the command (`Interrupted`)
            code = app(standalone_mode=False)
    except Interrupted as e:
        _fail(e.describe(outcome.left), e.exit_code, label="")
    except SidIndexError as e:
        _fail(str(e), e.exit_code)
    except OSError as e:  # permissions, a full disk, a file where a directory should be
        _fail(str(e), USAGE)
    except (MemoryError, RuntimeError) as e:
        memory = _out_of_memory(e)
        if memory is None:
            raise
        _fail(f"out of {memory} memory: `sidindex {command}` could not allocate what it needed ({e}); give it more "
              f"memory or less to hold at once: {outcome.smaller}", USAGE)
    except typer.Abort:  # end of input at a prompt
        _fail("aborted", SIGINT_EXIT, label="")
    except KeyboardInterrupt:  # raised by code, not by a SIGINT (`interrupts_raise` makes that Interrupted)
        _fail(f"interrupted; {outcome.left}", SIGINT_EXIT, label="")
    except TyperException as e:  # usage errors: a mistyped flag, a bad option value, an unknown command
        message = e.format_message()
        if message:  # an empty message: the help was printed instead
            _fail(f"{message} (see --help)", USAGE)
        sys.exit(USAGE)
    if isinstance(code, int) and code != 0:  # typer's exit code for an exception it caught: never a success
        _fail(f"interrupted; {outcome.left}" if code == SIGINT_EXIT else f"stopped with exit code {code}", code,
              label="")
