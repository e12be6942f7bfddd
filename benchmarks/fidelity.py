"""How well the calibrated simulator predicts the real engine: the same cells run on the real
engine and in `cluster.simulator` with the cost model `slotserve calibrate` fitted, on the
same seeded workloads, and the two are compared metric by metric.

Cells:
- batching: every batching policy on one replica of the calibrated model, the real engine in
  this process (`cluster.replay.replay` of an `Engine` with the real ModelRunner on the wall
  clock, torch on as many threads as the calibration used), on `saturated` (all requests at
  t=0, outputs lognormal with median 24 rather than 48 so six real runs fit in a few minutes).
  All-at-once arrivals are where the policies separate most (zombie rows of static batches,
  prefill stalls, a token budget of 32 that makes `chunked` split prompts) in the least time:
  with Poisson arrivals a run lasts as long as its arrival span, whatever the policy.
- routing: round_robin, least_loaded and random on a real local Ray cluster of 2 replicas
  (1 Ray CPU each by default = 1 torch thread, as calibrated), on `bursty-mix` at 1.3x twice
  the replica's measured decode capacity. (power_of_two samples both of 2 replicas, so it
  routes as least_loaded does; least_queue routes as round_robin does while no queue forms.)

For each cell: throughput (output tokens / makespan), TTFT p50 and TPOT p50 (p99s for
information), real and simulated; per metric, the median relative error |sim - real| / real
and the Spearman rank correlation (average ranks for ties) across all cells, and within each
group for information. Targets (issue 5): throughput and TPOT p50 rank correlation >= 0.9 and
median error < 10%; TTFT is reported without a target. Every run is recorded in the store
(real ones as real, simulated ones marked simulated), so `slotserve report` can set any two
side by side. The cost model should be fitted on the machine, in the conditions, of this run:
a model calibrated while the machine was busy predicts slow steps on a quiet one.

    .venv/bin/python benchmarks/fidelity.py [--quick] [--requests N] [--skip-cluster]
        [--cost-model results/cost_model.json] [--store results/fidelity.db] [--out docs/fidelity.md]
        [--json results/fidelity.json] [--seed 0]

About 6-8 minutes on the 2-core development machine; --quick (3 batching and 2 routing
policies, 4 requests per replica) about 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cluster.metrics import RequestTrace, summarize
from cluster.replay import ReplayResult, replay
from cluster.simulator import SimulationConfig, cost_description, record_simulation, simulate
from cluster.store import open_store
from replica.engine import Engine, EngineConfig
from replica.errors import ConfigError
from replica.fake_model import FittedCostModel, StepFeatures
from replica.policies import POLICIES
from router.policies import DEFAULT_POLICY
from workloads.standard import at_load, saturated_spec
from workloads.workload import Workload

SLOTS = 8
MAX_SEQ_LEN = 320  # saturated: prompts up to 64 tokens, outputs up to 256
TOKEN_BUDGET = 32  # `chunked`: below a full batch of prompts (16-64 tokens each), so chunking happens
SATURATED_MEDIAN = 24  # output tokens; the standard 48 makes six real runs take ten minutes here
ROUTING_REPLICAS = 2
ROUTING_LOAD = 1.3  # x the cluster's decode capacity (2 x one replica's, measured in process)
ROUTING = ("round_robin", "least_loaded", "random")
QUICK_BATCHING = ("static", "continuous", "chunked")
QUICK_ROUTING = ("round_robin", "least_loaded")
METRICS = {  # name -> (label, value of a summary)
    "throughput": ("throughput tok/s", lambda s: s.throughput),
    "ttft_p50": ("TTFT p50 s", lambda s: s.ttft["p50"]),
    "tpot_p50": ("TPOT p50 s", lambda s: s.tpot["p50"]),
    "ttft_p99": ("TTFT p99 s", lambda s: s.ttft["p99"]),
    "tpot_p99": ("TPOT p99 s", lambda s: s.tpot["p99"]),
}
TARGETS = {"throughput": (0.9, 0.10), "tpot_p50": (0.9, 0.10)}  # min Spearman, max median relative error
GROUPS = {  # what a group's real runs are, for the report
    "batching": "each batching policy on one replica, the real engine in this process (`cluster.replay.replay` "
                "on the wall clock)",
    "routing": f"each routing policy on a local Ray cluster of {ROUTING_REPLICAS} real replicas "
               f"(`{EngineConfig().policy}` batching), through the router and the client as `slotserve run` drives it",
}


@dataclass(frozen=True)
class Cell:
    group: str  # "batching" (one replica, in process) or "routing" (a Ray cluster)
    batching: str
    routing: str
    replicas: int

    @property
    def label(self) -> str:
        return f"{self.batching} x1" if self.group == "batching" else f"{self.routing} x{self.replicas}"


@dataclass
class CellResult:
    cell: Cell
    workload: str  # its description
    real: dict[str, float]
    sim: dict[str, float]
    real_run: int
    sim_run: int


@dataclass
class Fidelity:
    cells: list[CellResult] = field(default_factory=list)
    summary: dict[str, dict] = field(default_factory=dict)


def metrics(traces: list[RequestTrace]) -> dict[str, float]:
    s = summarize(traces)
    return {name: value(s) for name, (_, value) in METRICS.items()}


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, tied values sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation of the average ranks; None (undefined) when either side is
    constant or there are fewer than 3 values."""
    rx, ry = np.array(ranks(x)), np.array(ranks(y))
    if len(x) < 3 or rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def compare(cells: list[CellResult]) -> dict[str, dict]:
    """Per metric: median relative error and Spearman across all cells, and within each group."""
    summary = {}
    for name in METRICS:
        real, sim = [c.real[name] for c in cells], [c.sim[name] for c in cells]
        groups = {g: [c for c in cells if c.cell.group == g] for g in dict.fromkeys(c.cell.group for c in cells)}
        row = {"median_rel_error": statistics.median(abs(s - r) / r for r, s in zip(real, sim)),
               "spearman": spearman(real, sim),
               "spearman_by_group": {g: spearman([c.real[name] for c in cs], [c.sim[name] for c in cs])
                                     for g, cs in groups.items()}}
        if name in TARGETS:
            min_rho, max_err = TARGETS[name]
            row["pass"] = (row["spearman"] or -1.0) >= min_rho and row["median_rel_error"] < max_err
        summary[name] = row
    return summary


