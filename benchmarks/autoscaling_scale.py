"""The autoscaling simulator at cluster scale: a day of time-varying traffic (`--day-s` seconds
of trace time, 86,400: a real day) through 1 to `--max-replicas` (256) replicas under the
`predictive` policy, at a rate whose midday peak needs them all.

The traffic is a synthetic day (`workloads.diurnal`): a cosine from the trough at midnight to a
midday peak `--peak-to-trough` (4) times higher, plus `--bursts` bursts (6 a day, each 1/720 of
the day long, at 1.5x the rate there), lengths as `DiurnalDay`'s. Its rate is set from one
replica's measured capacity: the curve's peak offered load, in replicas kept exactly busy, is
`--max-replicas` / (1 + the policy's headroom), so the policy asks for the maximum at midday and
a burst near it is capped there. Replicas are those of `benchmarks.autoscaling_comparison`
(8 slots, chunked batching) priced by the shipped fitted cost model at its own speed (SmolLM2
on CPU; `--speedup` runs it faster), with a `--cold-start` (10 s), a decision each second and a
30 s cooldown; the policy reads a 60 s window and forecasts 15 s ahead, or one cold start if longer.

A day runs through the slot-queue model of a replica (`sim.slot_queue`: a queue in front of its
slots, each request priced once), its traffic drawn at once as arrays (`DiurnalDay.columns`).
Prints the offered traffic, the run's wall time and requests per wall second, the most replicas
at once, replica-seconds, SLO attainment (TTFT <= 10 s, TPOT <= 2 s: the comparison's limits at
the cost model's own speed), TTFT percentiles, scale events, the process's peak memory (max
RSS), the CPU model, and the total wall time against the 5-minute target; for a shorter day,
the full day's time and memory extrapolated from it.

`--check` runs one day (`DiurnalDay.build`'s draws) through both models of a replica, the step
simulator's engines (`sim.autoscaling.AutoscalingSimulator`, keeping no step records) and the
slot queues, and prints both and their ratio: how far the coarser model moves the figures.

    .venv/bin/python -m benchmarks.autoscaling_scale                      # a full day, 256 replicas
    .venv/bin/python -m benchmarks.autoscaling_scale --day-s 300 --check  # a 5-minute day, both models

`--router` measures instead the router's cost per decision as the replicas grow: route and
complete in a loop on the pure `Router` (virtual clock) over 16, 64 and 256 replicas, each with
4 requests in flight on average and one load report per decision, with the per-replica decision
figures off (as the day's run keeps them) and on, for the policies that choose from the router's
index of routable replicas; it prints decisions per second.
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from pathlib import Path

import numpy as np

from autoscaling.policies import AutoscaleConfig
from metrics.definitions import SLO
from protocol.clock import FakeClock
from protocol.cpu import cpu_info
from protocol.messages import LoadReport
from protocol.routing import RouteRequest
from replica.config import EngineConfig
from router.router import Router
from sim.autoscaling import AutoscalingSimulator, ScalingRecord
from sim.cost_model import FittedCostModel
from sim.simulator import SimulationConfig, measure_capacity
from sim.slot_queue import SlotQueueCluster
from workloads.diurnal import DiurnalArrivals, DiurnalDay

COST_MODEL = Path(__file__).resolve().parent.parent / "workloads" / "experiments" / "cost_model.json"
ENGINE = EngineConfig(policy="chunked", num_slots=8, max_seq_len=1536)
PARAMS = {"window_s": 60.0, "horizon_s": 15.0, "headroom": 0.25}
BOUNDS = {"min_replicas": 1, "cooldown_s": 30.0, "period_s": 1.0}
DAY_S = 86_400.0
SIZING_SAMPLE = 10_000  # length draws the mean work of a request is taken over
BURST_SHARE = 1 / 720  # a burst lasts this share of the day: 2 minutes of a real one
ROUTER_REPLICAS = (16, 64, 256)
ROUTER_POLICIES = ("least_loaded", "power_of_two")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--day-s", type=float, default=DAY_S, help="seconds of trace time in the day")
    parser.add_argument("--max-replicas", type=int, default=256, help="the policy's bound, reached at midday")
    parser.add_argument("--peak-to-trough", type=float, default=4.0)
    parser.add_argument("--bursts", type=int, default=6, help="bursts in the day")
    parser.add_argument("--cold-start", type=float, default=10.0, help="seconds from a replica asked for to serving")
    parser.add_argument("--speedup", type=float, default=1.0, help="the cost model run this many times faster")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check", action="store_true", help="run the day through both replica models, engine steps and slot queues"
    )
    parser.add_argument("--router", action="store_true", help="measure the router's decisions alone (see above)")
    parser.add_argument("--decisions", type=int, default=20_000, help="with --router: decisions per measurement")
    args = parser.parse_args()
    if args.router:
        print_router_rates(args.decisions, args.seed)
        return
    started = time.perf_counter()
    imported_rss = max_rss_mib()
    cost = FittedCostModel.load(COST_MODEL).scaled(1 / args.speedup)
    config = SimulationConfig(num_replicas=1, engine=ENGINE)
    capacity = measure_capacity(config, cost)
    day, peak_rate, mean_work = sized_day(args, capacity)
    autoscale = AutoscaleConfig(policy="predictive", params=PARAMS, max_replicas=args.max_replicas, **BOUNDS)
    slo = SLO(ttft=10.0, tpot=2.0)
    if args.check:
        workload = day.build()
        print(describe(workload.describe(), len(workload.requests), args.day_s, peak_rate, capacity, mean_work))
        sim = AutoscalingSimulator(workload, config, autoscale, cost, capacity, args.cold_start, keep_records=False)
        timed = time.perf_counter()
        engines = sim.simulate()
        timed = time.perf_counter() - timed
        traces = engines.simulation.traces
        attainment = sum(1 for t in traces if slo.met_by(t)) / len(traces)
        ttft = np.array([t.ttft for t in traces if t.ttft is not None])
        print_run("engine steps", timed, len(traces), engines, attainment, slo, ttft)
        timed = time.perf_counter()
        queues = SlotQueueCluster(workload.columns(), config, autoscale, cost, capacity, args.cold_start).run()
        timed = time.perf_counter() - timed
        print_run("slot queues", timed, len(traces), queues, queues.slo_attainment(slo), slo, queues.ttft)
        ratio = queues.replica_seconds / engines.replica_seconds
        print(
            f"slot queues against engine steps: replica-seconds {ratio:.3f}x, "
            f"SLO attainment {100 * (queues.slo_attainment(slo) - attainment):+.2f} points"
        )
        return
    requests = day.columns()
    print(describe(f"{day.name} (seed {args.seed})", len(requests), args.day_s, peak_rate, capacity, mean_work))
    simulated = time.perf_counter()
    run = SlotQueueCluster(requests, config, autoscale, cost, capacity, args.cold_start).run()
    simulated = time.perf_counter() - simulated
    print_run("slot queues", simulated, len(requests), run, run.slo_attainment(slo), slo, run.ttft)
    peak_rss = max_rss_mib()
    total = time.perf_counter() - started
    print(f"peak memory (max RSS) {peak_rss:.0f} MiB; CPU {cpu_info().describe()}")
    if args.day_s >= DAY_S:
        print(f"total {total:.0f} s (target: under 300 s): {'MET' if total < 300 else 'MISSED'}")
    else:  # the traffic and the replicas per trace second are a full day's: the cost grows with its length
        scale = DAY_S / args.day_s
        memory = imported_rss + (peak_rss - imported_rss) * scale
        print(
            f"total {total:.0f} s; a {DAY_S:,.0f} s day at this rate: about {len(requests) * scale:,.0f} requests "
            f"in {simulated * scale:.0f} s (target: under 300 s), max RSS about {memory / 2**10:.1f} GiB"
        )


def sized_day(args: argparse.Namespace, capacity) -> tuple[DiurnalDay, float, float]:
    """The day at the rate whose midday needs `--max-replicas` (see the module docstring)."""
    day = DiurnalDay(
        arrivals=DiurnalArrivals(
            rate=1.0,
            day_s=args.day_s,
            peak_to_trough=args.peak_to_trough,
            bursts=args.bursts,
            burst_s=args.day_s * BURST_SHARE,
            burst_factor=1.5,
        ),
        seed=args.seed,
    )
    rng = random.Random(f"{args.seed}-sizing")
    sample = [(day.prompt_len.sample(rng), day.output_len.sample(rng)) for _ in range(SIZING_SAMPLE)]
    mean_work = sum(capacity.work_seconds(p, o) for p, o in sample) / SIZING_SAMPLE
    peak_rate = args.max_replicas / (1 + PARAMS["headroom"]) / mean_work
    ratio = args.peak_to_trough  # the curve's mean rate is (trough + peak) / 2
    day = day.replace(arrivals=day.arrivals.replace(rate=peak_rate * (1 + ratio) / (2 * ratio)))
    return day, peak_rate, mean_work


def describe(what: str, requests: int, day_s: float, peak_rate: float, capacity, mean_work: float) -> str:
    return (
        f"{what}: {requests} requests, {requests / day_s:.1f} req/s over a {day_s:g} s day, "
        f"midday {peak_rate:.1f} req/s; one replica {capacity.decode_tokens_per_s:.1f} decode / "
        f"{capacity.prefill_tokens_per_s:.1f} prefill tok/s ({mean_work:.3f} s of work a request)"
    )


def print_run(
    model: str, seconds: float, requests: int, run: ScalingRecord, attainment: float, slo: SLO, ttft: np.ndarray
) -> None:
    p50, p90, p99 = np.nanpercentile(ttft, [50, 90, 99])
    print(
        f"{model}: {requests} requests in {seconds:.1f} s ({requests / seconds:,.0f} requests/s); "
        f"peak replicas {run.peak_replicas}, replica-seconds {run.replica_seconds:.0f} "
        f"(mean {run.mean_replicas:.1f} replicas), SLO attainment {attainment:.4f} "
        f"(TTFT <= {slo.ttft:g} s, TPOT <= {slo.tpot:g} s), TTFT p50/p90/p99 {p50:.3f}/{p90:.3f}/{p99:.3f} s, "
        f"scale events {run.scale_events}",
        flush=True,
    )


def print_router_rates(decisions: int, seed: int) -> None:
    print(f"router route + complete, {decisions:,} decisions each: decisions/s (us a decision)")
    print(f"{'policy':<14} {'replicas':>8} {'figures off':>20} {'figures on':>20}")
    for policy in ROUTER_POLICIES:
        for replicas in ROUTER_REPLICAS:
            rates = [router_rate(policy, replicas, decisions, seed, figures) for figures in (False, True)]
            cells = " ".join(f"{r:>11,.0f} ({1e6 / r:>5.1f})" for r in rates)
            print(f"{policy:<14} {replicas:>8} {cells}")


def router_rate(policy: str, replicas: int, decisions: int, seed: int, figures: bool) -> float:
    """Decisions per second of `Router.route` + `Router.complete`, with one load report each."""
    rng = random.Random(seed)
    clock = FakeClock()
    ids = [f"r{i}" for i in range(replicas)]
    router = Router(ids, policy, clock, seed=seed, decision_figures=figures)
    window = 4 * replicas
    free = [rng.randint(0, ENGINE.num_slots) for _ in range(decisions)]  # drawn ahead: not timed
    reports = [
        LoadReport(ids[i % replicas], 0 if f else i % 3, ENGINE.num_slots - f, f, ENGINE.num_slots, 512 * f, 0.0)
        for i, f in enumerate(free)
    ]
    started = time.perf_counter()
    for i in range(decisions):
        clock.sleep(0.001)
        router.route(RouteRequest(f"q{i}", 32, 64))
        if i >= window:
            router.complete(f"q{i - window}")
        router.report(reports[i])
        if i % 100 == 0:
            router.drain_decisions()
    return decisions / (time.perf_counter() - started)


def max_rss_mib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


if __name__ == "__main__":
    main()
