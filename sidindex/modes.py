"""Search modes: which tests a beam's next token must pass (docs/design.md §8, GRACE 3.5).

    none          any token of the level's vocabulary (unconstrained decoding, for comparison)
    cd            the prefix + token is a catalog prefix (a child entry of the beam's trie node)
    cd+gtm        and the child's subtree-union matchers pass every attribute
    cd+gtm+kway   and ANY of the child's k-way partitions passes every attribute

The one home of the concept: every entry point (beam search, retrieval, simulation, explanation,
the CPU matcher) parses its mode once with `parse_mode` and passes the `Mode` along; kernels branch
on its properties, never on its name.
"""

from __future__ import annotations

from enum import Enum

from sidindex.errors import ConfigError


class Mode(str, Enum):
    """A search mode; its value is the name users write."""

    NONE = "none"
    CD = "cd"
    CD_GTM = "cd+gtm"
    CD_GTM_KWAY = "cd+gtm+kway"

    def __str__(self) -> str:
        return self.value

    @property
    def constrained(self) -> bool:
        """Walks the trie: only catalog prefixes survive (CD)."""
        return self is not Mode.NONE

    @property
    def gtm(self) -> bool:
        """Tests each child's subtree-union matchers."""
        return self in (Mode.CD_GTM, Mode.CD_GTM_KWAY)

    @property
    def kway(self) -> bool:
        """Tests each child's k-way partitions (needs a snapshot built with them)."""
        return self is Mode.CD_GTM_KWAY


def parse_mode(mode: Mode | str, *, kway_available: bool | None = None) -> Mode:
    """The `Mode` named by `mode` (a Mode is returned as it is).

    kway_available: whether the index has k-way partitions; when given, a mode that needs them is
    refused on an index without them. Raises ConfigError saying what to do.
    """
    try:
        parsed = Mode(mode)
    except ValueError:
        raise ConfigError(f"mode must be one of {', '.join(m.value for m in Mode)}; got {mode!r}") from None
    if parsed.kway and kway_available is False:
        raise ConfigError(f"mode {parsed.value}: this snapshot was built without k-way partitions; a build whose "
                          f"config has a [kway] section adds them (or use mode {Mode.CD_GTM.value})")
    return parsed


def served_modes(kway_available: bool) -> tuple[Mode, ...]:
    """The constrained modes an index can serve, in order (what a study or an explanation covers)."""
    return tuple(m for m in Mode if m.constrained and (kway_available or not m.kway))
