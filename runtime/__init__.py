"""The serving runtime (torch, triton): load snapshots onto a device, constrained beam search,
SID -> ad expansion (DESIGN.md §8).

    loader      snapshot -> device tensors; SnapshotWatcher swaps to newly published snapshots
    requests    a request batch encoded for the matchers
    ops/        the fused CD+GTM mask: Triton kernel, torch reference, numba CPU path
    search      beam search in modes none, cd, cd+gtm, cd+gtm+kway
    scorer      the built-in codebook scorer
    post        SIDs -> ads, best score per ad, exact filter, ranking
    retrieve    all of it over a request table, in batches

Layering (DESIGN.md §2): `runtime` reads artifacts only through `sidindex`'s readers and never
re-implements their formats; the `sidindex` library never imports `runtime` (only the CLI's
`retrieve` command does, when it runs).
"""