# --- the runs -------------------------------------------------------------------------------

def engine_config(cost: FittedCostModel, policy: str) -> EngineConfig:
    """The engine the cost model was fitted on (model, dtype, device), running `policy`."""
    m = cost.machine
    return EngineConfig(model=m.get("model", EngineConfig().model), dtype=m.get("dtype", "float32"),
                        device=m.get("device", "auto"), policy=policy, num_slots=SLOTS, max_seq_len=MAX_SEQ_LEN,
                        token_budget=TOKEN_BUDGET)


def record_replay(store, name: str, config: EngineConfig, workload: Workload, result: ReplayResult,
                  extra: dict) -> int:
    """An in-process real run into the store, with the rows the cluster's driver writes
    (its requests through `request_row`, its steps through `step_row`), as replica-0."""
    from cluster.client import Result  # imports Ray: only when recording
    from cluster.driver import request_row
    from replica.serving import step_row

    run_config = {"in_process": True, "num_replicas": 1, "engine": config.model_dump(), **extra,
                  "workload": workload.describe(), "workload_params": workload.params, "workload_spec": workload.spec}
    run_id = store.begin_run(name, run_config, config.policy, "none", workload.seed)
    rows = []
    for trace, late in zip(result.traces, result.submit_lateness):  # both in submission order
        spec = workload.requests[int(trace.request_id.rsplit("-", 1)[1])]
        client = Result(trace.request_id, "replica-0", trace.arrival, [], trace.token_times,
                        finish_reason=trace.finish_reason, completion=trace.finish_time)
        rows.append({**request_row(spec, client, trace.arrival, trace.arrival + late),
                     "output_len": trace.num_output_tokens, "num_preemptions": trace.num_preemptions})
    store.add_requests(run_id, rows)
    store.add_steps(run_id, [step_row("replica-0", record, config.num_slots) for record in result.steps])
    store.end_run(run_id, "complete")
    return run_id


