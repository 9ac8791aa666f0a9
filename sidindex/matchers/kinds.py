"""The matcher kinds, in plane order (`schemas.artifacts.MATCHER_PLANES`): the one list everything
that builds, stores or tests matcher rows iterates over. A new kind: its attribute in
`sidindex.targeting` (and its columns' contract in `schemas.contracts`), a module here exporting
its `MatcherKind`, its plane and exact form in `schemas.artifacts`, an entry below, and its requests'
encoding in `sidindex.requests.encode_requests` (which writes the planes it knows, and says so)."""

from __future__ import annotations

from schemas.artifacts import MATCHER_PLANES
from sidindex.matchers import bitmask, bloom
from sidindex.matchers.plane import MatcherKind

KINDS: tuple[MatcherKind, ...] = (bitmask.KIND, bloom.KIND)
assert tuple(k.name for k in KINDS) == MATCHER_PLANES, "matcher kinds and snapshot planes disagree"
