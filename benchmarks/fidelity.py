# Over 400 lines: one benchmark script end to end (real cells, simulated cells, the report), read top to bottom.
"""How well the calibrated simulator predicts the real engine: the same cells run on the real
engine and in `sim.simulator` on the same seeded workloads, and the two are compared
metric by metric.

Cells:
- batching, at two loads: every batching policy on one replica of SmolLM2-135M, the real
  engine in this process (`sim.replay.replay` of an `Engine` with the real ModelRunner on
  the wall clock, 1 torch thread as a cluster replica at Ray `num_cpus=1` has).
  - `saturated`: all requests at t=0, outputs lognormal with median 24 rather than 48 so the
    real runs fit in minutes. Here the policies separate in throughput and TTFT (zombie rows
    of static batches, prefill stalls, a token budget of 32 that makes `chunked` split
    prompts), but every policy keeps the batch full, so their TPOTs differ by less than
    this machine's noise (static and dynamic even run the same steps).
  - `light`: `bursty-mix` at 0.6x the replica's measured decode capacity. Here the
    policies run different batch sizes (static waits to fill its batch, the others run what
    has come), so TPOT separates too: the load range the simulator's load sweeps cover.
- routing: round_robin, least_loaded and random on a real local Ray cluster of 2 replicas
  (1 Ray CPU and 1 torch thread each), on `bursty-mix` at 1.3x twice the replica's measured
  decode capacity. (power_of_two samples both of 2 replicas, so it routes as least_loaded
  does; least_queue routes as round_robin does while no queue forms.)

This machine is noisy: the same steps take 10-20% longer or shorter from one minute to the
next. So every real cell runs `--repeats` times, in rounds (each round runs every cell once, so
a slow spell hits all cells alike), its metrics are the median over the repeats, and the
report gives their spread, the floor under any simulator's error here.

Each cell is simulated with two cost models, both fitted in this run on this machine, in the
conditions of the group (one replica alone; two side by side in a Ray cluster):
- `grid`: `slotserve calibrate`'s designed grid of probe steps (`--replicas 2` for routing);
- `runs`: `slotserve calibrate --from-store`, fitted to the recorded steps of real runs of
  the same workload with another seed (seed + 1; never the evaluated runs): `static` and
  `chunked` on `saturated` in process, round_robin on the cluster, which pays the router,
  driver and Ray processes that share the cores. One set of them runs in every round, so the
  fit samples the same slow and fast spells as the evaluated runs: the step times of one run
  on this machine differ by up to 25% from the next, and one calibration run is one draw.
`--cost-model PATH` replaces `grid` with a saved fit.

For each cell: throughput (output tokens / makespan), TTFT p50 and TPOT p50 (p99s for
information); per metric and cost model, the median relative error |sim - real| / real and the
Spearman rank correlation (average ranks for ties) across all cells, and within each group
for information. Targets (issue 5): throughput and TPOT p50 rank correlation >= 0.9 and median
error < 10%; TTFT is reported without a target. Every run is recorded in the store (real ones
as real, simulated ones marked simulated), so `slotserve report` can set any two side by side.

    .venv/bin/python benchmarks/fidelity.py [--quick] [--requests N] [--repeats R] [--skip-cluster]
        [--cost-model results/cost_model.json] [--store results/fidelity.db] [--out docs/fidelity.md]
        [--json results/fidelity.json] [--seed 0]

About 30 minutes on the 2-core development machine; --quick (3 batching and 2 routing
policies, 4 requests per replica, 1 repeat) about 5.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from metrics.definitions import RequestTrace, summarize
from metrics.recording import record_run
from metrics.store import open_store
from replica.config import EngineConfig
from replica.engine import Engine
from replica.errors import ConfigError
from replica.model.loader import DEFAULT_MODEL
from replica.scheduling.policies import POLICIES
from router.policies import DEFAULT_POLICY
from sim.calibration import calibrate, calibrate_from_store, calibration_machine, fit, grid, measure
from sim.cost_model import FittedCostModel
from sim.replay import ReplayResult, replay
from sim.simulator import SimulationConfig, cost_description, record_simulation, simulate
from workloads.standard import at_load, saturated_spec
from workloads.workload import Workload

SLOTS = 8
MAX_SEQ_LEN = 320  # saturated: prompts up to 64 tokens, outputs up to 256
TOKEN_BUDGET = 32  # `chunked`: below a full batch of prompts (16-64 tokens each), so chunking happens
SATURATED_MEDIAN = 24  # output tokens; the standard 48 makes the real runs take too long here
LIGHT_LOAD = 0.6  # x one replica's decode capacity, measured in process: the `light` batching cells
ROUTING_REPLICAS = 2
ROUTING_LOAD = 1.3  # x the cluster's decode capacity (2 x one replica's, measured in process)
ROUTING = ("round_robin", "least_loaded", "random")
QUICK_BATCHING = ("static", "continuous", "chunked")
QUICK_ROUTING = ("round_robin", "least_loaded")
# The real runs (seed + 1) the `runs` cost models are fitted to: padding rows, whole prompts
# and decodes from static, prompt chunks beside decodes from chunked; the cluster's serving steps.
CALIBRATION_BATCHING = ("static", "chunked")
CALIBRATION_ROUTING = "round_robin"
METRICS = {  # name -> (label, value of a summary)
    "throughput": ("throughput tok/s", lambda s: s.throughput),
    "ttft_p50": ("TTFT p50 s", lambda s: s.ttft["p50"]),
    "tpot_p50": ("TPOT p50 s", lambda s: s.tpot["p50"]),
    "ttft_p99": ("TTFT p99 s", lambda s: s.ttft["p99"]),
    "tpot_p99": ("TPOT p99 s", lambda s: s.tpot["p99"]),
}
TARGETS = {"throughput": (0.9, 0.10), "tpot_p50": (0.9, 0.10)}  # min Spearman, max median relative error
BATCHING_RUNS = (
    "each batching policy on one replica, the real engine in this process (`sim.replay.replay` on the wall clock)"
)
GROUPS = {  # what a group's real runs are, for the report
    "saturated": f"{BATCHING_RUNS}, all requests at once",
    "light": f"{BATCHING_RUNS}, at {LIGHT_LOAD}x the replica's measured decode capacity",
    "routing": f"each routing policy on a local Ray cluster of {ROUTING_REPLICAS} real replicas "
    f"(`{EngineConfig().policy}` batching), through the router and the client as `slotserve run` drives it",
}
COST_MODELS = {  # name -> how it is fitted, for the report
    "grid": "`slotserve calibrate`'s grid of probe steps, measured in this run (routing: `--replicas 2`, two "
    "processes side by side)",
    "runs": "`slotserve calibrate --from-store`: fitted to the recorded steps of real runs of the same workload with "
    f"seed + 1 ({' and '.join(CALIBRATION_BATCHING)} in process; {CALIBRATION_ROUTING} on the cluster), one set in "
    "every round of the evaluated runs",
}


@dataclass(frozen=True)
class FidelityCell:
    group: str  # "saturated" or "light" (one replica, in process), or "routing" (a Ray cluster)
    batching: str
    routing: str
    replicas: int

    @property
    def label(self) -> str:
        return f"{self.batching} x1 {self.group}" if self.group != "routing" else f"{self.routing} x{self.replicas}"


@dataclass
class CellResult:
    cell: FidelityCell
    workload: str  # its description
    real: dict[str, float]  # median over the repeats
    real_spread: dict[str, float]  # (max - min) / median over the repeats
    real_runs: list[int]
    sim: dict[str, dict[str, float]]  # cost model name -> metrics
    sim_runs: dict[str, int]


@dataclass
class Fidelity:
    cells: list[CellResult] = field(default_factory=list)
    cost_models: dict[str, dict[str, FittedCostModel]] = field(default_factory=dict)  # condition -> name -> model
    summary: dict[str, dict[str, dict]] = field(default_factory=dict)  # cost model name -> metric -> row


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


def compare(cells: list[CellResult], model: str) -> dict[str, dict]:
    """Per metric, simulated with cost model `model`: median relative error and Spearman
    across all cells and within each group, and the real runs' median spread (the noise)."""
    summary = {}
    groups = {g: [c for c in cells if c.cell.group == g] for g in dict.fromkeys(c.cell.group for c in cells)}
    for name in METRICS:
        real, sim = [c.real[name] for c in cells], [c.sim[model][name] for c in cells]
        row = {
            "median_rel_error": statistics.median(abs(s - r) / r for r, s in zip(real, sim)),
            "spearman": spearman(real, sim),
            "spearman_by_group": {
                g: spearman([c.real[name] for c in cs], [c.sim[model][name] for c in cs]) for g, cs in groups.items()
            },
            "real_spread": statistics.median(c.real_spread[name] for c in cells),
        }
        if name in TARGETS:
            min_rho, max_err = TARGETS[name]
            row["pass"] = (row["spearman"] or -1.0) >= min_rho and row["median_rel_error"] < max_err
        summary[name] = row
    return summary