def simulated(store, cell: Cell, config: EngineConfig, workload: Workload, cost: FittedCostModel,
              seed: int) -> tuple[dict[str, float], int]:
    sim_config = SimulationConfig(num_replicas=cell.replicas, engine=config, routing_policy=cell.routing, seed=seed)
    result = simulate(workload, sim_config, cost)
    return metrics(result.traces), record_simulation(store, result, f"fidelity-{cell.group}-{cell.label}-sim")


def run_batching(policies: list[str], num_requests: int, cost: FittedCostModel, store_path: Path, seed: int,
                 threads: int) -> tuple[list[CellResult], float]:
    """Every batching policy on one in-process replica, real then simulated; also returns the
    replica's measured full-batch decode capacity (output tokens/s)."""
    import torch

    from cluster.compare import measure_decode_capacity
    from replica.model_runner import ModelRunner

    torch.set_num_threads(threads)
    base = engine_config(cost, policies[0])
    runner = ModelRunner(base.model, SLOTS, MAX_SEQ_LEN, base.dtype, base.device, base.seed)
    capacity = measure_decode_capacity(runner, SLOTS, MAX_SEQ_LEN)  # also warms the runner up
    workload = saturated_spec(num_requests, median=SATURATED_MEDIAN, seed=seed).build()
    store = open_store(store_path)
    results = []
    try:
        for policy in policies:
            cell, config = Cell("batching", policy, DEFAULT_POLICY, 1), engine_config(cost, policy)
            run = replay(Engine(config, runner), workload, seed=seed, progress=True, desc=f"real {policy}")
            real_run = record_replay(store, f"fidelity-batching-{cell.label}-real", config, workload, run,
                                     {"torch_threads": threads})
            sim, sim_run = simulated(store, cell, config, workload, cost, seed)
            results.append(CellResult(cell, workload.describe(), metrics(run.traces), sim, real_run, sim_run))
    finally:
        store.close()
    return results, capacity


def run_routing(policies: list[str], num_requests: int, capacity: float, cost: FittedCostModel, store_path: Path,
                seed: int, threads: int) -> list[CellResult]:
    """The routing policies on a local Ray cluster of real replicas (the store actor writes
    their runs), then each in the simulator."""
    import ray

    from cluster.client import NAMESPACE
    from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
    from cluster.driver import run_workload
    from cluster.experiment import measure_capacity
    from cluster.store import MetricsStore
    from replica.serving import ReplicaConfig

    config = engine_config(cost, EngineConfig().policy)
    workload = at_load("bursty-mix", num_requests * ROUTING_REPLICAS, ROUTING_LOAD, ROUTING_REPLICAS * capacity, seed)
    spec = ClusterSpec(num_replicas=ROUTING_REPLICAS, replica=ReplicaConfig(engine=config), routing_policy=policies[0],
                       num_cpus_per_replica=threads, store_path=str(store_path), seed=seed)
    ray.init(address="local", num_cpus=ROUTING_REPLICAS * threads, namespace=NAMESPACE, include_dashboard=False,
             log_to_driver=False)
    real_runs = []
    try:
        deployment = start_cluster(spec)
        try:
            measure_capacity(deployment, max_tokens=4, probes=1)  # warms every replica up; not recorded
            for policy in policies:
                ray.get(deployment.router.set_policy.remote(policy))
                real_runs.append(run_workload(
                    deployment, workload, name=f"fidelity-routing-{policy} x{ROUTING_REPLICAS}-real",
                    config={**spec.model_dump(), "load": ROUTING_LOAD, "capacity_tokens_per_s": capacity,
                            "workload": workload.describe(), "workload_params": workload.params},
                    batching_policy=config.policy, routing_policy=policy, seed=seed))
        finally:
            stop_cluster()
    finally:
        ray.shutdown()
    store = MetricsStore(store_path)
    try:
        results = []
        for policy, real_run in zip(policies, real_runs):
            cell = Cell("routing", config.policy, policy, ROUTING_REPLICAS)
            sim, sim_run = simulated(store, cell, config, workload, cost, seed)
            results.append(CellResult(cell, workload.describe(), metrics(store.traces(real_run)), sim, real_run,
                                      sim_run))
    finally:
        store.close()
    return results


