"""Goodput analysis of stored runs, for the whole cluster and for each replica, and the
`slotserve report` command that prints it as a table, CSV or JSON.

Every latency and goodput figure comes from `metrics.definitions.summarize` (the docs/ARCHITECTURE.md
definitions); this module only groups requests and steps by replica and adds what needs the
steps or the spread across replicas:

- A replica's rows cover the requests routed to it, whatever their end, over its own makespan
  (its first arrival to its last completion), so per-replica throughputs do not add up to the
  cluster's. Requests rejected before reaching a replica count only in the cluster row.
- occupancy: mean over a replica's steps of live_slots / num_slots; the cluster figure is the
  mean over replicas (the average replica), so a replica that stepped more does not weigh more.
- slot efficiency: useful rows / computed rows over the steps in scope.
- imbalance: max over mean across replicas of the requests and of the output tokens each
  served; 1.0 is perfectly even. Replicas are those named by a request, a step or a routing
  decision's scores, so an idle replica counts with zero.
- rejected ('rejected'), failed ('error') and aborted ('abort') requests miss every SLO.
- preemptions: as the replicas' steps counted them (every step is recorded);
  `num_preemptions` sums the request rows' counts, which only a client that knew them fills.
- prefix hit rate: the share of the prompt tokens of requests that reached a replica that no
  step computed (1 - prefill tokens of the steps / those prompt tokens): what prefix caching
  skipped. Recompute after a preemption counts against it; a run without steps has none.
- regret: the routing decision audit of `metrics.audit` (TTFT lost against the best replica
  in hindsight); with several runs, `format_report` ends with it summarised per policy.
- TTFT prediction MAPE: for a policy that predicts TTFT (`Decision.predicted_ttft`), the mean
  over requests that made a first token of |predicted - measured| / measured TTFT, the prediction of a request's
  last decision (a moved request's is where it ended); None for a run with no prediction.
- prefix index staleness: for a prefix-aware policy (`Decision.believed_cached`), the share of
  the prompt tokens it believed cached on the replica it chose that the replica's cache did not
  hold when it admitted the request (the request's `cached_tokens`): 1 - sum of min(found,
  believed) / sum of believed, over requests with both known and something believed; the
  request's last decision counts, as for the MAPE. None for a run without such requests.
- SLO met by cache outcome: the SLO attainment of the requests whose prompt found some of its
  tokens in the prefix cache at admission (`cached_tokens` > 0) and of those that found none,
  over the requests that reached a replica and reported it. Where a prompt is mostly a shared
  prefix, a router's goodput is about its hits' share times their attainment plus the same for
  its misses, so this splits what placement decided from what load did.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import asdict

import numpy as np

from metrics.audit import audit
from metrics.definitions import SLO, RequestTrace, percentiles, slot_efficiency, summarize
from metrics.store import MetricsStore, StoreError


def analyze_by_policy(store: MetricsStore, run_ids: list[int], slo: SLO) -> dict[str, list[dict]]:
    """Each run's `analyze`, grouped by its routing policy (a policy's rounds in run order): what
    `slotserve run`'s verdict and its picture both read."""
    by_policy: dict[str, list[dict]] = {}
    for run_id in run_ids:
        analysis = analyze(store, run_id, slo)
        by_policy.setdefault(analysis["routing_policy"], []).append(analysis)
    return by_policy


def analyze(store: MetricsStore, run_id: int, slo: SLO = SLO()) -> dict:
    """Throughput, goodput, SLO attainment, latency percentiles, occupancy, slot efficiency
    and failures of one run, for the cluster and per replica, plus the imbalance across replicas."""
    run = store.run(run_id)
    traces, steps, decisions = store.traces(run_id), store.steps(run_id), store.decisions(run_id)
    replica_ids = sorted(
        {t.replica for t in traces if t.replica is not None}
        | {s["replica_id"] for s in steps}
        | {r for d in decisions for r in d["scores"] or {}}
    )
    replicas = {
        r: _scope([t for t in traces if t.replica == r], [s for s in steps if s["replica_id"] == r], slo)
        for r in replica_ids
    }
    cluster = _scope(traces, steps, slo)
    occupancies = [r["occupancy"] for r in replicas.values() if r["occupancy"] is not None]
    cluster["occupancy"] = float(np.mean(occupancies)) if occupancies else None
    lateness = [r["submit_lateness"] for r in store.requests(run_id) if r["submit_lateness"] is not None]
    return {
        "run_id": run["run_id"],
        "name": run["name"],
        "status": run["status"],
        "complete": run["complete"],
        "batching_policy": run["batching_policy"],
        "routing_policy": run["routing_policy"],
        "seed": run["seed"],
        "simulated": run["simulated"],
        "git_commit": run["git_commit"],
        "slo": asdict(slo),
        "cluster": cluster,
        "replicas": replicas,
        "imbalance": {
            "requests": _imbalance([r["num_requests"] for r in replicas.values()]),
            "output_tokens": _imbalance([r["output_tokens"] for r in replicas.values()]),
        },
        "submit_lateness": percentiles(lateness),
        "prefix_hit_rate": _prefix_hit_rate(traces, steps),
        "regret": audit(traces),
        "ttft_prediction": ttft_prediction_error(traces, decisions),
        "index_staleness": index_staleness(traces, decisions),
        "slo_by_cache": slo_by_cache(traces, slo),
    }


