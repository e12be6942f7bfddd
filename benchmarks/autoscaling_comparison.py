"""Autoscaling policies against static provisioning, in the simulator, on time-varying traffic.

Two workloads, three seeds each (different traffic): a synthetic compressed day
(`workloads.diurnal`: a 600 s day whose midday rate is 4x its edges', plus four 20 s bursts at
1.5x) and the shipped Azure conversation trace at its own rate profile, time-compressed 15x (a
different third of its requests per seed, lengths x 0.1). Replicas are fake and priced by their
work: the shipped fitted cost model (`workloads/experiments/cost_model.json`) run 10x faster,
8 slots, chunked batching. Each cell is run:

- by each autoscaling policy (`autoscaling.policies`), starting at 2 replicas, with a cold start
  of --cold-start seconds, a decision each second and a 10 s cooldown;
- on a static cluster sized for the peak and one sized for the mean: ceil(offered load /
  --utilization) replicas, the offered load (in replicas kept exactly busy at one replica's
  measured capacity) taken over the busiest 10 s window, or over the whole run.

Prints per cell and per configuration, averaged over the seeds: replica-seconds, SLO attainment
(TTFT and TPOT limits below), goodput per replica-second (output tokens of requests that met
the SLO), scale events and the most replicas at once; then the best policy (fewest
replica-seconds among those within 99% of static peak's attainment on every seed) and its
replica-seconds over static peak's, against the target: at least 30% fewer at no less than 99%
of static peak's SLO attainment.

    PYTHONPATH=. .venv/bin/python benchmarks/autoscaling_comparison.py [--seeds 3] [--cold-start 5]
        [--workloads diurnal azure] [--utilization 0.8]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from autoscaling.policies import AUTOSCALING_POLICIES, AutoscaleConfig
from metrics.definitions import SLO, RequestTrace
from replica.config import EngineConfig
from sim.autoscaling import AutoscalingSimulator, offered_load, static_replica_seconds
from sim.cost_model import FittedCostModel
from sim.simulator import SimulationConfig, measure_capacity, simulate
from workloads.capacity import Capacity
from workloads.diurnal import DiurnalArrivals, DiurnalDay
from workloads.traces import read_azure_csv
from workloads.workload import Workload

COST_MODEL = Path(__file__).resolve().parent.parent / "workloads" / "experiments" / "cost_model.json"
ENGINE = EngineConfig(policy="chunked", num_slots=8, max_seq_len=1536)
SLO_LIMITS = SLO(ttft=1.0, tpot=0.2)
PEAK_WINDOW_S = 10.0
START_REPLICAS = 2
BOUNDS = {"min_replicas": 1, "max_replicas": 16, "cooldown_s": 10.0, "period_s": 1.0}
# Each policy's parameters for a 600 s day: Ray Serve's delays (30 s up, 600 s down on a real
# day) shortened with it, the SLO policy on the run's TTFT limit, the forecast past the cold start.
POLICY_PARAMS: dict[str, dict[str, float]] = {
    "target_ongoing": {"target_ongoing_requests": 5, "upscale_delay_s": 2, "downscale_delay_s": 30, "look_back_s": 5},
    "queue_slo": {"ttft_slo_s": SLO_LIMITS.ttft, "up_at": 0.5, "headroom": 0.6, "down_after_s": 15},
    "predictive": {"window_s": 30, "horizon_s": 8, "headroom": 0.4},
}


def diurnal(seed: int) -> Workload:
    arrivals = DiurnalArrivals(rate=40, day_s=600, peak_to_trough=4, bursts=4, burst_s=20, burst_factor=1.5)
    return DiurnalDay(arrivals=arrivals, seed=seed).build()


def azure(seed: int) -> Workload:
    """Every third request of the trace from its `seed`-th on, gaps / 15: the trace's own rate
    profile over a 233 s hour."""
    start = read_azure_csv().requests[seed % 3].arrival
    return read_azure_csv(every=3, start_offset=start, time_scale=1 / 15, length_scale=0.1)


WORKLOADS = {"diurnal": diurnal, "azure": azure}


@dataclass
class Cell:
    replica_seconds: float
    attainment: float
    goodput_per_replica_s: float
    scale_events: int
    peak_replicas: int


def cell(traces: list[RequestTrace], replica_seconds: float, scale_events: int, peak_replicas: int) -> Cell:
    good = [t for t in traces if SLO_LIMITS.met_by(t)]
    tokens = sum(t.num_output_tokens for t in good)
    return Cell(replica_seconds, len(good) / len(traces), tokens / replica_seconds, scale_events, peak_replicas)


def run_seed(workload: Workload, capacity: Capacity, cost, utilization: float, cold_start: float) -> dict[str, Cell]:
    cells: dict[str, Cell] = {}
    peak = math.ceil(offered_load(workload, capacity, PEAK_WINDOW_S) / utilization)
    mean = math.ceil(offered_load(workload, capacity, None) / utilization)
    for label, replicas in (("static peak", peak), ("static mean", mean)):
        result = simulate(workload, SimulationConfig(num_replicas=replicas, engine=ENGINE), cost)
        cells[label] = cell(result.traces, static_replica_seconds(result), 0, replicas)
        print(f"    {label}: {cells[label]}", flush=True)
    for policy in AUTOSCALING_POLICIES:
        autoscale = AutoscaleConfig(policy=policy, params=POLICY_PARAMS[policy], **BOUNDS)
        config = SimulationConfig(num_replicas=START_REPLICAS, engine=ENGINE)
        run = AutoscalingSimulator(workload, config, autoscale, cost, capacity, cold_start).simulate()
        cells[policy] = cell(run.simulation.traces, run.replica_seconds, run.scale_events, run.peak_replicas)
        print(f"    {policy}: {cells[policy]}", flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cold-start", type=float, default=5.0, help="seconds from a replica asked for to serving")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--utilization", type=float, default=0.8, help="static sizing: offered load per replica")
    args = parser.parse_args()
    cost = FittedCostModel.load(COST_MODEL).scaled(0.1)
    capacity = measure_capacity(SimulationConfig(num_replicas=1, engine=ENGINE), cost)
    print(
        f"one replica: {capacity.decode_tokens_per_s:.0f} decode / {capacity.prefill_tokens_per_s:.0f} prefill "
        f"tokens/s; SLO TTFT <= {SLO_LIMITS.ttft:g} s, TPOT <= {SLO_LIMITS.tpot:g} s; cold start {args.cold_start:g} s"
    )
    started = time.perf_counter()
    met_all = True
    for name in args.workloads:
        runs = []
        for seed in range(args.seeds):
            workload = WORKLOADS[name](seed)
            print(f"{name} seed {seed}: {workload.describe()}", flush=True)
            runs.append(run_seed(workload, capacity, cost, args.utilization, args.cold_start))
        met_all &= report(name, runs)
    print(f"({time.perf_counter() - started:.0f} s wall)")
    print(f"target on every workload: {'met' if met_all else 'MISSED'}")


def report(name: str, runs: list[dict[str, Cell]]) -> bool:
    """The table over seeds, the best policy and the target line; returns whether it is met."""
    print(f"\n{name}, mean over {len(runs)} seeds")
    print(f"{'configuration':<16}{'replica-s':>11}{'SLO att.':>10}{'goodput/rep-s':>15}{'events':>8}{'peak':>6}")
    for label in runs[0]:
        mean = {f: statistics.mean(getattr(r[label], f) for r in runs) for f in Cell.__dataclass_fields__}
        print(
            f"{label:<16}{mean['replica_seconds']:>11.0f}{mean['attainment']:>10.4f}"
            f"{mean['goodput_per_replica_s']:>15.2f}{mean['scale_events']:>8.1f}{mean['peak_replicas']:>6.1f}"
        )
    eligible = [
        p for p in AUTOSCALING_POLICIES if all(r[p].attainment >= 0.99 * r["static peak"].attainment for r in runs)
    ]
    if not eligible:
        print("best policy: none within 99% of static peak's SLO attainment on every seed -> target MISSED")
        return False
    best = min(eligible, key=lambda p: sum(r[p].replica_seconds for r in runs))
    ratios = [r[best].replica_seconds / r["static peak"].replica_seconds for r in runs]
    ratio = statistics.mean(ratios)
    met = max(ratios) <= 0.7
    print(
        f"best policy: {best}: replica-seconds / static peak's = {ratio:.3f} (per seed "
        f"{', '.join(f'{x:.3f}' for x in ratios)}); target <= 0.70 at >= 99% of its SLO attainment -> "
        f"{'met' if met else 'MISSED'}"
    )
    return met


if __name__ == "__main__":
    main()
