"""How well the simulator ranks an experiment's cells: the runs of one experiment file on a Ray
cluster (`slotserve experiment FILE --store CLUSTER.db`) set against its simulated runs
(`slotserve experiment FILE --simulate --store SIM.db`), cell by cell. Each side may be several
stores (an experiment run in parts), read as one.

A cell is a (routing, load) pair (and its batching, slots, token budget, workload,
prefill/decode split and scaling when the file sweeps them); its figure is the median over the
seeds both sides ran (each seed's latest complete run), read with the SLO each run was recorded
with. Cells run on only one side (Ray Serve's routers have no simulated twin) are listed and
left out of the comparison. Prints
per cell simulated against cluster TTFT p90 and p50, goodput and the share of requests that met
the SLO (near saturation few do, and a few requests either side of a limit move goodput by tens
of percent: the share says how many), then the Spearman rank
correlation of each metric across the cells both sides ran (average ranks for ties; target for
TTFT p90: at least 0.9; not judged on fewer than 3 cells), and the median relative error for
information. Where the cells split the replicas into prefill and decode pools, it also says per
point of the sweep whether both sides name the same winner, colocated or split (`winners`).
Where the cells size their cluster (`sweep.autoscale`), it also sets per cell the simulated
replica-seconds and SLO attainment against the cluster's (`SCALED_TARGETS`: within 10% and
3 points).

With `--file` (the experiment file, whose cost model its fake replicas paid, one cost_scale for
all) it also prints what the cluster spent outside its steps, the figures the file's `[cluster]
step_overhead`, `dispatch_delay` and `submit_interval` give the simulator (`overheads`; a loop
that spends `sim.cost_model.MAX_LOOP_GAP` or more between steps reads as idle and is not
measured).

    .venv/bin/python -m benchmarks.experiment_fidelity --cluster results/kv-pressure-cluster.db [...] \\
        --sim results/kv-pressure-sim.db [...] [--experiment kv-pressure] [--file FILE.toml] [--json PATH]
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
from pathlib import Path

from benchmarks.fidelity import spearman
from experiments.pools_report import KNOBS
from experiments.scaling_report import replica_timeline
from metrics.definitions import SLO
from metrics.goodput_report import analyze
from metrics.store import MetricsStore
from protocol.cost import LinearCostModel, StepFeatures
from sim.cost_model import MAX_LOOP_GAP, step_overhead

# a cell without its seed
KEY = ("routing", "load", "batching", "slots", "token_budget", "workload", "pools", "scaling", "flow")
METRICS = {
    "ttft_p90": lambda a: a["cluster"]["ttft"]["p90"],
    "ttft_p50": lambda a: a["cluster"]["ttft"]["p50"],
    "goodput": lambda a: a["cluster"]["goodput"],
    "slo_attainment": lambda a: 100 * a["cluster"]["slo_attainment"],  # in percent
}
# a sized cell's replica-seconds within this relative error, its SLO attainment within these points
SCALED_TARGETS = {"replica_seconds": 0.10, "slo_attainment": 3.0}
TARGET = 0.9  # Spearman of TTFT p90 across the cells (read to 9 digits: one swap in five cells, exactly
# the target, comes out of the correlation of ranks an ulp under it)

# Requests planned closer than this are sent as soon as the client can: the gap between their
# sends is the client's own time per request (`submit_interval`).
BURST_GAP = 0.001


def experiment_runs(store: MetricsStore, experiment: str, simulated: bool) -> list[dict]:
    """The complete runs of `experiment` in `store`, the simulated ones or the real ones (one
    store may hold both)."""
    return [
        run
        for run in store.runs()
        if (run["config"] or {}).get("experiment") == experiment and run["complete"] and run["simulated"] == simulated
    ]


def runs_by_cell(path: Path, experiment: str, simulated: bool) -> dict[tuple, dict[int, dict[str, float]]]:
    """Per cell of `experiment` in the store, each seed's figures (its latest complete run)."""
    store = MetricsStore(path)
    runs: dict[tuple, dict[int, dict[str, float]]] = {}
    try:
        for run in experiment_runs(store, experiment, simulated):
            config = run["config"]
            a = analyze(store, run["run_id"], SLO(**(run["slo"] or {})))
            key = tuple(config["cell"].get(k, "") for k in KEY)  # a store from before pools, scaling or flow lacks them
            figures = {m: f(a) for m, f in METRICS.items()}
            if config.get("scaling"):
                figures["replica_seconds"] = replica_timeline(store, run["run_id"]).replica_seconds
            runs.setdefault(key, {})[run["seed"]] = figures
    finally:
        store.close()
    return runs


