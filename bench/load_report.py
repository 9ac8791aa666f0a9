"""The load benchmark's figures (`bench/bench_load.py`): per scenario latency percentiles,
throughput, the generator's lag, a timeline and the p99 during swaps against the rest; and the
report of a run: tables, notes and the verdicts it prints."""

from __future__ import annotations

import sys

import numpy as np

from bench.report import verdict


def percentiles(ms: np.ndarray) -> dict:
    if not len(ms):
        return {"p50_ms": None, "p99_ms": None, "p99.9_ms": None, "max_ms": None}
    p50, p99, p999 = np.percentile(ms, [50, 99, 99.9])
    return {"p50_ms": float(p50), "p99_ms": float(p99), "p99.9_ms": float(p999), "max_ms": float(ms.max())}


def load_figures(a: dict[str, np.ndarray], windows: list[dict], seconds: float) -> dict:
    """Over `seconds` of load: throughput, latency (from the scheduled send), failures by status, send lag, snapshots
    seen and the latency of requests in flight during a swap window against the others."""
    ok = a["status"] == 200
    latency = (a["done"] - a["t"]) * 1e3
    behind, lag = generator_lag(a)
    during = np.zeros(len(ok), bool)
    for w in windows:
        during |= (a["t"] <= w["until_s"]) & (a["done"] >= w["from_s"])
    failed = {}
    for code, err in zip(a["status"][~ok].tolist(), a["error"][~ok].tolist()):
        key = "transport" if code == 0 else str(code)
        failed.setdefault(key, {"count": 0, "first": err})["count"] += 1
    seen = list(dict.fromkeys(a["snapshot"][ok][np.argsort(a["done"][ok], kind="stable")].tolist()))
    span = float(a["done"][ok].max()) if ok.any() else float("nan")
    return {"sent": int(len(ok)), "ok": int(ok.sum()), "failed": int((~ok).sum()), "errors": failed,
            "offered_rps": len(ok) / seconds, "throughput_rps": float(ok.sum()) / span if ok.any() else 0.0,
            "latency": percentiles(latency[ok]), "sends_behind_previous": behind,
            "generator_lag_p99_ms": float(np.percentile(lag, 99) * 1e3) if len(lag) else None,
            "rows_per_answer": float(a["rows"][ok].mean()) if ok.any() else 0.0,
            "snapshots_seen": seen, "swaps_seen": max(0, len(seen) - 1),
            "during_swaps": int((during & ok).sum()),
            "p99_during_swaps_ms": percentiles(latency[ok & during])["p99_ms"],
            "p99_other_ms": percentiles(latency[ok & ~during])["p99_ms"],
            "timeline": timeline(a, latency, lag),
            "latencies_ms": np.round(latency[ok], 3).tolist()}


