"""The `sidindex` command line. Every command has --help; reporting commands take --json.

Errors a user can cause become one line on stderr and a non-zero exit code: 2 bad input, config,
artifact or usage, a failing scorer of the user's, or memory running out; 3 a quality gate failed;
128 + the signal's number when SIGINT (130) or SIGTERM (143) stopped the command. Anything else
reaching `main` is a bug.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

import typer
from rich.text import Text
from typer.exceptions import TyperException

from sidindex.errors import SidIndexError
from sidindex.interrupts import Interrupted, interrupts_raise, noted
from sidindex.resources import address_space_limit, check_limit, fit_to_limit, is_out_of_memory
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
    """What a command stopped half way leaves, how it needs less memory, and what it loads, for its one line."""

    left: str = "nothing published"  # build, update and sid train publish into a ROOT by rename
    smaller: str = "a smaller input file"
    # the heaviest library it loads, for the address space that needs (`sidindex.resources.check_limit`);
    # numpy stands for numpy, polars, pyarrow and numba, which every command loads
    loads: str | None = None
    # a server stopped before it served has done what it was asked: exit 0
    stop_before_serving: bool = False


# The commands that write files write each under a temporary name and rename it into place,
# except sample; the others write nothing.
OUTCOMES = {
    "sample": _Outcome("the --out directory may hold some of its files", "fewer --ads or --requests", "numpy"),
    "build": _Outcome(loads="faiss"),
    "sid": _Outcome(loads="faiss"),
    "update": _Outcome(loads="numpy"),
    "retrieve": _Outcome("nothing written", "fewer requests per file, or per search (--batch-size)", "torch"),
    "simulate": _Outcome("nothing written", "fewer requests (--max-requests)", "torch"),
    "serve": _Outcome("nothing written", "smaller --beams or --max-batch", "torch", stop_before_serving=True),
    **{c: _Outcome("nothing written", loads="numpy") for c in ("explain", "inspect", "validate")},
}


def _out_of_memory(e: BaseException) -> str | None:
    """Which memory ran out ("host" or "GPU"), when `e` says one did: a MemoryError (Python,
    numpy, pyarrow), torch's (torch.OutOfMemoryError on a GPU, a RuntimeError from its CPU
    allocator), a thread that could not start or a library that could not be mapped
    (`sidindex.resources.is_out_of_memory`); else None."""
    torch = sys.modules.get("torch")  # loaded by the commands that use it
    if torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return "GPU"
    if not is_out_of_memory(e):
        return None
    # CUDA's "out of memory" under `ulimit -v` is host address space it could not reserve
    return "GPU" if "cuda" in str(e).lower() and address_space_limit() is None else "host"


def _memory_line(e: BaseException, command: str, outcome: _Outcome) -> str | None:
    """The one line for `e` when it says memory ran out, else None."""
    memory = _out_of_memory(e)
    if memory is None:
        return None
    return (f"out of {memory} memory: `sidindex {command}` could not allocate what it needed ({e}); give it more "
            f"memory or less to hold at once: {outcome.smaller}")


def _fail(message: str, code: int, label: str = "error: ") -> NoReturn:
    err.print(Text.assemble((label, "bold red"), " ".join(message.split())), highlight=False, soft_wrap=True)
    sys.exit(code)


def main(early: list[int] | tuple[int, ...] = ()) -> None:
    """The command line; early: SIGINT or SIGTERM that came while it loaded (`sidindex_cli.launch`)."""
    fit_to_limit()  # before numpy, polars, pyarrow and numba load: they size their pools as they do
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    outcome = OUTCOMES.get(command, _Outcome())
    try:
        check_limit(outcome.loads)  # below it a library would fail where it cannot say so
        # SIGINT and SIGTERM unwind the command (`Interrupted`) until it publishes; after that they are
        # noted until the process has exited, and the success stands
        with interrupts_raise(keep=True):
            if early:
                raise Interrupted(early[0])
            code = app(standalone_mode=False)
    except Interrupted as e:
        if outcome.stop_before_serving:
            err.print(f"stopped by {signal.Signals(e.signum).name} before serving; no request was taken",
                      highlight=False)
            return
        _fail(e.describe(outcome.left), e.exit_code, label="")
    except SidIndexError as e:  # one raised on a failed allocation (a file that "cannot be read") is out of memory
        line = _memory_line(e, command, outcome)
        _fail(line or str(e), USAGE if line else e.exit_code)
    except OSError as e:  # permissions, a full disk, a file where a directory should be; or ENOMEM
        _fail(_memory_line(e, command, outcome) or str(e), USAGE)
    except typer.Abort:  # end of input at a prompt (a RuntimeError: before the clause below)
        _fail("aborted", SIGINT_EXIT, label="")
    except (MemoryError, RuntimeError, ImportError) as e:
        line = _memory_line(e, command, outcome)
        if line is None:
            raise
        _fail(line, USAGE)
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
    signals, published = noted()
    if signals and published:
        err.print(f"note: {signal.Signals(signals[0]).name} arrived after snapshot {published} was published; the "
                  "command finished", highlight=False, soft_wrap=True)