# --- output ---------------------------------------------------------------------------------

def _num(v: float) -> str:
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"


def format_cells(cells: list[CellResult], markdown: bool = False) -> str:
    """Per cell: real, simulated and relative error of each metric."""
    head = ["cell", "", *(label for label, _ in METRICS.values()), "runs"]
    rows = []
    for c in cells:
        err = [f"{100 * (c.sim[m] - c.real[m]) / c.real[m]:+.0f}%" for m in METRICS]
        rows += [[c.cell.label, "real", *(_num(c.real[m]) for m in METRICS), str(c.real_run)],
                 ["", "sim", *(_num(c.sim[m]) for m in METRICS), str(c.sim_run)],
                 ["", "sim/real-1", *err, ""]]
    return _table(head, rows, markdown)


def format_summary(summary: dict[str, dict], markdown: bool = False) -> str:
    groups = list(next(iter(summary.values()))["spearman_by_group"])
    head = ["metric", "median rel. error", "Spearman (all cells)", *(f"Spearman ({g})" for g in groups), "target",
            "verdict"]
    rows = []
    for name, row in summary.items():
        target = TARGETS.get(name)
        rows.append([METRICS[name][0], f"{100 * row['median_rel_error']:.1f}%", _rho(row["spearman"]),
                     *(_rho(row["spearman_by_group"][g]) for g in groups),
                     f"rho >= {target[0]}, error < {100 * target[1]:.0f}%" if target else "-",
                     ("PASS" if row["pass"] else "MISS") if target else "-"])
    return _table(head, rows, markdown)


def _rho(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _table(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:  # the first two columns are names: left-aligned
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))

    return "\n".join([line(head), "-" * len(line(head)), *map(line, rows)])


def predicted_capacity(cost: FittedCostModel) -> float:
    """Output tokens/s the cost model predicts for the steps `measure_decode_capacity` times:
    every slot decoding, each at about 38 tokens of context (a 32-token prompt and a few
    tokens out). Set against the measured figure, it says whether the calibration holds for
    this run: a machine busier or quieter than when it was calibrated moves every cell."""
    context = 32 + 6
    return SLOTS / cost.predict(StepFeatures(SLOTS, 0, SLOTS * (context + 1), 0))


def capacity_line(measured: float, predicted: float) -> str:
    return (f"Full-batch decode of one replica ({SLOTS} slots): measured {measured:.1f} output tok/s, the cost model "
            f"predicts {predicted:.1f} (x{predicted / measured:.2f})")


def describe_cost(cost: FittedCostModel, path: Path) -> str:
    m, q = cost.machine, cost.quality
    fit = (f"held-out R^2 {q.r2:.3f}, median relative step error {100 * q.median_rel_error:.1f}% "
           f"({q.num_fit} steps fitted, {q.num_heldout} held out)" if q else "fit quality not recorded")
    return (f"`{path}`: step = {1e3 * cost.c0:.1f} ms + {1e3 * cost.c_decode:.2f} ms/decode token + "
            f"{1e3 * cost.c_prefill:.2f} ms/prefill token + {1e6 * cost.c_ctx:.2f} us/context token + "
            f"{1e3 * cost.c_held:.2f} ms/padding row; {fit}; calibrated {m.get('calibrated', '?')} on "
            f"{m.get('hostname', '?')} ({m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('threads', '?')} "
            f"torch threads, {m.get('model', '?')} {m.get('dtype', '?')} on {m.get('device', '?')})")


