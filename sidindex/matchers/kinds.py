"""The matcher kinds, in plane order. The one list of kinds is the snapshot contract's
(`schemas.artifacts.EXACT_FORM`, whose keys are MATCHER_PLANES: each plane's name, order and exact
form); `KINDS` holds each plane's implementation in that order, and everything that parses, builds,
stores or tests matcher rows iterates over it. A new kind: a module here exporting its `MatcherKind`
(`sidindex.matchers.attribute`), its entry in `schemas.artifacts.EXACT_FORM` (and its columns'
contract in `schemas.contracts`), its module's KIND below, and its requests' encoding in
`sidindex.request_encoding.encode_requests` (which writes the planes it knows, and says so)."""

from __future__ import annotations

from schemas.artifacts import MATCHER_PLANES
from sidindex.matchers import bitmask, bloom
from sidindex.matchers.attribute import MatcherKind

_IMPLEMENTED = {k.name: k for k in (bitmask.KIND, bloom.KIND)}
if set(_IMPLEMENTED) != set(MATCHER_PLANES):  # a plane without its code, or code for no plane: fail at import
    raise ImportError(f"matcher kinds {sorted(_IMPLEMENTED)} and snapshot planes {list(MATCHER_PLANES)} disagree")
KINDS: tuple[MatcherKind, ...] = tuple(_IMPLEMENTED[p] for p in MATCHER_PLANES)
