"""precise_prefix at cluster scale in the simulator: `--replicas` replicas (256) behind one
router on the kv-pressure workload grown with them (16 prefixes of 1,024 tokens and 32 open
sessions per 4 replicas, so each replica's K/V budget still holds about a third of its share),
at `--load` x the cluster's measured capacity (the real rate for that many replicas: capacity is
probed on 4 and scaled, since replicas are alike and routing is free in the simulator).

Replicas are those of the shipped kv-pressure experiment (its cost model and scale, paged K/V
with prefix caching, 5,632 K/V tokens each, chunked batching, 8 slots); each sends its K/V events
on its load reports and the router keeps its precise block index from them. Prints the offered
load, the run's goodput, TTFT p50/p90, prefix hit rate against the best possible, the router's
decisions per second (decisions over the seconds spent inside `Router.route`), the block index's
memory after the run (its own containers and ints, measured by walking them with
`sys.getsizeof`, in flight blocks included), the blocks it holds and the total wall time against
the 5-minute target.

    .venv/bin/python benchmarks/precise_prefix_scale.py                         # 256 replicas
    .venv/bin/python benchmarks/precise_prefix_scale.py --replicas 16 --requests-per-replica 20
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from experiments.plan import plan_experiment
from metrics.definitions import SLO, summarize
from sim.simulator import SimulationConfig, Simulator, measure_capacity
from workloads.capacity import Capacity
from workloads.prefixes import best_prefix_hit_rate
from workloads.standard import kv_pressure_spec

EXPERIMENT = Path(__file__).resolve().parent.parent / "workloads" / "experiments" / "kv-pressure.toml"
REPLICAS_PER_GROUP = 4  # kv-pressure's shape: 16 prefixes and 32 sessions per 4 replicas


def deep_size(root: object) -> int:
    """Bytes held by `root` and everything it refers to (dicts, lists, ints; once each)."""
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.append(vars(obj))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=256, help="replicas behind the router")
    parser.add_argument("--requests-per-replica", type=int, default=50, help="requests = this x replicas")
    parser.add_argument("--load", type=float, default=0.8, help="offered load x the cluster's measured capacity")
    parser.add_argument("--policy", default="precise_prefix", help="routing policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    plan = plan_experiment(EXPERIMENT, simulate=True)
    engine = plan.engine_config(plan.cells[0])
    groups = max(1, args.replicas // REPLICAS_PER_GROUP)
    spec = kv_pressure_spec(
        num_requests=args.requests_per_replica * args.replicas,
        groups=16 * groups,
        active_sessions=32 * groups,
        seed=args.seed,
    )
    probed = measure_capacity(SimulationConfig(num_replicas=REPLICAS_PER_GROUP, engine=engine), plan.cost)
    factor = args.replicas / REPLICAS_PER_GROUP
    capacity = Capacity(probed.decode_tokens_per_s * factor, probed.prefill_tokens_per_s * factor)
    workload = spec.at_load(args.load, capacity).build()
    span = workload.requests[-1].arrival - workload.requests[0].arrival
    print(
        f"{args.replicas} replicas, {args.policy}: {workload.describe()}; {len(workload.requests) / span:.1f} req/s "
        f"= {args.load} x capacity ({capacity.decode_tokens_per_s:.0f} output, {capacity.prefill_tokens_per_s:.0f} "
        "prompt tok/s)",
        flush=True,
    )
    config = SimulationConfig(num_replicas=args.replicas, engine=engine, routing_policy=args.policy, seed=args.seed)
    sim = Simulator(workload, config, plan.cost)
    route, spent = sim.router.route, [0.0]

    def timed(request):
        t = time.perf_counter()
        try:
            return route(request)
        finally:
            spent[0] += time.perf_counter() - t

    sim.router.route = timed
    simulated = time.perf_counter()
    result = sim.run()
    simulated = time.perf_counter() - simulated
    summary = summarize(result.traces, SLO(**plan.experiment.slo.model_dump()))
    prompt = sum(t.prompt_len for t in result.traces if t.replica is not None)
    prefill = sum(s.num_prefill_tokens for steps in result.steps.values() for s in steps)
    best = best_prefix_hit_rate(workload, args.seed, config.vocab_size, engine.block_size)
    gc.collect()
    index = sim.router.block_index
    memory = deep_size(index) + deep_size(getattr(sim.router.policy, "in_flight", None))
    blocks = sum(index.num_blocks(r) for r in sim.router.replica_ids)
    print(
        f"goodput {summary.goodput:.1f} tok/s, TTFT p50 {summary.ttft['p50']:.3f} s, p90 {summary.ttft['p90']:.3f} s; "
        f"prefix hit {1 - prefill / prompt:.1%} (best possible {best:.1%})"
    )
    print(
        f"router: {sim.router.routed} decisions in {spent[0]:.2f} s inside Router.route = "
        f"{sim.router.routed / spent[0]:.0f} decisions/s; block index {memory / 2**20:.1f} MiB for {blocks} blocks "
        f"({memory / max(blocks, 1):.0f} B per block, in-flight blocks included), gaps {index.gaps}"
    )
    total = time.perf_counter() - start
    print(
        f"simulation {simulated:.0f} s, total {total:.0f} s (target: under 300 s): {'MET' if total < 300 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
