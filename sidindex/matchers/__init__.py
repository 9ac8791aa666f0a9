"""Targeting matchers: bitmask rows, Bloom rows, and the exact per-ad index (docs/design.md §4)."""
