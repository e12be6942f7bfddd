"""The routing decision audit: how much TTFT each decision lost against the best replica in
hindsight, read off a run's requests alone (so it audits any router, Ray Serve's included).

What a request would have waited on a replica it was not sent to is not observed, so it is
estimated by a neighbour: the TTFT of the request that replica got with the arrival nearest
this one's, within `window` seconds (a replica that got none that close is left out of the
comparison). The best replica in hindsight is the one of least TTFT among the chosen
replica's own (the request's real TTFT) and those estimates; the decision's regret is its
TTFT minus that best, so 0 when the chosen replica was the best. Neighbours differ in prompt
length and prefix hits, so one decision's regret is noisy; a policy's mean over a run is the
figure to compare.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from metrics.definitions import RequestTrace, percentiles

WINDOW = 1.0  # seconds: how far a neighbour's arrival may be from the audited request's


def regrets(traces: list[RequestTrace], window: float = WINDOW) -> list[float]:
    """Per audited request (one with a TTFT and at least one other replica to compare), its regret in seconds."""
    served = [t for t in traces if t.replica is not None and t.ttft is not None]
    by_replica: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in served:
        by_replica[t.replica].append((t.arrival, t.ttft))
    arrivals = {}
    for replica, rows in by_replica.items():
        rows.sort()
        arrivals[replica] = [a for a, _ in rows]
    out = []
    for t in served:
        estimates = []
        for replica, rows in by_replica.items():
            if replica == t.replica:
                continue
            i = bisect.bisect_left(arrivals[replica], t.arrival)
            near = [rows[j] for j in (i - 1, i) if 0 <= j < len(rows) and abs(rows[j][0] - t.arrival) <= window]
            if near:
                estimates.append(min(near, key=lambda row: abs(row[0] - t.arrival))[1])
        if estimates:
            out.append(max(0.0, t.ttft - min(estimates)))
    return out


def audit(traces: list[RequestTrace], window: float = WINDOW) -> dict:
    """Regret summary: decisions audited, mean and percentiles of regret (s), and the share of
    decisions that went to the best replica in hindsight."""
    r = regrets(traces, window)
    return {
        "audited": len(r),
        "mean": float(np.mean(r)) if r else None,
        "regret": percentiles(r),
        "best_share": sum(x == 0 for x in r) / len(r) if r else None,
        "window": window,
    }
