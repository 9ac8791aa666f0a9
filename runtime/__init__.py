"""GPU runtime (torch, triton): load snapshots, constrained beam search, SID -> ad expansion.

Layering (DESIGN.md §2): `runtime` reads artifacts only through `sidindex`'s readers and never
re-implements their formats; `sidindex` never imports `runtime`.
"""
