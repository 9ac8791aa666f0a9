"""Reading TOML files with errors that name the file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from sidindex.errors import ConfigError


def read_toml(path: str | Path, error: type[Exception] = ConfigError) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path}: not valid TOML: {e}") from None


def check_keys(table: dict[str, Any], allowed: set[str], where: str, error: type[Exception] = ConfigError) -> None:
    """Reject keys a user may have misspelt instead of silently ignoring them."""
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise error(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