def slo_by_cache(traces: list[RequestTrace], slo: SLO) -> dict[str, dict]:
    """`cached` and `computed` (see the module docstring): each group's `requests` and its
    `slo_met` share (None for an empty group)."""
    groups: dict[str, list[RequestTrace]] = {"cached": [], "computed": []}
    for t in traces:
        if t.replica is not None and t.cached_tokens is not None:
            groups["cached" if t.cached_tokens > 0 else "computed"].append(t)
    return {
        name: {
            "requests": len(group),
            "slo_met": sum(slo.met_by(t) for t in group) / len(group) if group else None,
        }
        for name, group in groups.items()
    }


def ttft_prediction_error(traces: list[RequestTrace], decisions: list[dict]) -> dict:
    """MAPE of the predicted TTFT against the measured one (see the module docstring) and the
    requests it is over; `mape` None when no request with a first token had a prediction."""
    predicted = {d["request_id"]: d["predicted_ttft"] for d in decisions}  # in time order: the last one stays
    errors = [
        abs(predicted[t.request_id] - t.ttft) / t.ttft
        for t in traces
        if t.ttft and predicted.get(t.request_id) is not None
    ]
    return {"mape": float(np.mean(errors)) if errors else None, "requests": len(errors)}


def index_staleness(traces: list[RequestTrace], decisions: list[dict]) -> dict:
    """How stale a prefix-aware router's view of the caches was (see the module docstring):
    `staleness` (None when nothing was believed cached), the `requests` it is over, and the
    prompt tokens `believed` cached and `found` of those at admission."""
    believed = {d["request_id"]: d.get("believed_cached") for d in decisions}  # the last one stays
    pairs = [
        (believed[t.request_id], t.cached_tokens)
        for t in traces
        if believed.get(t.request_id) and t.cached_tokens is not None
    ]
    total = sum(b for b, _ in pairs)
    found = sum(min(b, c) for b, c in pairs)
    return {
        "staleness": 1.0 - found / total if total else None,
        "requests": len(pairs),
        "believed": total,
        "found": found,
    }


def _prefix_hit_rate(traces: list[RequestTrace], steps: list[dict]) -> float | None:
    prompt = sum(t.prompt_len for t in traces if t.replica is not None)
    if not steps or not prompt:
        return None
    return max(0.0, 1.0 - sum(s["num_prefill_tokens"] or 0 for s in steps) / prompt)


def _scope(traces: list[RequestTrace], steps: list[dict], slo: SLO) -> dict:
    """One row of the analysis: the requests and steps of the cluster or of one replica."""
    if traces:
        row = summarize(traces, slo).as_dict()
        del row["slo"]  # stated once per run
    else:  # an idle replica, or a run killed before any request ended
        none = percentiles([])
        row = {
            "num_requests": 0,
            "num_served": 0,
            "output_tokens": 0,
            "makespan": 0.0,
            "throughput": 0.0,
            "goodput": 0.0,
            "goodput_requests": 0.0,
            "slo_attainment": None,
            "ttft": none,
            "tpot": none,
            "itl": none,
            "e2e": none,
            "num_preemptions": 0,
        }
    ends = Counter(t.finish_reason for t in traces)
    ratios = [s["live_slots"] / s["num_slots"] for s in steps if s["num_slots"]]
    row.update(
        rejected=ends["rejected"],
        failed=ends["error"],
        aborted=ends["abort"],
        num_steps=len(steps),
        preemptions=sum(s["num_preemptions"] or 0 for s in steps),
        occupancy=float(np.mean(ratios)) if ratios else None,
        slot_efficiency=slot_efficiency(
            [s["useful_rows"] or 0 for s in steps], [s["computed_rows"] or 0 for s in steps]
        )
        if steps
        else None,
    )
    return row