def medians(by_seed: dict[int, dict[str, float]], seeds: set[int]) -> dict[str, float]:
    """Each figure's median over `seeds` (a cell is set against its twin on the seeds both ran)."""
    runs = [f for s, f in by_seed.items() if s in seeds]
    return {m: statistics.median(r[m] for r in runs if r.get(m) is not None) for m in runs[0]}


def cells(path: Path, experiment: str, simulated: bool) -> dict[tuple, dict[str, float]]:
    """Per cell of `experiment` in the store, the median over its seeds of each figure."""
    by_cell = runs_by_cell(path, experiment, simulated)
    return {key: medians(by_seed, set(by_seed)) for key, by_seed in by_cell.items()}


def scaled(sim: dict[str, float], real: dict[str, float]) -> dict[str, tuple[float, bool]] | None:
    """A sized cell's simulated replica-seconds (relative error) and SLO attainment (points)
    against the cluster's, each with whether it is within `SCALED_TARGETS`; None for a cell that
    does not size its cluster."""
    if "replica_seconds" not in sim or "replica_seconds" not in real:
        return None
    seconds = (sim["replica_seconds"] - real["replica_seconds"]) / real["replica_seconds"]
    points = sim["slo_attainment"] - real["slo_attainment"]
    return {
        "replica_seconds": (seconds, abs(seconds) <= SCALED_TARGETS["replica_seconds"]),
        "slo_attainment": (points, abs(points) <= SCALED_TARGETS["slo_attainment"]),
    }


def winners(side: dict[tuple, dict[str, float]]) -> dict[tuple, str]:
    """Per point of a sweep with both colocated cells (no prefill pool) and cells split into
    prefill and decode pools, which arrangement's best cell has the more goodput: "split" or
    "colocated" (the point: a cell's key with its `KNOBS` None). Empty for an experiment without pools."""
    best: dict[tuple, dict[bool, float]] = {}
    for key, figures in side.items():
        cell = dict(zip(KEY, key))
        point = tuple(None if k in KNOBS else v for k, v in cell.items())
        split = bool(cell["pools"]) and int(cell["pools"].split(":")[0]) > 0
        kinds = best.setdefault(point, {})
        kinds[split] = max(kinds.get(split, -math.inf), figures["goodput"])
    return {p: "split" if k[True] > k[False] else "colocated" for p, k in best.items() if len(k) == 2}


def label(key: tuple, shown: list[str]) -> str:
    """A cell by the parts of its key that vary across the compared cells."""
    return " ".join(f"{k}={v}" for k, v in zip(KEY, key) if k in shown)


