"""Reading TOML files with errors that name the file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from sidindex.artifact import regular_input
from sidindex.errors import ConfigError, SidIndexError


def read_toml(path: str | Path, error: type[Exception] = ConfigError, what: str = "TOML file") -> dict[str, Any]:
    """The TOML document at `path`, the `what` of its messages (a "build config"); every problem
    with the file (not a regular file, unreadable, not UTF-8, not TOML) is an `error` naming it."""
    try:
        path = regular_input(path, what)
        with path.open("rb") as f:
            return tomllib.load(f)
    except SidIndexError as e:
        raise error(str(e)) from None
    except OSError as e:  # no permission, an I/O error
        raise error(f"{path}: the {what} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:  # tomllib decodes the bytes as UTF-8 itself
        raise error(f"{path}: the {what} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path}: not valid TOML: {e}") from None
    except RecursionError:  # the parser recurses per nested array or inline table
        raise error(f"{path}: the {what} nests arrays or tables too deeply to be read") from None


def check_keys(table: dict[str, Any], allowed: set[str], where: str, error: type[Exception] = ConfigError) -> None:
    """Reject keys a user may have misspelt instead of silently ignoring them."""
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise error(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