def _imbalance(served: list[int]) -> float | None:
    mean = float(np.mean(served)) if served else 0.0
    return max(served) / mean if mean else None


# --- output -----------------------------------------------------------------------------

_COLUMNS = [  # header, width, value of a scope row
    ("reqs", 5, lambda r: r["num_requests"]),
    ("rej", 4, lambda r: r["rejected"]),
    ("fail", 4, lambda r: r["failed"]),
    ("out tok", 8, lambda r: r["output_tokens"]),
    ("tok/s", 8, lambda r: f"{r['throughput']:.1f}"),
    ("good tok/s", 10, lambda r: f"{r['goodput']:.1f}"),
    ("good req/s", 10, lambda r: f"{r['goodput_requests']:.2f}"),
    ("SLO met", 7, lambda r: _pct(r["slo_attainment"])),
    ("TTFT p50", 8, lambda r: _sec(r["ttft"]["p50"])),
    ("TTFT p90", 8, lambda r: _sec(r["ttft"]["p90"])),
    ("TTFT p99", 8, lambda r: _sec(r["ttft"]["p99"])),
    ("TPOT p50", 8, lambda r: _sec(r["tpot"]["p50"])),
    ("TPOT p99", 8, lambda r: _sec(r["tpot"]["p99"])),
    ("ITL p99", 8, lambda r: _sec(r["itl"]["p99"])),
    ("E2E p99", 8, lambda r: _sec(r["e2e"]["p99"])),
    ("occup", 6, lambda r: _pct(r["occupancy"])),
    ("slot eff", 8, lambda r: _pct(r["slot_efficiency"])),
    ("preempt", 7, lambda r: r["preemptions"]),
]


