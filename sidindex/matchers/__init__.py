"""Targeting matchers: bitmask rows, Bloom rows, and the exact per-ad index (DESIGN.md §4)."""
