"""Figures for `inspect --plot` and `simulate --plot` (matplotlib, an optional extra: pip install 'sidindex[plot]')."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from schemas.artifacts import MATCHER_PLANES
from sidindex.errors import InputError

if TYPE_CHECKING:  # the statistics' module loads numba: not at every command's start
    from sidindex.trie.stats import PositionStats


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'sidindex[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_positions(positions: tuple[PositionStats, ...], kway: bool, path: Path, title: str) -> None:
    """Fill rate and matcher storage per transition position (GRACE Tables 1 and 2) to a PNG.

    positions: `GTMStats.positions` (a snapshot manifest's stats)
    """
    plt = _pyplot()
    x = [p.position for p in positions]
    fig, (fill, store) = plt.subplots(1, 2, figsize=(13, 4))
    for m, marker in zip(MATCHER_PLANES, "os^dv"):
        fill.plot(x, [p.planes[m].fill for p in positions], f"{marker}-", label=f"{m} (union)")
        if kway:
            fill.plot(x, [p.planes[m].part_fill for p in positions], f"{marker}--", label=f"{m} (k-way partitions)")
    fill.set(xlabel="transition position", ylabel="mean fill rate (share of bits set)", ylim=(0, 1.02),
             title="matcher fill rate", xticks=x)
    fill.legend(fontsize=8)
    bars = [(m, field, f"{m}, {label}") for m in MATCHER_PLANES
            for field, label in (("bytes_before", "one row per entry"), ("bytes_after", "deduplicated"))]
    width = 0.8 / len(bars)
    for i, (m, field, label) in enumerate(bars):
        store.bar([p + (i - (len(bars) - 1) / 2) * width for p in x],
                  [max(getattr(p.planes[m], field), 1) / 1e6 for p in positions], width, label=label)
    store.set(xlabel="transition position", ylabel="MB (log scale)", yscale="log", title="matcher storage", xticks=x)
    store.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_study(report: dict, path: Path) -> None:
    """Pass rates per stage and recall@K per mode (a `sidindex simulate` report) to a PNG."""
    plt = _pyplot()
    modes = report["modes"]
    k = report["top_k"]
    fig, (rates, recall) = plt.subplots(1, 2, figsize=(12, 4))
    bars = [(f"{p}_rate", f"{p} stage") for p in MATCHER_PLANES] + [("final_rate", "final (eligible)")]
    width = 0.75 / len(bars)
    for i, (key, label) in enumerate(bars):
        rates.bar([j + (i - (len(bars) - 1) / 2) * width for j in range(len(modes))], [m[key] or 0 for m in modes],
                  width, label=label)
    rates.set(xticks=range(len(modes)), xticklabels=[m["mode"] for m in modes], ylim=(0, 1.2),
              yticks=np.arange(0, 1.01, 0.2), ylabel="share of generated ads",
              title="pass rate of the ads the search generated")
    rates.legend(fontsize=8, loc="upper center", ncol=len(bars))  # above the bars: the y axis stops at 1
    recall.bar(range(len(modes)), [m[f"recall_at_{k}"] or 0 for m in modes], 0.5)
    recall.set(xticks=range(len(modes)), xticklabels=[m["mode"] for m in modes], ylim=(0, 1.02),
               ylabel=f"recall@{k}", title=f"recall@{k} of the best eligible ads (exhaustive)")
    fig.tight_layout()
    if any(m.get("value_by_weight") for m in modes):  # value@K against the value weight, right of the rest
        value = fig.add_axes((1.08, 0.15, 0.3, 0.7))
        for m in modes:
            pts = [(0.0, m[f"value_at_{k}"])] + [(w["weight"], w[f"value_at_{k}"]) for w in m["value_by_weight"]]
            value.plot([w for w, _ in pts], [v or 0 for _, v in pts], "o-", label=m["mode"])
        value.set(xlabel="value weight", ylabel=f"value@{k}", ylim=(0, 1.02), title=f"value@{k} against the weight")
        value.legend(fontsize=8)
    fig.suptitle(f"snapshot {report['snapshot_id']}: {report['requests']} requests, beams "
                 f"{','.join(map(str, report['beams']))}", fontsize=10)
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