def _sec(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_report(analyses: list[dict]) -> str:
    """A table per run: the cluster row, then one row per replica; latencies in seconds."""
    blocks = []
    for a in analyses:
        slo = a["slo"]
        status = "complete"
        if not a["complete"]:
            why = "still running, or stopped before end_run" if a["status"] == "running" else f"ended {a['status']}"
            status = f"INCOMPLETE ({why}; figures cover what was stored)"
        name_width = max([7] + [len(r) for r in a["replicas"]])
        lines = [
            f"run {a['run_id']} {a['name']!r}: {status}",
            f"batching {a['batching_policy']}, routing {a['routing_policy']}, seed {a['seed']}"
            f"{', simulated' if a['simulated'] else ''}, commit {(a['git_commit'] or 'unknown')[:12]}",
            f"SLO: TTFT <= {slo['ttft']} s, TPOT <= {slo['tpot']} s, E2E "
            f"{'<= ' + str(slo['e2e']) + ' s' if slo['e2e'] is not None else 'not limited'}; "
            "rejected, failed and aborted requests miss it",
            "  ".join([f"{'scope':<{name_width}}"] + [f"{h:>{w}}" for h, w, _ in _COLUMNS]),
        ]
        for scope, row in [("cluster", a["cluster"])] + list(a["replicas"].items()):
            lines.append("  ".join([f"{scope:<{name_width}}"] + [f"{value(row)!s:>{w}}" for _, w, value in _COLUMNS]))
        lines.append(
            f"imbalance over {len(a['replicas'])} replicas (max/mean): requests "
            f"{_ratio(a['imbalance']['requests'])}, output tokens {_ratio(a['imbalance']['output_tokens'])}"
        )
        late = a["submit_lateness"]
        if late["max"] is not None:
            lines.append(f"driver submit lateness: p99 {_sec(late['p99'])} s, max {_sec(late['max'])} s")
        lines.append(f"prefix cache hit rate {_pct(a['prefix_hit_rate'])}; {_regret_line(a['regret'])}")
        by_cache = a["slo_by_cache"]
        if by_cache["cached"]["requests"]:
            cached, computed = by_cache["cached"], by_cache["computed"]
            lines.append(
                f"SLO met by {_pct(cached['slo_met'])} of the {cached['requests']} requests that found a cached "
                f"prefix, {_pct(computed['slo_met'])} of the {computed['requests']} that found none"
            )
        if a["index_staleness"]["staleness"] is not None:
            s = a["index_staleness"]
            lines.append(
                f"prefix index staleness {_pct(s['staleness'])}: of {s['believed']} prompt tokens the router "
                f"believed cached over {s['requests']} requests, {s['found']} were at admission"
            )
        if a["ttft_prediction"]["mape"] is not None:
            p = a["ttft_prediction"]
            lines.append(
                f"TTFT prediction MAPE {_pct(p['mape'])} over {p['requests']} requests (predicted vs measured)"
            )
        blocks.append("\n".join(lines))
    if len({a["routing_policy"] for a in analyses}) > 1:
        blocks.append(format_policy_audit(analyses))
    return "\n\n".join(blocks)


def _regret_line(r: dict) -> str:
    if not r["audited"]:
        return "routing regret: nothing to compare (one replica, or no TTFT)"
    return (
        f"routing regret (TTFT lost against the best replica in hindsight, {r['audited']} decisions): "
        f"mean {_sec(r['mean'])} s, p99 {_sec(r['regret']['p99'])} s, best replica chosen {_pct(r['best_share'])}"
    )


def format_policy_audit(analyses: list[dict]) -> str:
    """The decision audit per routing policy over the given runs: decisions audited, mean
    regret (the mean of the runs' means), p99 (the runs' median), best replica chosen, and the
    prefix hit rate."""
    by_policy: dict[str, list[dict]] = {}
    for a in analyses:
        by_policy.setdefault(a["routing_policy"], []).append(a)
    lines = [
        "decision audit per routing policy (regret: TTFT lost against the best replica in hindsight)",
        f"{'policy':<18}{'runs':>5}{'decisions':>10}{'mean s':>9}{'p99 s':>8}{'best':>7}{'prefix hit':>11}",
    ]
    for policy, runs in by_policy.items():
        audited = [a["regret"] for a in runs if a["regret"]["audited"]]
        hits = [a["prefix_hit_rate"] for a in runs if a["prefix_hit_rate"] is not None]
        mean = float(np.mean([r["mean"] for r in audited])) if audited else None
        p99 = float(np.median([r["regret"]["p99"] for r in audited])) if audited else None
        best = float(np.mean([r["best_share"] for r in audited])) if audited else None
        lines.append(
            f"{policy:<18}{len(runs):>5}{sum(r['audited'] for r in audited):>10}{_sec(mean):>9}{_sec(p99):>8}"
            f"{_pct(best):>7}{_pct(float(np.mean(hits)) if hits else None):>11}"
        )
    return "\n".join(lines)


def to_csv(analyses: list[dict]) -> str:
    """One row per run and scope ('cluster', or 'replica' with its id); percentiles are
    flattened to columns like ttft_p99; imbalance is on cluster rows only."""
    rows = []
    for a in analyses:
        run = {k: a[k] for k in ("run_id", "name", "status", "complete", "batching_policy", "routing_policy", "seed")}
        run.update({f"slo_{k}": v for k, v in a["slo"].items()})
        scopes = [("cluster", "", a["cluster"])] + [("replica", r, row) for r, row in a["replicas"].items()]
        for scope, replica, row in scopes:
            flat = {**run, "scope": scope, "replica_id": replica}
            for key, value in row.items():
                flat.update({f"{key}_{q}": v for q, v in value.items()} if isinstance(value, dict) else {key: value})
            if scope == "cluster":
                flat.update({f"imbalance_{k}": v for k, v in a["imbalance"].items()})
                flat.update(prefix_hit_rate=a["prefix_hit_rate"], regret_mean=a["regret"]["mean"])
                flat.update(ttft_prediction_mape=a["ttft_prediction"]["mape"])
                flat.update({f"slo_met_{k}": v["slo_met"] for k, v in a["slo_by_cache"].items()})
            rows.append(flat)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


# --- command line -----------------------------------------------------------------------


def resolve_run(store: MetricsStore, ref: str) -> int:
    """A RUN argument: a run id, or 'latest' for the most recently begun run."""
    if ref == "latest":
        runs = store.runs()
        if not runs:
            raise StoreError(f"no runs in {store.path} yet, so there is no 'latest'")
        return runs[-1]["run_id"]
    try:
        return int(ref)
    except ValueError:
        raise StoreError(f"RUN must be a run id or 'latest'; got {ref!r}") from None
