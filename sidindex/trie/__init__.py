"""The GTM index: CSR trie over SIDs with subtree-union matchers (docs/design.md §6, GRACE Appendix A)."""

from sidindex.trie.build import GTMIndex, build_gtm

__all__ = ["GTMIndex", "build_gtm"]
