"""How fast the simulator sweeps: 100 cells (batching policy x routing policy x load) of 200
`bursty-mix` requests each on 8 simulated replicas, timed on the wall clock. The issue's
target is the whole sweep in under a minute on the 2-core development machine.

    .venv/bin/python benchmarks/simulator_speed.py [--cells 100] [--requests 200] [--replicas 8]
        [--cost-model results/cost_model.json] [--profile]

Steps cost what the cost model says (default: flat 20 ms; a calibrated JSON file if given).
Load is stated against the cluster's full-batch decode capacity under that model, as the real
experiments state it. Prints the total time, cells/s and simulated steps/s, so a slow sweep
shows whether it ran more steps or ran them slower.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import time

from replica.config import EngineConfig
from replica.model.fake import FlatCostModel
from replica.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from sim.cost_model import FittedCostModel
from sim.simulator import SimulationConfig, simulate
from workloads.standard import at_load

BATCHING = ("continuous", "chunked", "mixed", "dynamic")
ROUTING = ("least_loaded", "round_robin", "power_of_two", "least_queue", "random")
LOADS = (0.3, 0.5, 0.7, 0.9, 1.1)


def decode_capacity(cost, num_slots: int, num_replicas: int) -> float:
    """Output tokens/s of every slot of every replica decoding, under the cost model."""
    from replica.scheduling.request import Request, SamplingParams

    out = SchedulerOutput(
        [ScheduledChunk(Request(f"c{i}", [1] * 64, SamplingParams(), 0.0), 64, 1, True) for i in range(num_slots)]
    )
    return num_replicas * num_slots / cost.step_time(out)


def sweep(cells: int, requests: int, replicas: int, cost, slots: int = 8) -> tuple[int, int]:
    """Run the sweep; returns (requests finished, steps simulated)."""
    capacity = decode_capacity(cost, slots, replicas)
    grid = list(itertools.product(LOADS, BATCHING, ROUTING))[:cells]
    finished = steps = 0
    for n, (load, batching, routing) in enumerate(grid):
        workload = at_load("bursty-mix", requests, load, capacity, seed=n)
        config = SimulationConfig(
            num_replicas=replicas,
            routing_policy=routing,
            seed=n,
            engine=EngineConfig(policy=batching, num_slots=slots, max_seq_len=640),
        )
        result = simulate(workload, config, cost)
        finished += sum(t.finish_reason == "length" for t in result.traces)
        steps += sum(len(s) for s in result.steps.values())
    return finished, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--cost-model", default=None, help="a FittedCostModel JSON (default: flat 20 ms steps)")
    parser.add_argument("--profile", action="store_true", help="print the top functions by cumulative time")
    args = parser.parse_args()
    cost = FittedCostModel.load(args.cost_model) if args.cost_model else FlatCostModel()
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    finished, steps = sweep(args.cells, args.requests, args.replicas, cost)
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - start
    print(
        f"{args.cells} cells x {args.requests} requests on {args.replicas} replicas ({type(cost).__name__}): "
        f"{seconds:.1f} s = {args.cells / seconds:.2f} cells/s, {steps / seconds:.0f} simulated steps/s "
        f"({steps} steps, {finished}/{args.cells * args.requests} requests served)"
    )
    print(f"target: under 60 s -> {'met' if seconds < 60 else 'MISSED'}")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
