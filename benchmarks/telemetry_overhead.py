"""What live metrics cost the engine: step time with the replica exporter's hooks and with the
no-op hooks an actor without an exporter calls, alternating step by step on the same saturated
engine in the same run (so drift and other load hit both arms alike; the paired difference
compares each step with the one next to it).

Each iteration is what the serving loop does per step: `engine.step()`, then the hooks the
replica actor calls (`on_finish` for each ended request, `on_step`, `on_load`, and `on_submit`
for each replacement request). Two engines: the flat-cost fake model with zero step cost (the
engine's own bookkeeping only, so the overhead's largest relative share) and, unless
`--no-model`, the default model (SmolLM2-135M) on this CPU.

    .venv/bin/python benchmarks/telemetry_overhead.py
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import ray

from cluster.prometheus_exporters import ReplicaExporter
from metrics.definitions import SLO
from protocol.telemetry_hooks import ReplicaTelemetry
from replica import Engine, EngineConfig


def saturated_engine(engine: Engine, hooks: ReplicaTelemetry, ids: itertools.count, rng: random.Random) -> None:
    """Fill every free slot (and a short queue) with a fresh request."""
    while len(engine.requests) < engine.config.num_slots + 2:
        rid = f"b{next(ids)}"
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(8, 48))]
        engine.add_request(prompt, {"max_tokens": rng.randrange(16, 64), "ignore_eos": True}, rid)
        hooks.on_submit(rid)


def run_arms(engine: Engine, pairs: int) -> dict[str, list[float]]:
    """Per-step seconds with the exporter ("on") and with the no-op hooks ("off"), alternating."""
    exporter = ReplicaExporter("bench", engine, model=engine.config.model, slo=SLO())
    arms = {"on": exporter, "off": ReplicaTelemetry()}
    times: dict[str, list[float]] = {"on": [], "off": []}
    ids, rng = itertools.count(), random.Random(0)
    saturated_engine(engine, exporter, ids, rng)
    for _ in range(3):  # warm up
        engine.step()
    for step in range(2 * pairs):
        name = "on" if step % 2 == 0 else "off"
        hooks = arms[name]
        started = time.perf_counter()
        result = engine.step()
        for output in result.outputs:
            if output.finished:
                hooks.on_finish(output)
        if result.record is not None:
            hooks.on_step(result.record)
        hooks.on_load(engine.load_report("bench"))
        saturated_engine(engine, hooks, ids, rng)
        times[name].append(time.perf_counter() - started)
    return times


def report(label: str, times: dict[str, list[float]]) -> None:
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    paired = statistics.median(a - b for a, b in zip(times["on"], times["off"]))
    print(
        f"{label:<30} {len(times['on']):>5} pairs   median step {off * 1e3:8.3f} ms without, {on * 1e3:8.3f} ms with "
        f"({on / off:.4f}x); median paired difference {paired * 1e6:+8.1f} us = {paired / off:+.2%} of a step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--no-model", action="store_true", help="only the fake-model engine")
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="ERROR", num_cpus=1)
    from protocol.clock import WallClock
    from replica.model.fake import FlatCostModel, ScriptedFakeRunner

    clock = WallClock()
    fake = Engine(
        EngineConfig(model="fake", num_slots=args.slots, max_seq_len=256),
        ScriptedFakeRunner(clock, FlatCostModel(0.0)),
        clock,
    )
    print(f"telemetry hooks on vs off, alternating step by step, {args.slots} slots, saturated")
    report("fake model (zero step cost)", run_arms(fake, pairs=2000))
    if not args.no_model:
        real = Engine(EngineConfig(num_slots=args.slots, max_seq_len=256, device="cpu"))
        report(f"{real.config.model} on this CPU", run_arms(real, pairs=150))
    ray.shutdown()


if __name__ == "__main__":
    main()
