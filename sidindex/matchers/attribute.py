"""A targeting attribute and what its matcher kind supplies (docs/design.md §3, §4).

Everything that differs between kinds is a field of the kind's `MatcherKind`: how the spec declares
an attribute of it, how a request names its values, the layout of its rows, how ads are encoded and
how a row is explained. The spec (`sidindex.targeting`), the builders and the explanations call
these and never test which kind they hold; `sidindex.matchers.kinds.KINDS` lists the kinds in plane
order. This module sits below the kinds' own modules, which build `Attribute`s, and below the spec,
which holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, repr=False)
class MatcherKind:
    """What a matcher kind supplies.

    name:              the attribute kind in the spec and the plane's name in snapshots
                       (`schemas.artifacts.MATCHER_PLANES`)
    one_request_value: a request brings one value (a string) for an attribute of this kind, else a
                       list of values
    parse:             (TOML table, where, name) -> the Attribute it declares, its kind's keys
                       checked (an InputError naming `where` otherwise)
    settings:          Attribute -> its kind's keys as the spec writes them (`parse` inverts it)
    layout:            the kind's attributes, in spec order -> its layout (`names` of its
                       attributes, `words` per row, meaningful `bits` per row), derived once per
                       spec (`TargetingSpec.layouts`)
    encode_ads:        (layout, catalog columns, flattened codes or None) -> (N, W) uint64 ad rows
    attribute_passes:  (layout, row (W,), PlaneQueries, request) -> (A,) bool per attribute (explanations)
    """

    name: str
    one_request_value: bool
    parse: Callable[[dict, str, str], Attribute]
    settings: Callable[[Attribute], dict]
    layout: Callable[[tuple[Attribute, ...]], Any]
    encode_ads: Callable[..., np.ndarray]
    attribute_passes: Callable[..., np.ndarray]

    def __repr__(self) -> str:  # the functions' reprs say nothing a reader of an Attribute needs
        return f"MatcherKind({self.name!r})"


@dataclass(frozen=True)
class Attribute:
    """One targeting attribute. `values` is set for bitmask attributes, `bits`/`hashes` for bloom."""

    name: str
    kind: MatcherKind
    values: tuple[str, ...] = ()
    bits: int = 0
    hashes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, MatcherKind):  # a kind's name is not a kind: no behaviour to fall back on
            raise TypeError(f"attribute {self.name!r}: kind must be a MatcherKind, got {self.kind!r}")

    @property
    def one_request_value(self) -> bool:
        """A request brings one value for this attribute (else a list of values)."""
        return self.kind.one_request_value

    def to_dict(self) -> dict:
        """The attribute as the spec declares it: name, kind, then its kind's keys."""
        return {"name": self.name, "kind": self.kind.name, **self.kind.settings(self)}