def overheads(paths: list[Path], experiment: str, file: Path, simulated: bool = False) -> dict[str, float | None]:
    """What the cluster's runs of `experiment` (in the stores at `paths`, pooled; the simulated
    runs instead with `simulated`, to read back what the simulator paid) spent outside their
    steps, as the simulator's `[cluster]` keys take it: `step_overhead` (the serving loop's
    seconds per step beyond the price `file`'s cost model puts on it; over slotserve's replicas,
    and apart over Ray Serve's) and `dispatch_delay` (slotserve's: the median, over requests
    that found their replica idle, from arrival to the start of the step that made their first
    token, plus the median from such a step's start, past its price, to the client's receipt of
    that token). A simulated replica stamps a step's tokens at its priced end and
    `step_overhead` delays only its next step, so the loop's time before a token is out delays
    the token through `dispatch_delay` alone, and the next step through `step_overhead` alone,
    as on the cluster. And `submit_interval` (slotserve's): the median, over two requests
    planned within `BURST_GAP` of each other, of the time between the client's sends of them,
    what it spends on one request.

    Both read a step as followed at once by the next when the gap between them is under
    `MAX_LOOP_GAP` (else the replica waited for an arrival), so a loop that spends that long or
    more between two steps is not measured (those pairs read as idle). `file` must price every
    replica alike: with `cost_scales` there is no one price to read the steps against."""
    from cluster.serve_baseline import SERVE_ROUTERS
    from experiments.plan import plan_experiment

    plan = plan_experiment(file, simulate=True)
    if plan.experiment.cluster.cost_scales is not None:
        raise SystemExit(f"--file {file}: cost_scales prices each replica apart; give a file with one cost_scale")
    cost = plan.cost
    steps: dict[str, list[dict]] = {"slotserve": [], "serve": []}
    to_replica, after_start, sends = [], [], []
    for path in paths:
        store = MetricsStore(path)
        try:
            for run in experiment_runs(store, experiment, simulated):
                rows = store.steps(run["run_id"])
                steps["serve" if run["routing_policy"] in SERVE_ROUTERS else "slotserve"] += rows
                if run["routing_policy"] not in SERVE_ROUTERS:
                    _request_path(store.traces(run["run_id"]), rows, cost, to_replica, after_start)
                    sends += send_gaps(store.requests(run["run_id"]))
        finally:
            store.close()
    found = {f"step_overhead ({side})": step_overhead(rows, cost) for side, rows in steps.items()}
    found["dispatch_delay"] = statistics.median(to_replica) + statistics.median(after_start) if to_replica else None
    found["submit_interval"] = statistics.median(sends) if sends else None
    return found


def send_gaps(requests: list[dict]) -> list[float]:
    """Between each two requests of a run (`requests` rows of the metrics store) planned within
    BURST_GAP of each other, the time from the client's send of the first to its send of the
    second (never negative)."""
    sent = sorted(
        (r["arrival"] if r["planned_arrival"] is None else r["planned_arrival"], r["arrival"]) for r in requests
    )
    return [max(b - a, 0.0) for (pa, a), (pb, b) in zip(sent, sent[1:]) if pb - pa < BURST_GAP]