def median_of_repeats(repeats: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Each metric's median over the repeats, and its spread (max - min) / median."""
    median = {m: statistics.median(r[m] for r in repeats) for m in METRICS}
    spread = {
        m: (max(r[m] for r in repeats) - min(r[m] for r in repeats)) / median[m] if median[m] else 0.0 for m in METRICS
    }
    return median, spread


# --- the runs -------------------------------------------------------------------------------


def record_replay(store, name: str, config: EngineConfig, workload: Workload, result: ReplayResult, extra: dict) -> int:
    """An in-process real run into the store through `metrics.recording.record_run`, as replica-0."""
    run_config = {
        "in_process": True,
        "num_replicas": 1,
        "engine": config.model_dump(),
        **extra,
        "workload": workload.describe(),
        "workload_params": workload.params,
        "workload_spec": workload.spec,
    }
    traces = []
    for trace, late in zip(result.traces, result.submit_lateness):  # both in submission order
        spec = workload.requests[int(trace.request_id.rsplit("-", 1)[1])]
        traces.append(
            replace(
                trace, replica="replica-0", session_id=spec.session_id, max_tokens=spec.output_len, submit_lateness=late
            )
        )
    return record_run(
        store,
        name=name,
        config=run_config,
        batching_policy=config.policy,
        routing_policy="none",
        seed=workload.seed,
        traces=traces,
        steps=[("replica-0", config.num_slots, record) for record in result.steps],
    )


def cell_result(
    store,
    cell: FidelityCell,
    config: EngineConfig,
    workload: Workload,
    real: list[dict[str, float]],
    real_runs: list[int],
    costs: dict[str, FittedCostModel],
    seed: int,
) -> CellResult:
    """The real repeats' median and spread, and the cell simulated with every cost model."""
    median, spread = median_of_repeats(real)
    sim, sim_runs = {}, {}
    sim_config = SimulationConfig(num_replicas=cell.replicas, engine=config, routing_policy=cell.routing, seed=seed)
    for name, cost in costs.items():
        result = simulate(workload, sim_config, cost)
        sim[name] = metrics(result.traces)
        sim_runs[name] = record_simulation(store, result, f"fidelity-{cell.label}-sim-{name}")
    return CellResult(cell, workload.describe(), median, spread, real_runs, sim, sim_runs)


def run_batching(
    policies: list[str],
    num_requests: int,
    repeats: int,
    base: EngineConfig,
    grid_cost: FittedCostModel | None,
    store_path: Path,
    seed: int,
    threads: int,
    quick: bool,
) -> tuple[list[CellResult], dict[str, FittedCostModel], float]:
    """Calibrate on the probe grid (unless a grid model is given), then run `repeats` rounds
    of the calibration replays (seed + 1) and every batching policy at both loads (seed) on
    one in-process replica; simulate each cell. Also returns the cost models and the
    replica's full-batch decode capacity."""
    import torch

    from replica.model.runner import ModelRunner
    from sim.batching_comparison import measure_capacity

    torch.set_num_threads(threads)
    probes = grid(SLOTS, quick)
    probe_len = max(c.prompt_len + c.max_tokens for c in probes)
    runner = ModelRunner(base.model_copy(update={"num_slots": SLOTS, "max_seq_len": max(MAX_SEQ_LEN, probe_len)}))
    capacity = measure_capacity(runner, SLOTS, MAX_SEQ_LEN).decode_tokens_per_s  # also warms the runner up
    costs = {}
    if grid_cost is None:
        print("calibrating on the probe grid (1 replica)", flush=True)
        samples = measure(runner, probes, probe_len, seed, progress=True)
        grid_cost = fit(samples, calibration_machine(base.model, base.dtype, runner.device, SLOTS))
    costs["grid"] = grid_cost
    store = open_store(store_path)
    try:
        configs = {p: base.model_copy(update={"policy": p}) for p in {*policies, *CALIBRATION_BATCHING}}
        extra = {"torch_threads": threads}
        calibration = saturated_spec(num_requests, median=SATURATED_MEDIAN, seed=seed + 1).build()
        workloads = {
            "saturated": saturated_spec(num_requests, median=SATURATED_MEDIAN, seed=seed).build(),
            "light": at_load("bursty-mix", num_requests, LIGHT_LOAD, capacity, seed),
        }
        cells = [FidelityCell(group, p, DEFAULT_POLICY, 1) for group in workloads for p in policies]
        real: dict[FidelityCell, list[dict[str, float]]] = {c: [] for c in cells}
        runs: dict[FidelityCell, list[int]] = {c: [] for c in cells}
        calibration_runs = []
        for r in range(repeats):
            for p in CALIBRATION_BATCHING:
                run = replay(
                    Engine(configs[p], runner),
                    calibration,
                    seed=seed + 1,
                    progress=True,
                    desc=f"calibration {p} {r + 1}/{repeats}",
                )
                calibration_runs.append(
                    record_replay(
                        store, f"fidelity-calibration-{p} x1 saturated-real", configs[p], calibration, run, extra
                    )
                )
            for c in cells:
                run = replay(
                    Engine(configs[c.batching], runner),
                    workloads[c.group],
                    seed=seed,
                    progress=True,
                    desc=f"real {c.label} {r + 1}/{repeats}",
                )
                real[c].append(metrics(run.traces))
                runs[c].append(
                    record_replay(
                        store, f"fidelity-{c.label}-real", configs[c.batching], workloads[c.group], run, extra
                    )
                )
        costs["runs"] = calibrate_from_store(store_path, calibration_runs)[0]
        results = [
            cell_result(store, c, configs[c.batching], workloads[c.group], real[c], runs[c], costs, seed) for c in cells
        ]
    finally:
        store.close()
    return results, costs, capacity


def run_routing(
    policies: list[str],
    num_requests: int,
    repeats: int,
    capacity: float,
    base: EngineConfig,
    grid_cost: FittedCostModel | None,
    store_path: Path,
    seed: int,
    threads: int,
    quick: bool,
) -> tuple[list[CellResult], dict[str, FittedCostModel]]:
    """Calibrate 2 replicas side by side (unless a grid model is given), then on a local Ray
    cluster of real replicas (the store actor writes their runs) `repeats` rounds of the
    calibration run (seed + 1) and the routing policies (seed); simulate each cell."""
    import ray

    from cluster.client import NAMESPACE
    from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
    from cluster.driver import run_workload
    from experiments.backends import measure_capacity
    from metrics.store import MetricsStore
    from replica.serving.loop import ReplicaConfig

    costs = {}
    if grid_cost is None:
        print(f"calibrating on the probe grid ({ROUTING_REPLICAS} replicas side by side)", flush=True)
        grid_cost = calibrate(base.model, SLOTS, base.dtype, base.device, quick, seed, replicas=ROUTING_REPLICAS)[0]
    costs["grid"] = grid_cost
    workloads = {
        s: at_load("bursty-mix", num_requests * ROUTING_REPLICAS, ROUTING_LOAD, ROUTING_REPLICAS * capacity, s)
        for s in (seed, seed + 1)
    }
    spec = ClusterSpec(
        num_replicas=ROUTING_REPLICAS,
        replica=ReplicaConfig(engine=base),
        routing_policy=policies[0],
        num_cpus_per_replica=threads,
        store_path=str(store_path),
        seed=seed,
    )
    ray.init(
        address="local",
        num_cpus=ROUTING_REPLICAS * threads,
        namespace=NAMESPACE,
        include_dashboard=False,
        log_to_driver=False,
    )
    runs: dict[str, list[int]] = {p: [] for p in policies}
    try:
        deployment = start_cluster(spec)
        try:
            measure_capacity(deployment, max_tokens=4, probes=1)  # warms every replica up; not recorded

            def run(policy: str, s: int, name: str) -> int:
                ray.get(deployment.router.set_policy.remote(policy))
                return run_workload(
                    deployment,
                    workloads[s],
                    name=name,
                    seed=s,
                    batching_policy=base.policy,
                    routing_policy=policy,
                    config={
                        **spec.model_dump(),
                        "load": ROUTING_LOAD,
                        "capacity_tokens_per_s": capacity,
                        "workload": workloads[s].describe(),
                        "workload_params": workloads[s].params,
                    },
                )

            calibration_runs = []
            for _ in range(repeats):
                calibration_runs.append(
                    run(
                        CALIBRATION_ROUTING,
                        seed + 1,
                        f"fidelity-calibration-{CALIBRATION_ROUTING} x{ROUTING_REPLICAS}-real",
                    )
                )
                for policy in policies:
                    runs[policy].append(run(policy, seed, f"fidelity-{policy} x{ROUTING_REPLICAS}-real"))
        finally:
            stop_cluster()
    finally:
        ray.shutdown()
    costs["runs"] = calibrate_from_store(store_path, calibration_runs)[0]
    store = MetricsStore(store_path)
    try:
        results = [
            cell_result(
                store,
                FidelityCell("routing", base.policy, p, ROUTING_REPLICAS),
                base,
                workloads[seed],
                [metrics(store.traces(r)) for r in runs[p]],
                runs[p],
                costs,
                seed,
            )
            for p in policies
        ]
    finally:
        store.close()
    return results, costs


# --- output ---------------------------------------------------------------------------------


def _num(v: float) -> str:
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"


def format_cells(cells: list[CellResult], markdown: bool = False) -> str:
    """Per cell: the real median (and the repeats' spread), then each cost model's simulation
    and its relative error."""
    head = ["cell", "", *(label for label, _ in METRICS.values()), "runs"]
    rows = []
    for c in cells:
        rows += [
            [
                c.cell.label,
                f"real (median of {len(c.real_runs)})",
                *(_num(c.real[m]) for m in METRICS),
                ", ".join(map(str, c.real_runs)),
            ],
            ["", "real spread", *(f"{100 * c.real_spread[m]:.0f}%" for m in METRICS), ""],
        ]
        for name, sim in c.sim.items():
            rows += [
                ["", f"sim {name}", *(_num(sim[m]) for m in METRICS), str(c.sim_runs[name])],
                ["", f"sim {name}/real-1", *(f"{100 * (sim[m] - c.real[m]) / c.real[m]:+.0f}%" for m in METRICS), ""],
            ]
    return _table(head, rows, markdown)


def format_summary(summary: dict[str, dict[str, dict]], markdown: bool = False) -> str:
    first = next(iter(summary.values()))
    groups = list(next(iter(first.values()))["spearman_by_group"])
    head = [
        "cost model",
        "metric",
        "median rel. error",
        "Spearman (all cells)",
        *(f"Spearman ({g})" for g in groups),
        "real spread",
        "target",
        "verdict",
    ]
    rows = []
    for model, rows_by_metric in summary.items():
        for name, row in rows_by_metric.items():
            target = TARGETS.get(name)
            rows.append(
                [
                    model,
                    METRICS[name][0],
                    f"{100 * row['median_rel_error']:.1f}%",
                    _rho(row["spearman"]),
                    *(_rho(row["spearman_by_group"][g]) for g in groups),
                    f"{100 * row['real_spread']:.0f}%",
                    f"rho >= {target[0]}, error < {100 * target[1]:.0f}%" if target else "-",
                    ("PASS" if row["pass"] else "MISS") if target else "-",
                ]
            )
    return _table(head, rows, markdown)


def _rho(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _table(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join(
            ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:  # the first two columns are names: left-aligned
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))

    return "\n".join([line(head), "-" * len(line(head)), *map(line, rows)])


def describe_cost(cost: FittedCostModel) -> str:
    m, q = cost.machine, cost.quality
    fit = (
        f"held-out R^2 {q.r2:.3f}, median relative step error {100 * q.median_rel_error:.1f}% "
        f"({q.num_fit} steps fitted, {q.num_heldout} held out)"
        if q
        else "fit quality not recorded"
    )
    source = f"fitted to {m['fitted_to']}" if "fitted_to" in m else f"calibrated {m.get('calibrated', '?')}"
    return (
        f"step = {1e3 * cost.c0:.1f} ms + {1e3 * cost.c_decode:.2f} ms/decode token + "
        f"{1e3 * cost.c_prefill:.2f} ms/prefill token + {1e6 * cost.c_ctx:.2f} us/context token + "
        f"{1e3 * cost.c_held:.2f} ms/padding row; {fit}; {source} ({m.get('replicas', 1)} replica(s), "
        f"{m.get('threads', '?')} torch thread(s), {m.get('model', '?')} {m.get('dtype', '?')})"
    )


def write_markdown(path: Path, result: Fidelity, info: dict) -> None:
    from experiments.experiment_report import machine_line  # the experiment reports' wording

    lines = [
        "# Simulator fidelity",
        "",
        "The same cells on the real engine and in the calibrated simulator, on the same seeded workloads "
        "(`benchmarks/fidelity.py`, whose docstring says how).",
        "",
        f"Made by `{info['command']}` on {info['date']}, commit `{info['git_commit']}`, in {info['seconds']:.0f} s.",
        "",
        f"- Machine: {machine_line(info['machine'])}",
        f"- Real engine: {info['model']}, torch on {info['threads']} thread(s) (in process; cluster replicas ask Ray "
        f"for as many CPUs); {SLOTS} slots, max_seq_len {MAX_SEQ_LEN}, chunked token budget {TOKEN_BUDGET}; every "
        f"real cell run {info['repeats']} time(s) in rounds, its figures the median",
        f"- Full-batch decode of one replica ({SLOTS} slots), measured before the runs: {info['capacity']:.1f} "
        "output tok/s",
        *[f"- {group} cells: {GROUPS[group]}; workload {text}" for group, text in info["workloads"].items()],
        "- Cost models (each cell is simulated with both):",
        *[f"  - `{name}`: {COST_MODELS[name]}" for name in COST_MODELS],
        "",
        "| replicas | cost model | fit |",
        "|---|---|---|",
        *[
            f"| {group} | {name} | {describe_cost(cost)} |"
            for group, costs in result.cost_models.items()
            for name, cost in costs.items()
        ],
        "",
        f"- Runs: in `{info['store']}` (`slotserve report --store {info['store']} RUN...`)",
        "",
        "## Summary",
        "",
        "Median relative error |sim - real| / real, and Spearman rank correlation of real against simulated "
        "across cells (average ranks for ties); real spread: the median over cells of the real repeats' "
        "(max - min) / median, the noise of this machine.",
        "",
        format_summary(result.summary, markdown=True),
        "",
        "## Cells",
        "",
        format_cells(result.cells, markdown=True),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> Fidelity:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cost-model",
        type=Path,
        default=None,
        help="use this saved fit as the `grid` model of every cell instead of calibrating in the run "
        "(its machine's model, dtype and device run the real cells)",
    )
    p.add_argument(
        "--requests", type=int, default=None, help="requests per replica in every cell (default: 16; --quick: 4)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="real runs of every cell, in rounds; the median is compared (default: 3; --quick: 1)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a trial: batching {', '.join(QUICK_BATCHING)}; routing {', '.join(QUICK_ROUTING)}; "
        "4 requests per replica; 1 repeat; the quick probe grid",
    )
    p.add_argument("--skip-cluster", action="store_true", help="only the batching cells (no Ray cluster)")
    p.add_argument(
        "--store", type=Path, default=Path("results/fidelity.db"), help="metrics store (default: %(default)s)"
    )
    p.add_argument("--out", type=Path, default=Path("docs/fidelity.md"), help="Markdown report (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the cells and summary as JSON here")
    p.add_argument("--seed", type=int, default=0, help="the evaluated workloads' seed; calibration runs use seed + 1")
    args = p.parse_args(argv)
    grid_cost = None
    if args.cost_model is not None:
        try:
            grid_cost = FittedCostModel.load(args.cost_model)
        except ConfigError as err:
            raise SystemExit(str(err)) from None
    num_requests = args.requests or (4 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 3)
    if num_requests < 2:
        raise SystemExit(f"--requests must be at least 2 (TPOT needs a request of 2 tokens), got {num_requests}")
    if repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {repeats}")
    m = grid_cost.machine if grid_cost else {}
    threads = int(m.get("threads", 1))
    base = EngineConfig(
        model=m.get("model", DEFAULT_MODEL),
        dtype=m.get("dtype", "float32"),
        device=m.get("device", "auto"),
        num_slots=SLOTS,
        max_seq_len=MAX_SEQ_LEN,
        token_budget=TOKEN_BUDGET,
    )
    batching = list(QUICK_BATCHING if args.quick else POLICIES)
    routing = [] if args.skip_cluster else list(QUICK_ROUTING if args.quick else ROUTING)

    start = time.monotonic()
    result = Fidelity()
    cells, result.cost_models["one replica"], capacity = run_batching(
        batching, num_requests, repeats, base, grid_cost, args.store, args.seed, threads, args.quick
    )
    result.cells += cells
    if routing:
        cells, result.cost_models[f"{ROUTING_REPLICAS} replicas"] = run_routing(
            routing, num_requests, repeats, capacity, base, grid_cost, args.store, args.seed, threads, args.quick
        )
        result.cells += cells
    result.summary = {name: compare(result.cells, name) for name in COST_MODELS}
    seconds = time.monotonic() - start

    print(f"\nfull-batch decode of one replica: {capacity:.1f} output tok/s; torch threads {threads}")
    for group, costs in result.cost_models.items():
        for name, cost in costs.items():
            print(f"cost model {name}, {group}: {describe_cost(cost)}")
    for group in dict.fromkeys(c.cell.group for c in result.cells):
        print(f"{group}: {next(c.workload for c in result.cells if c.cell.group == group)}")
    print("\n" + format_cells(result.cells) + "\n\n" + format_summary(result.summary))
    print(f"\n{len(result.cells)} cells in {seconds:.0f} s; runs in {args.store}")

    store = open_store(args.store)
    try:
        first = store.run(result.cells[0].real_runs[0])
    finally:
        store.close()
    info = {
        "command": shlex.join(
            [".venv/bin/python", "benchmarks/fidelity.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": time.strftime("%Y-%m-%d"),
        "git_commit": first["git_commit"],
        "seconds": seconds,
        "machine": first["machine"] or {"hostname": platform.node()},
        "threads": threads,
        "capacity": capacity,
        "model": base.model,
        "repeats": repeats,
        "store": str(args.store),
        "workloads": {
            g: next(c.workload for c in result.cells if c.cell.group == g)
            for g in dict.fromkeys(c.cell.group for c in result.cells)
        },
    }
    write_markdown(args.out, result, info)
    print(f"report: {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    **info,
                    "cost_models": {
                        g: {n: cost_description(c) for n, c in costs.items()} for g, costs in result.cost_models.items()
                    },
                    "cells": [asdict(c) for c in result.cells],
                    "summary": result.summary,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"json: {args.json}")
    return result


if __name__ == "__main__":
    main()
