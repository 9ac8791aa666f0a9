"""The `sidindex` console script's entry: SIGINT and SIGTERM are noted from the first line our code
runs, while the command line's modules load, and the command then stops as it would have had the
signal come later (`sidindex_cli.app.main`). Without this, a signal in that second or so would
kill the process with no word and no exit code of ours."""

import signal
import sys

_early: list[int] = []


def _note(signum, _frame) -> None:
    _early.append(signum)


for _s in (signal.SIGINT, signal.SIGTERM):
    if signal.getsignal(_s) is not signal.SIG_IGN:  # a shell's background job keeps ignoring SIGINT
        signal.signal(_s, _note)


def main() -> None:
    from sidindex_cli.app import main as run

    sys.exit(run(early=_early))