def timeline(a: dict[str, np.ndarray], latency: np.ndarray, lag: np.ndarray, step: float = 0.5) -> list[dict]:
    """Per `step` seconds of scheduled send time: sends, failures, latency p50 and max of the
    answered, the generator lag's max (where a stall came from: the server or the generator)."""
    ok = a["status"] == 200
    bucket = (a["t"] // step).astype(np.int64)
    out = []
    for b in np.unique(bucket).tolist():
        m = bucket == b
        lat = latency[m & ok]
        out.append({"from_s": b * step, "sent": int(m.sum()), "failed": int((m & ~ok).sum()),
                    "p50_ms": round(float(np.median(lat)), 2) if len(lat) else None,
                    "max_ms": round(float(lat.max()), 2) if len(lat) else None,
                    "lag_max_ms": round(float(lag[m].max()) * 1e3, 2)})
    return out


def generator_lag(a: dict[str, np.ndarray]) -> tuple[int, np.ndarray]:
    """Sends whose client was still waiting for its previous answer at the scheduled time (too
    few clients for the rate and latency), and per send the seconds from when its client was
    free to send it (its time, or its previous answer's) to when it did, in send order: the
    generator's own delay, which should stay well below the latencies measured."""
    order = np.lexsort((a["k"], a["client"]))
    client, t, done, sent = a["client"][order], a["t"][order], a["done"][order], a["sent"][order]
    previous = np.concatenate([[-np.inf], done[:-1]])
    previous[np.concatenate([[True], client[1:] != client[:-1]])] = -np.inf
    lag = np.empty(len(order))
    lag[order] = sent - np.maximum(t, previous)
    return int((previous > t).sum()), lag


def ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def report(res: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 220)
    c, cat = res["config"], res["catalog"]
    for s in res["scenarios"]:
        t = Table(title=f"{s['scenario']}: {cat['ads']:,} ads ({cat.get('profile', 'default')}, {res['device']}), "
                        f"{c['mode']}, beams {c['beams']}, "
                        f"{c['rate']:g} req/s offered ({c['arrivals']}) from {c['clients']} clients for "
                        f"{s['seconds']:g} s, max batch {c['max_batch']}; ms from the scheduled send",
                  title_justify="left")
        for col in ("sent", "ok", "req/s", "p50", "p99", "p99.9", "max", "failed", "checked", "mismatches",
                    "swaps seen", "p99 in swaps", "p99 other", "in swaps", "rows/answer", "rows/batch",
                    "gen lag p99"):
            t.add_column(col, justify="right")
        lat, srv = s["latency"], s["server"]
        failed = ", ".join(f"{k}: {v['count']}" for k, v in s["errors"].items()) or "0"
        per_batch = f"{srv['batch_rows'] / srv['batches']:.1f}" if srv.get("batches") else "-"
        t.add_row(str(s["sent"]), str(s["ok"]), f"{s['throughput_rps']:,.0f}", ms(lat["p50_ms"]), ms(lat["p99_ms"]),
                  ms(lat["p99.9_ms"]), ms(lat["max_ms"]), failed, str(s["checked"]),
                  f"{s['mismatches']} ({s['near_ties']} ties)" if s["near_ties"] else str(s["mismatches"]),
                  str(s["swaps_seen"]), ms(s["p99_during_swaps_ms"]), ms(s["p99_other_ms"]), str(s["during_swaps"]),
                  f"{s['rows_per_answer']:.1f}", per_batch, ms(s["generator_lag_p99_ms"]))
        console.print(t)
        for line in scenario_notes(s):
            console.print("  " + line, highlight=False)
    w = res.get("wrk")
    if w is not None and "missing" in w:
        console.print(f"wrk: {w['missing']} not found (the Debian package wrk); no closed-loop pass", highlight=False)
    elif w is not None:
        t = Table(title=f"wrk, a client we did not write: {w['connections']} connections, {w['threads']} threads, "
                        f"{w['seconds']:g} s, closed loop, one request per JSON body ({w['command']})",
                  title_justify="left")
        for col in ("requests", "req/s", "p50", "p90", "p99", "non-2xx", "socket errors"):
            t.add_column(col, justify="right")
        t.add_row(f"{w['requests']:,}" if w["requests"] is not None else "-", f"{w['rps']:,.0f}", ms(w["p50_ms"]),
                  ms(w["p90_ms"]), ms(w["p99_ms"]), str(w["non_2xx"]), str(w["socket_errors"]))
        console.print(t)
    if res.get("compared"):
        console.print(compared_table(res))
    console.print(f"server: ready {res['server_ready_s']:.1f} s after start; exit code {res['server_exit']} on "
                  f"SIGTERM; {res['server_tracebacks']} tracebacks in its log; checks {res['check_s']:.1f} s",
                  highlight=False)
    for s in res["scenarios"]:
        for ok, line in verdicts(s):
            console.print(verdict(ok, f"{s['scenario']}: {line}"), highlight=False)
    for f in res.get("compared", []):
        name = f"steady, --workers {f['workers']}"
        for ok, line in verdicts(f["steady"]) + [(f["server_exit"] == 0 and f["server_tracebacks"] == 0,
                                                 f"exit code {f['server_exit']} on SIGTERM, "
                                                 f"{f['server_tracebacks']} tracebacks")]:
            console.print(verdict(ok, f"{name}: {line}"), highlight=False)


def compared_table(res: dict):
    """The steady scenario and wrk per server process model (`--workers`), the first run's as the
    reference of the ratios."""
    from rich.table import Table

    c = res["config"]
    first = next((s for s in res["scenarios"] if s["scenario"] == "steady"), None)
    rows = [({"workers": c["workers"][0], "server_ready_s": res["server_ready_s"], "wrk": res.get("wrk"),
              "server_exit": res["server_exit"], "server_tracebacks": res["server_tracebacks"]}, first)]
    rows += [(f, f["steady"]) for f in res["compared"]]
    t = Table(title=f"server processes (--workers): steady {c['rate']:g} req/s offered from {c['clients']} clients, "
                    "and wrk's closed loop; ratios against the first row", title_justify="left")
    for col in ("workers", "ready s", "req/s", "p50", "p99", "failed", "mismatches", "wrk req/s", "wrk p99",
                "wrk / first", "exit", "tracebacks"):
        t.add_column(col, justify="right")
    base = (rows[0][0].get("wrk") or {}).get("rps")
    for f, s in rows:
        w = f.get("wrk") or {}
        ratio = f"{w['rps'] / base:.2f}x" if base and w.get("rps") else "-"
        t.add_row("default" if f["workers"] is None else str(f["workers"]), f"{f.get('server_ready_s', 0):.1f}",
                  f"{s['throughput_rps']:,.0f}" if s else "-", ms(s["latency"]["p50_ms"]) if s else "-",
                  ms(s["latency"]["p99_ms"]) if s else "-", str(s["failed"]) if s else "-",
                  str(s["mismatches"]) if s else "-", f"{w['rps']:,.0f}" if w.get("rps") else "-",
                  ms(w.get("p99_ms")), ratio, str(f.get("server_exit")), str(f.get("server_tracebacks")))
    return t


def scenario_notes(s: dict) -> list[str]:
    out = []
    updates = [e for e in s["events"] if e["kind"] == "update"]
    if updates:
        took = np.mean([e["finished_s"] - e["started_s"] for e in updates])
        failed = [e for e in updates if "error" in e]
        out.append(f"publisher: {len(updates) - len(failed)} updates published ({took:.2f} s each), "
                   f"{sum(len(e['paused']) for e in updates)} ads paused, "
                   f"{sum(e['paused_returned'] for e in updates)} of them just returned by a probe"
                   + (f"; {len(failed)} failed: {failed[0]['error'].splitlines()[-1]}" if failed else ""))
    for w in s["windows"]:
        sent = "sent" if w["snapshot"] == "a large request" else "published"
        out.append(f"{w['snapshot']}: {sent} at {w['from_s']:.2f} s, {w['outcome']} at {w['until_s']:.2f} s")
    srv = s["server"]
    if srv["swaps"]:
        out.append(f"server: {srv['swaps']:.0f} swaps, {srv['swap_seconds'] / srv['swaps']:.2f} s each to load and "
                   "warm (sidindex_swap_seconds)")
    if s["last_errors_seen"]:
        out.append(f"/snapshot last_error: {s['last_errors_seen'][0]}")
    for k, v in s["errors"].items():
        out.append(f"failed ({k}): {v['count']}, the first: {v['first']}")
    if s["sends_behind_previous"] > 0.01 * s["sent"]:
        out.append(f"{s['sends_behind_previous']} sends waited for their client's previous answer (latency counts the "
                   "wait; more --clients would have sent them on time)")
    if s["mismatched_requests"]:
        out.append(f"mismatches came from {len(s['mismatched_requests'])} pool requests (mismatches/answers): "
                   + ", ".join(f"{i}: {n}/{m}" for i, (n, m) in list(s["mismatched_requests"].items())[:12]))
    out += [f"mismatch: {m}" for m in s["mismatch_samples"]]
    return out


def verdicts(s: dict) -> list[tuple[bool, str]]:
    """What a user relies on, per scenario."""
    ties = f" ({s['near_ties']} of them near ties: the same scores within 1e-5 rank by rank, ads of near-equal " \
        "scores in another order)" if s["near_ties"] else ""
    # a large body answered is checked request by request with the single answers
    large = sum(e["rows"] for e in s["events"] if e["kind"] == "large request" and e["status"] == 200)
    within = f" ({large:,} of them the large body's requests)" if large else ""
    out = [(s["checked"] == s["ok"] + large and s["ok"] > 0 and s["mismatches"] == 0,
            f"{s['checked']} answers checked{within}, {s['mismatches']} differ from a direct retrieve on the "
            f"snapshot they name{ties}"),
           (s["failed"] == 0, f"{s['failed']} of {s['sent']} requests failed")]
    if s["scenario"] == "publisher":
        out.append((s["swaps_seen"] >= 1, f"{s['swaps_seen']} swaps seen in the answers"))
    if s["scenario"] == "large":
        large = [e for e in s["events"] if e["kind"] == "large request"]
        srv = s["server"]
        batch_ms = 1e3 * srv["batch_seconds"] / srv["batches"] if srv.get("batches") else None
        for e in large:
            out.append((e["status"] == 200, f"the large body of {e['rows']:,} requests: status {e['status']}, rows "
                        f"for {e['requests_answered']:,} of them (each request's checked with the answers above), "
                        f"in {e['finished_s'] - e['started_s']:.2f} s"))
        during, other = s["p99_during_swaps_ms"], s["p99_other_ms"]
        if large and during is not None and other is not None and batch_ms is not None:
            out.append((during <= other + 2 * batch_ms,
                        f"requests in flight beside it: p99 {during:.1f} ms against {other:.1f} ms for the others; "
                        f"within two batches ({2 * batch_ms:.1f} ms) of them"))
    if s["scenario"] == "corrupt":
        corrupt = {e["snapshot"] for e in s["events"] if e["kind"] == "corrupt"}
        refused = [w for w in s["windows"] if w["snapshot"] in corrupt and w["outcome"] == "refused"]
        served = corrupt & set(s["snapshots_seen"])
        why = refused[0]["last_error"].rpartition(": ")[2] if refused else None
        out.append((len(refused) == len(corrupt) > 0 and not served,
                    f"the corrupt snapshot was {'served' if served else 'refused' if refused else 'not refused'}"
                    + (f", /snapshot's last_error set ('... {why}')" if why else "")))
        out.append((bool(s.get("answered_while_refused")),
                    f"{s.get('answered_while_refused')} answers from the old snapshot after the refusal"))
        intact = {e["snapshot"] for e in s["events"] if e["kind"] == "intact copy"}
        recovered = intact & set(s["snapshots_seen"]) and s["snapshot_after"]["last_error"] is None
        out.append((bool(recovered), "an intact snapshot published next was served, last_error cleared" if recovered
                    else "an intact snapshot published next was not served"))
    return out
