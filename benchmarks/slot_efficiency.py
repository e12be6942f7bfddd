"""Slot efficiency of static against continuous batching on the `sigma-sweep` workload.

Static batching keeps a finished request's row until the longest request of its batch is
done, so its slot efficiency is mean output length / mean longest output per batch, which
can be computed from the workload alone. This script measures it on the engine (flat-cost
fake model, virtual clock: exact and instant) and prints it next to the expected value.

    python benchmarks/slot_efficiency.py [--slots 8] [--requests 48] [--seed 0]
"""

from __future__ import annotations

import argparse

from metrics.definitions import expected_static_slot_efficiency, slot_efficiency
from protocol.clock import FakeClock
from replica import Engine, EngineConfig
from replica.model.fake import ScriptedFakeRunner
from sim.replay import replay
from workloads.standard import SIGMAS, sigma_sweep


def measure(policy: str, sigma: float, slots: int, requests: int, seed: int) -> float:
    clock = FakeClock()
    engine = Engine(EngineConfig(policy=policy, num_slots=slots, max_seq_len=512), ScriptedFakeRunner(clock), clock)
    result = replay(engine, sigma_sweep(sigma, requests, seed))
    return slot_efficiency((s.useful_rows for s in result.steps), (s.computed_rows for s in result.steps))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = []
    print(f"{'sigma':>5}  {'expected static':>15}  {'measured static':>15}  {'continuous':>10}")
    for sigma in SIGMAS:
        lens = sigma_sweep(sigma, args.requests, args.seed).output_lens
        row = {
            "sigma": sigma,
            "expected_static": expected_static_slot_efficiency(lens, args.slots),
            "static": measure("static", sigma, args.slots, args.requests, args.seed),
            "continuous": measure("continuous", sigma, args.slots, args.requests, args.seed),
        }
        rows.append(row)
        print(f"{sigma:>5}  {row['expected_static']:>15.3f}  {row['static']:>15.3f}  {row['continuous']:>10.3f}")
    return rows


if __name__ == "__main__":
    main()