def _request_path(
    traces: list, steps: list[dict], cost: LinearCostModel, to_replica: list[float], after_start: list[float]
) -> None:
    """Add each request's way to an idle replica, and the time from the start of the step that
    made its first token to the client's receipt of it less the step's price (see `overheads`)."""
    by_replica: dict[str, list[tuple[float, float, float]]] = {}
    for row in steps:
        price = cost.predict(StepFeatures.of_row(row))
        by_replica.setdefault(row["replica_id"], []).append((row["start"] + row["duration"], row["start"], price))
    for rows in by_replica.values():
        rows.sort()
    for trace in traces:
        rows = by_replica.get(trace.replica)
        if not trace.token_times or not rows:
            continue
        i = bisect.bisect_right(rows, (trace.token_times[0], math.inf, math.inf)) - 1
        if i < 1:
            continue
        (_, start, price), (before, *_) = rows[i], rows[i - 1]
        after_start.append(trace.token_times[0] - start - price)
        if before < trace.arrival and start - before > MAX_LOOP_GAP:  # the replica was idle when it came
            to_replica.append(start - trace.arrival)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cluster", type=Path, nargs="+", required=True, help="stores with the experiment's Ray-cluster runs"
    )
    parser.add_argument("--sim", type=Path, nargs="+", required=True, help="stores with its simulated runs")
    parser.add_argument("--experiment", default="kv-pressure", help="the experiment's name (its file's `name`)")
    parser.add_argument("--json", type=Path, help="also write the cells and correlations here")
    parser.add_argument("--file", type=Path, help="the experiment file: also measure the cluster's loop overhead")
    args = parser.parse_args()
    if args.file is not None:
        for key, seconds in overheads(args.cluster, args.experiment, args.file).items():
            print(f"cluster's {key}: " + ("not measured" if seconds is None else f"{seconds:.5f} s"))
    sides: list[dict[tuple, dict[int, dict[str, float]]]] = [{}, {}]
    for side, paths, simulated in zip(sides, (args.cluster, args.sim), (False, True)):
        for path in paths:
            for key, by_seed in runs_by_cell(path, args.experiment, simulated).items():
                side.setdefault(key, {}).update(by_seed)
    common = {k: set(sides[0][k]) & set(sides[1][k]) for k in set(sides[0]) & set(sides[1])}
    both = sorted((k for k, seeds in common.items() if seeds), key=lambda k: (k[1] or 0, str(k[0])))
    # a cell both sides ran is set against its twin on the seeds both ran
    real, sim = ({k: medians(v, common.get(k) or set(v)) for k, v in side.items()} for side in sides)
    shown = [k for i, k in enumerate(KEY) if k in ("routing", "load") or len({c[i] for c in both}) > 1]
    for side, only in (("cluster", set(real) - set(sim)), ("simulated", set(sim) - set(real))):
        if only:
            print(f"only {side} (left out): " + ", ".join(label(k, shown) for k in sorted(only, key=str)))
    if not both:
        raise SystemExit(f"no cell of {args.experiment!r} is in both stores")
    width = max(len(label(k, shown)) for k in both) + 2
    print(f"{'cell':<{width}}{'TTFT p90 sim':>14}{'cluster':>9}{'p50 sim':>9}{'cluster':>9}", end="")
    print(f"{'goodput sim':>13}{'cluster':>9}{'error':>8}{'SLO met % sim':>15}{'cluster':>9}")
    for k in both:
        s, r = sim[k], real[k]
        print(f"{label(k, shown):<{width}}{s['ttft_p90']:>14.3f}{r['ttft_p90']:>9.3f}", end="")
        error = f"{(s['goodput'] - r['goodput']) / r['goodput']:+.1%}" if r["goodput"] else "-"
        print(f"{s['ttft_p50']:>9.3f}{r['ttft_p50']:>9.3f}{s['goodput']:>13.1f}{r['goodput']:>9.1f}{error:>8}", end="")
        print(f"{s['slo_attainment']:>15.1f}{r['slo_attainment']:>9.1f}")
    for k in both:
        if (errors := scaled(sim[k], real[k])) is not None:
            (seconds, s_ok), (points, p_ok) = errors["replica_seconds"], errors["slo_attainment"]
            print(
                f"{label(k, shown)}: replica-s {sim[k]['replica_seconds']:.0f} simulated, "
                f"{real[k]['replica_seconds']:.0f} cluster ({seconds:+.1%}, {'within' if s_ok else 'NOT within'} "
                f"{SCALED_TARGETS['replica_seconds']:.0%}); SLO met {sim[k]['slo_attainment']:.1f}% simulated, "
                f"{real[k]['slo_attainment']:.1f}% cluster ({points:+.1f} points, {'within' if p_ok else 'NOT within'} "
                f"{SCALED_TARGETS['slo_attainment']:g})"
            )
    sides = [winners({k: sim[k] for k in both}), winners({k: real[k] for k in both})]
    for point in sides[1]:
        where = label(point, [k for k in shown if k not in KNOBS])
        same = "the same winner" if sides[0][point] == sides[1][point] else "NOT the same winner"
        print(f"{where}: {sides[1][point]} wins on goodput on the cluster, {sides[0][point]} simulated: {same}")
    summary = {}
    for m in METRICS:
        xs, ys = [sim[k][m] for k in both], [real[k][m] for k in both]
        rho = spearman(xs, ys)
        error = statistics.median(abs(x - y) / y for x, y in zip(xs, ys) if y)
        summary[m] = {"spearman": rho, "median_relative_error": error}
        verdict = ""
        if m == "ttft_p90":
            judged = "not judged" if rho is None else "MET" if round(rho, 9) >= TARGET else "MISSED"
            verdict = f" (target >= {TARGET}: {judged})"
        rho_text = "undefined" if rho is None else f"{rho:.3f}"
        print(f"{m}: Spearman across {len(both)} cells {rho_text}{verdict}; median relative error {error:.1%}")
    if args.json:
        rows = [{**dict(zip(KEY, k)), "sim": sim[k], "cluster": real[k]} for k in both]
        points = [
            {**{k: v for k, v in zip(KEY, p) if k not in KNOBS}, "cluster": sides[1][p], "sim": sides[0][p]}
            for p in sides[1]
        ]
        args.json.write_text(json.dumps({"cells": rows, "summary": summary, "winners": points}, indent=2) + "\n")


if __name__ == "__main__":
    main()
