"""`explain`: why a SID or an ad is, or is not, retrieved for one request."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sidindex.errors import InputError
from sidindex_cli.options import JSON_OPT, SNAPSHOT_ARG
from sidindex_cli.render import emit, out, print_explanation

app = typer.Typer()


@app.command()
def explain(
    snapshot: Path = SNAPSHOT_ARG,
    request: Path = typer.Option(..., "--request", help="Request table (Parquet or Arrow IPC), see "
                                 "schemas/CONTRACTS.md."),
    request_id: Optional[int] = typer.Option(None, "--request-id", help="Which request of the table (default: "
                                             "the only one)."),
    sid: Optional[str] = typer.Option(None, "--sid", help="A SID, tokens separated by commas: 12,40,7,300."),
    ad: Optional[int] = typer.Option(None, "--ad", help="An ad_id: explains each of its SIDs for that ad."),
    max_ads: int = typer.Option(20, "--max-ads", min=0, help="Ads listed per SID in the tables (--json lists all)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Why a SID or an ad is, or is not, retrieved for one request.

    Walks the SID down the trie. At each position: is the prefix in the catalog (cd), do the
    subtree-union matchers pass (cd+gtm, naming each failing attribute), does any k-way partition
    pass (cd+gtm+kway, when built). Then the exact filter, ad by ad, naming the attributes an
    ineligible ad fails. With --ad, every SID of that ad is explained for that ad alone.
    """
    from sidindex.explain import Explainer, request_row
    from sidindex.requests import read_requests
    from sidindex.snapshot import open_snapshot

    if (sid is None) == (ad is None):
        raise InputError("explain: give exactly one of --sid S and --ad A")
    snap = open_snapshot(snapshot, verify=False)  # a ROOT's published snapshot, or a snapshot directory
    reqs = read_requests(request, snap.spec)
    row = request_row(reqs, request_id)
    ex = Explainer(snap, reqs, row)
    results = ex.sid(parse_sid(sid)) if sid is not None else None
    results = [results] if results is not None else ex.ad(ad)
    values = reqs.columns.slice(row, 1).to_pylist()[0]
    if as_json:
        emit({"snapshot_id": snap.id, "request_id": int(reqs.request_id[row]), "request": values,
               "explanations": [r.to_dict() for r in results]}, True, "")
        return
    out.print(f"request {int(reqs.request_id[row])}: " + "  ".join(
        f"{k}={v}" if not isinstance(v, list) else f"{k}=[{len(v)} values]" for k, v in values.items()),
        highlight=False)
    for r in results:
        print_explanation(r, max_ads)


def parse_sid(text: str) -> tuple[int, ...]:
    """'12,40,7,300' (commas or spaces) -> (12, 40, 7, 300)."""
    try:
        return tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise InputError(f"--sid {text!r}: expected integer tokens separated by commas, e.g. 12,40,7,300") from None
