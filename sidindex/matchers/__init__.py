"""Targeting matchers: bitmask rows and Bloom rows, and the one test of a plane (docs/design.md §4); the
exact per-ad index over them is `sidindex.exact`, beside the targeting spec it reads."""
