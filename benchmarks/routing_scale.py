"""Routing at scale in the simulator: 256 replicas replaying the shipped Azure conversation
trace (the whole hour, 19,366 requests) at its real rate (x --rate-scale; lengths x
--length-scale), every routing policy, against 4 replicas given every 64th request at the same
timing (the same load per replica), and the policies' ranking at each size by goodput.

    .venv/bin/python benchmarks/routing_scale.py                      # the real rate
    .venv/bin/python benchmarks/routing_scale.py --rate-scale 32      # 32x the rate: a loaded cluster

Replicas run the calibrated cost model of the shipped experiments (SmolLM2-135M on this
machine's CPU, chunked batching, 8 slots, paged cache with prefix caching). The simulations
run in --jobs processes. Prints the offered load (a multiple of the simulated cluster's
measured capacity for the work the requests carry), per size and policy goodput, TTFT p99,
imbalance and the wall time the simulation took, then the two rankings, how many policy pairs
they order alike, and the total time against the 5-minute target.
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from metrics.definitions import SLO, summarize
from replica.config import EngineConfig
from router.policies import ROUTING_POLICIES
from sim.cost_model import FittedCostModel
from sim.simulator import SimulationConfig, measure_capacity, simulate
from workloads.spec import TraceSpec
from workloads.workload import Workload

COST = Path(__file__).resolve().parent.parent / "workloads" / "experiments" / "cost_model.json"
ENGINE = EngineConfig(policy="chunked", num_slots=8, max_seq_len=512, kv_cache="paged", prefix_caching=True)
SLO_USED = SLO(ttft=2.0, tpot=0.25)
SIZES = ((256, 1), (4, 64))  # (replicas, every n-th request of the trace)


def workload(every: int, args: argparse.Namespace) -> Workload:
    trace = TraceSpec(format="azure", length_scale=args.length_scale, every=every, time_scale=1.0 / args.rate_scale)
    built = trace.build()
    kept = [r for r in built.requests if r.arrival <= args.minutes * 60 / args.rate_scale]
    return Workload(built.name, built.seed, kept, built.params, built.spec)


def one(job: tuple[int, int, str, argparse.Namespace]) -> tuple[int, str, dict]:
    """One policy at one size (run in a worker process)."""
    replicas, every, policy, args = job
    cost = FittedCostModel.load(COST)
    start = time.perf_counter()
    config = SimulationConfig(num_replicas=replicas, engine=ENGINE, routing_policy=policy)
    result = simulate(workload(every, args), config, cost)
    wall = time.perf_counter() - start
    summary = summarize(result.traces, SLO_USED)
    served: dict[str | None, int] = {}
    for t in result.traces:
        served[t.replica] = served.get(t.replica, 0) + t.num_output_tokens
    tokens = [served.get(f"r{i}", 0) for i in range(replicas)]
    imbalance = max(tokens) / (sum(tokens) / replicas)
    figures = {"goodput": summary.goodput, "ttft_p99": summary.ttft["p99"], "imbalance": imbalance, "wall": wall}
    return replicas, policy, figures


def offered_load(replicas: int, every: int, args: argparse.Namespace) -> tuple[str, float]:
    """The workload, and its work per second over the capacity of `replicas` replicas (measured
    on 4 and scaled: replicas are alike and routing is free in the simulator)."""
    capacity = measure_capacity(SimulationConfig(num_replicas=4, engine=ENGINE), FittedCostModel.load(COST))
    w = workload(every, args)
    span = w.requests[-1].arrival - w.requests[0].arrival
    work = sum(capacity.work_seconds(r.prompt_len, r.output_len) for r in w.requests)
    return w.describe(), work / span * 4 / replicas


def _order(keys: dict, a: str, b: str) -> int:
    """-1, 0 or 1 as policy a ranks before, level with or after policy b."""
    return (keys[a] > keys[b]) - (keys[a] < keys[b])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="minutes of the trace replayed (it has ~58)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate x this (1: the real rate)")
    parser.add_argument("--length-scale", type=float, default=0.05, help="prompt and output lengths x this")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once (processes)")
    args = parser.parse_args()
    start = time.perf_counter()
    for replicas, every in SIZES:
        described, load = offered_load(replicas, every, args)
        print(f"{replicas:>3} replicas: {described}; offered load {load:.3f}x capacity", flush=True)
    jobs = [(r, e, p, args) for (r, e), p in itertools.product(SIZES, ROUTING_POLICIES)]
    results: dict[int, dict[str, dict]] = {r: {} for r, _ in SIZES}
    with ProcessPoolExecutor(args.jobs) as pool:
        for replicas, policy, res in pool.map(one, jobs):
            results[replicas][policy] = res
            print(
                f"  {replicas:>3} {policy:<18} good tok/s {res['goodput']:9.1f}  TTFT p99 {res['ttft_p99']:7.3f} s  "
                f"imbalance {res['imbalance']:5.2f}  sim {res['wall']:6.1f} s",
                flush=True,
            )
    keys = {}
    for replicas, res in results.items():
        keys[replicas] = {p: (-round(res[p]["goodput"], 1), round(res[p]["ttft_p99"], 3)) for p in res}
        ranked = sorted(res, key=keys[replicas].get)
        text = ranked[0] + "".join(
            (" = " if keys[replicas][b] == keys[replicas][a] else " > ") + b for a, b in itertools.pairwise(ranked)
        )
        print(f"ranking (goodput, then TTFT p99; = a tie) at {replicas:>3} replicas: {text}")
    big, small = (keys[r] for r, _ in SIZES)
    pairs = list(itertools.combinations(ROUTING_POLICIES, 2))
    alike = sum(_order(big, a, b) == _order(small, a, b) for a, b in pairs)
    print(f"policy pairs ordered alike (ties included) at 256 and 4 replicas: {alike} of {len(pairs)}")
    total = time.perf_counter() - start
    print(f"total {total:.0f} s with {args.jobs} processes (target: under 300 s): {'MET' if total < 300 else 'MISSED'}")


if __name__ == "__main__":
    main()
