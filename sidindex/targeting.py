"""Targeting spec: the ordered attributes an ad may restrict (docs/design.md §3).

The spec is a TOML file with an array of ``[[attribute]]`` tables; see ``schemas/CONTRACTS.md``.
What an attribute's kind means (its keys, a request's values, its matcher rows) is its
`MatcherKind`'s (`sidindex.matchers.attribute`); this module orders the attributes and checks what
every attribute shares.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from schemas import TARGETING_ATTRIBUTE
from sidindex.errors import InputError
from sidindex.matchers import bitmask, bloom
from sidindex.matchers.attribute import Attribute, MatcherKind
from sidindex.matchers.bitmask import BitmaskLayout
from sidindex.matchers.bloom import BloomLayout
from sidindex.matchers.kinds import KINDS
from sidindex.tomlio import check_keys, read_toml

# The kinds by name, for specs written in code: Attribute("country", BITMASK, values=("US", "GB"))
BITMASK, BLOOM = bitmask.KIND, bloom.KIND


@dataclass(frozen=True)
class TargetingSpec:
    attributes: tuple[Attribute, ...]
    version: int = TARGETING_ATTRIBUTE.version
    source: str = field(default="the targeting spec", compare=False)  # named in error messages

    def __post_init__(self) -> None:
        for a in self.attributes:
            if a.kind not in KINDS:  # a kind with no plane in snapshots: nothing could store or serve it
                raise ValueError(f"attribute {a.name!r}: kind {a.kind!r} is not one of {KINDS}")

    @property
    def bitmask(self) -> tuple[Attribute, ...]:
        return self.of_kind(BITMASK)

    @property
    def bloom(self) -> tuple[Attribute, ...]:
        return self.of_kind(BLOOM)

    def of_kind(self, kind: MatcherKind) -> tuple[Attribute, ...]:
        return tuple(a for a in self.attributes if a.kind == kind)

    # cached_property writes the instance dict, which a frozen dataclass allows
    @cached_property
    def layouts(self) -> tuple:
        """Each matcher kind's layout, in plane order (`sidindex.matchers.kinds.KINDS`)."""
        return tuple(k.layout(self.of_kind(k)) for k in KINDS)

    def layout_of(self, kind: MatcherKind) -> Any:
        """The layout of `kind` (one of KINDS): what its `MatcherKind.layout` makes."""
        return self.layouts[KINDS.index(kind)]

    @property
    def bitmask_layout(self) -> BitmaskLayout:
        return self.layout_of(BITMASK)

    @property
    def bloom_layout(self) -> BloomLayout:
        return self.layout_of(BLOOM)

    def to_dict(self) -> dict:
        """The spec as plain TOML/JSON-serialisable data; `spec_from_dict` inverts it."""
        return {"version": self.version, "attribute": [a.to_dict() for a in self.attributes]}


def load_targeting(path: str | Path) -> TargetingSpec:
    """Read and validate a targeting spec file."""
    return spec_from_dict(read_toml(path, InputError, "targeting spec"), str(path))


def spec_from_dict(doc: dict, where: str = "targeting spec") -> TargetingSpec:
    check_keys(doc, {"version", "attribute"}, where, InputError)
    version = doc.get("version", TARGETING_ATTRIBUTE.version)
    # type first: true and 1.0 equal 1
    if type(version) is not int or version != TARGETING_ATTRIBUTE.version:
        raise InputError(f"{where}: version {reprlib.repr(version)} is not supported (this sidindex reads "
                         f"version {TARGETING_ATTRIBUTE.version})")
    tables = doc.get("attribute")
    if isinstance(tables, dict):
        raise InputError(f"{where}: 'attribute' is one table; declare each attribute as an [[attribute]] table "
                         "(double brackets)")
    if not isinstance(tables, list) or not tables:
        raise InputError(f"{where}: declares no attributes; add at least one [[attribute]] table")
    allowed = {f.name for f in TARGETING_ATTRIBUTE.fields}
    attrs: list[Attribute] = []
    for i, t in enumerate(tables):
        at = f"{where}: attribute #{i + 1}"
        if not isinstance(t, dict):
            raise InputError(f"{at}: expected a table, got {type(t).__name__}")
        check_keys(t, allowed, at, InputError)
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise InputError(f"{at}: 'name' must be a non-empty string")
        at = f"{where}: attribute {name!r}"
        if name in {a.name for a in attrs}:
            raise InputError(f"{at}: declared twice")
        if name in ("ad_id", "embedding", "value", "request_id"):
            raise InputError(f"{at}: the name is reserved for a catalog/request column; rename it")
        kind = next((k for k in KINDS if k.name == t.get("kind")), None)
        if kind is None:
            raise InputError(f"{at}: kind must be {' or '.join(repr(k.name) for k in KINDS)}, got "
                             f"{reprlib.repr(t.get('kind'))}")
        attrs.append(kind.parse(t, at, name))
    return TargetingSpec(tuple(attrs), source=where)


def write_targeting(spec: TargetingSpec, path: str | Path) -> None:
    """Write `spec` as TOML (the format `load_targeting` reads)."""
    lines = [f"version = {spec.version}", ""]
    for a in spec.attributes:
        # JSON's strings, integers and lists of strings are valid TOML values (its escapes TOML's)
        lines += ["[[attribute]]", *(f"{k} = {json.dumps(v)}" for k, v in a.to_dict().items()), ""]
    Path(path).write_text("\n".join(lines))