def write_markdown(path: Path, result: Fidelity, info: dict) -> None:
    from cluster.experiment_report import machine_line  # the experiment reports' wording

    lines = [
        "# Simulator fidelity", "",
        "The same cells on the real engine and in the calibrated simulator, on the same seeded workloads "
        "(`benchmarks/fidelity.py`).", "",
        f"Made by `{info['command']}` on {info['date']}, commit `{info['git_commit']}`, in {info['seconds']:.0f} s.",
        "",
        f"- Machine: {machine_line(info['machine'])}",
        f"- Cost model: {info['cost_model']}",
        f"- Real engine: torch on {info['threads']} thread(s) (in process; cluster replicas ask Ray for as many "
        f"CPUs); {SLOTS} slots, max_seq_len {MAX_SEQ_LEN}, chunked token budget {TOKEN_BUDGET}",
        f"- {capacity_line(info['capacity'], info['predicted_capacity'])}",
        *[f"- {group} cells: {GROUPS[group]}; workload {text}" for group, text in info["workloads"].items()],
        f"- Runs: in `{info['store']}` (`slotserve report --store {info['store']} RUN...`)", "",
        "## Cells", "", format_cells(result.cells, markdown=True), "",
        "## Summary", "",
        "Median relative error |sim - real| / real, and Spearman rank correlation of real against simulated "
        "across cells (average ranks for ties).", "",
        format_summary(result.summary, markdown=True), "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> Fidelity:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", type=Path, default=Path("results/cost_model.json"),
                   help="the calibrated cost model (default: %(default)s)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per replica in every cell (default: 16; --quick: 4)")
    p.add_argument("--quick", action="store_true",
                   help=f"a trial: batching {', '.join(QUICK_BATCHING)}; routing {', '.join(QUICK_ROUTING)}; "
                        "4 requests per replica")
    p.add_argument("--skip-cluster", action="store_true", help="only the batching cells (no Ray cluster)")
    p.add_argument("--store", type=Path, default=Path("results/fidelity.db"),
                   help="metrics store (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("docs/fidelity.md"), help="Markdown report (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the cells and summary as JSON here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.cost_model.is_file():
        raise SystemExit(f"no cost model at {args.cost_model}: run `slotserve calibrate` first "
                         "(or pass --cost-model PATH)")
    try:
        cost = FittedCostModel.load(args.cost_model)
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    num_requests = args.requests or (4 if args.quick else 16)
    if num_requests < 2:
        raise SystemExit(f"--requests must be at least 2 (TPOT needs a request of 2 tokens), got {num_requests}")
    threads = int(cost.machine.get("threads", 1))
    batching = list(QUICK_BATCHING if args.quick else POLICIES)
    routing = [] if args.skip_cluster else list(QUICK_ROUTING if args.quick else ROUTING)
    print(f"cost model: {describe_cost(cost, args.cost_model)}", flush=True)

    start = time.monotonic()
    result = Fidelity()
    cells, capacity = run_batching(batching, num_requests, cost, args.store, args.seed, threads)
    result.cells += cells
    if routing:
        result.cells += run_routing(routing, num_requests, capacity, cost, args.store, args.seed, threads)
    result.summary = compare(result.cells)
    seconds = time.monotonic() - start

    print(f"\n{capacity_line(capacity, predicted_capacity(cost))}; torch threads {threads}")
    for group in dict.fromkeys(c.cell.group for c in result.cells):
        print(f"{group}: {next(c.workload for c in result.cells if c.cell.group == group)}")
    print("\n" + format_cells(result.cells) + "\n\n" + format_summary(result.summary))
    print(f"\n{len(result.cells)} cells in {seconds:.0f} s; runs in {args.store}")

    store = open_store(args.store)
    try:
        first = store.run(result.cells[0].real_run)
    finally:
        store.close()
    info = {"command": shlex.join([".venv/bin/python", "benchmarks/fidelity.py", *(sys.argv[1:] if argv is None
                                                                                 else argv)]),
            "date": time.strftime("%Y-%m-%d"), "git_commit": first["git_commit"], "seconds": seconds,
            "machine": first["machine"] or {"hostname": platform.node()}, "threads": threads, "capacity": capacity,
            "predicted_capacity": predicted_capacity(cost),
            "cost_model": describe_cost(cost, args.cost_model), "store": str(args.store),
            "workloads": {g: next(c.workload for c in result.cells if c.cell.group == g)
                          for g in dict.fromkeys(c.cell.group for c in result.cells)}}
    write_markdown(args.out, result, info)
    print(f"report: {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "cost_model": cost_description(cost),
                                         "cells": [asdict(c) for c in result.cells], "summary": result.summary},
                                        indent=2) + "\n")
        print(f"json: {args.json}")
    return result


if __name__ == "__main__":
    main()
