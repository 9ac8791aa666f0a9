"""Targeting spec: the ordered attributes an ad may restrict (DESIGN.md §3).

The spec is a TOML file with an array of ``[[attribute]]`` tables; see ``schemas/CONTRACTS.md``.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import TARGETING_ATTRIBUTE
from sidindex.errors import InputError
from sidindex.tomlio import check_keys, read_toml

if TYPE_CHECKING:
    from sidindex.matchers.bitmask import BitmaskLayout
    from sidindex.matchers.bloom import BloomLayout

BITMASK = "bitmask"
BLOOM = "bloom"
DEFAULT_BLOOM_BITS = 256
DEFAULT_BLOOM_HASHES = 2
MAX_BLOOM_HASHES = 16
# Per kind: a request brings one value (a string) for its attributes, or a list of values
ONE_REQUEST_VALUE = {BITMASK: True, BLOOM: False}


@dataclass(frozen=True)
class Attribute:
    """One targeting attribute. `values` is set for bitmask attributes, `bits`/`hashes` for bloom."""

    name: str
    kind: str
    values: tuple[str, ...] = ()
    bits: int = 0
    hashes: int = 0

    @property
    def one_request_value(self) -> bool:
        """A request brings one value for this attribute (else a list of values)."""
        return ONE_REQUEST_VALUE[self.kind]


@dataclass(frozen=True)
class TargetingSpec:
    attributes: tuple[Attribute, ...]
    version: int = TARGETING_ATTRIBUTE.version
    source: str = field(default="the targeting spec", compare=False)  # named in error messages

    @property
    def bitmask(self) -> tuple[Attribute, ...]:
        return self.of_kind(BITMASK)

    @property
    def bloom(self) -> tuple[Attribute, ...]:
        return self.of_kind(BLOOM)

    def of_kind(self, kind: str) -> tuple[Attribute, ...]:
        return tuple(a for a in self.attributes if a.kind == kind)

    # The matcher layouts, derived once per spec. The matcher modules import this one, hence the
    # import inside (cached_property writes the instance dict, which a frozen dataclass allows).
    @cached_property
    def layouts(self) -> tuple:
        """Each matcher kind's layout, in plane order (`sidindex.matchers.kinds.KINDS`)."""
        from sidindex.matchers.kinds import KINDS

        return tuple(k.layout(self) for k in KINDS)

    @property
    def bitmask_layout(self) -> BitmaskLayout:
        return self.layouts[0]

    @property
    def bloom_layout(self) -> BloomLayout:
        return self.layouts[1]

    def to_dict(self) -> dict:
        """The spec as plain TOML/JSON-serialisable data; `spec_from_dict` inverts it."""
        out = []
        for a in self.attributes:
            d = {"name": a.name, "kind": a.kind}
            if a.kind == BITMASK:
                d["values"] = list(a.values)
            else:
                d["bits"], d["hashes"] = a.bits, a.hashes
            out.append(d)
        return {"version": self.version, "attribute": out}


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
        kind = t.get("kind")
        if kind == BITMASK:
            attrs.append(_bitmask(t, at, name))
        elif kind == BLOOM:
            attrs.append(_bloom(t, at, name))
        else:
            raise InputError(f"{at}: kind must be 'bitmask' or 'bloom', got {reprlib.repr(kind)}")
    return TargetingSpec(tuple(attrs), source=where)


def _bitmask(t: dict, at: str, name: str) -> Attribute:
    if "bits" in t or "hashes" in t:
        raise InputError(f"{at}: 'bits' and 'hashes' apply to bloom attributes only")
    values = t.get("values")
    if not isinstance(values, list) or not values:
        raise InputError(f"{at}: a bitmask attribute needs a non-empty 'values' list")
    seen: set[str] = set()
    for v in values:
        if not isinstance(v, str) or not v:
            raise InputError(f"{at}: every value must be a non-empty string, got {reprlib.repr(v)}")
        if v in seen:
            raise InputError(f"{at}: value {v!r} is declared twice")
        seen.add(v)
    return Attribute(name, BITMASK, values=tuple(values))


def _bloom(t: dict, at: str, name: str) -> Attribute:
    if "values" in t:
        raise InputError(f"{at}: bloom attributes take free strings; 'values' applies to bitmask only")
    bits = t.get("bits", DEFAULT_BLOOM_BITS)
    hashes = t.get("hashes", DEFAULT_BLOOM_HASHES)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits <= 0 or bits % 64:
        raise InputError(f"{at}: 'bits' must be a positive multiple of 64, got {reprlib.repr(bits)}")
    if isinstance(hashes, bool) or not isinstance(hashes, int) or not 1 <= hashes <= MAX_BLOOM_HASHES:
        raise InputError(f"{at}: 'hashes' must be an integer in 1..{MAX_BLOOM_HASHES}, got {reprlib.repr(hashes)}")
    return Attribute(name, BLOOM, bits=bits, hashes=hashes)


def write_targeting(spec: TargetingSpec, path: str | Path) -> None:
    """Write `spec` as TOML (the format `load_targeting` reads)."""
    lines = [f"version = {spec.version}", ""]
    for a in spec.attributes:
        lines += ["[[attribute]]", f"name = {json.dumps(a.name)}", f"kind = {json.dumps(a.kind)}"]
        if a.kind == BITMASK:
            # JSON string escapes are valid TOML basic-string escapes.
            lines.append("values = [" + ", ".join(json.dumps(v) for v in a.values) + "]")
        else:
            lines += [f"bits = {a.bits}", f"hashes = {a.hashes}"]
        lines.append("")
    Path(path).write_text("\n".join(lines))
