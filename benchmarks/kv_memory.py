"""K/V memory of the slot cache against the paged cache at one K/V budget, on `bursty-mix`.

The slot cache sets aside max_seq_len tokens for every live request, however short; the paged
cache takes one block at a time as a request grows. At the same budget (default 8 slots x 512
tokens = 4096 tokens of K/V) this measures, for each:

- unused share: K/V memory reserved but holding no token, over the run, as
  sum(step time x (reserved - used)) / sum(step time x reserved). Reserved: live slots x
  max_seq_len (slot cache, as `SlotKVCache.stats()` counts it), blocks in use x block_size
  (paged); used: the tokens whose K/V are in the cache after the step.
- concurrency: live sequences after each step, mean (over steps) and max.
- throughput: output tokens / makespan.

Two parts. (1) The whole workload on the flat-cost fake model and a virtual clock: exact and
instant, and the unused share and concurrency depend only on the schedule (its throughput
counts steps, each the same cost whatever the batch). (2) A shorter replay of the same
workload on the real default model on the wall clock, for throughput.

    python benchmarks/kv_memory.py [--budget 4096] [--paged-slots 64] [--block-size 16]
                                   [--requests 256] [--real-requests 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from metrics.definitions import summarize
from protocol.clock import Clock, FakeClock, WallClock
from replica import Engine, EngineConfig
from replica.engine import Runner, StepResult
from replica.model.fake import ScriptedFakeRunner
from replica.model.loader import DEFAULT_MODEL
from sim.replay import replay
from workloads.standard import bursty_mix

MAX_SEQ_LEN = 512


class MeasuredEngine(Engine):
    """An engine that records its K/V reservation and use after every step that ran."""

    def __init__(self, config: EngineConfig, runner: Runner, clock: Clock):
        super().__init__(config, runner, clock)
        self.samples: list[tuple[float, int, int, int]] = []  # (step seconds, reserved, used, live)

    def step(self) -> StepResult:
        result = super().step()
        if result.record is not None:
            table = self.scheduler.slots
            live = [*self.scheduler.running, *self.scheduler.held]
            reserved = table.used_kv_tokens if self.config.kv_cache == "paged" else len(live) * table.max_seq_len
            used = sum(r.num_computed_tokens for r in live)
            self.samples.append((result.record.duration, reserved, used, len(live)))
        return result


@dataclass
class Arm:
    cache: str
    model: str
    num_slots: int
    requests: int
    steps: int
    unused_share: float
    mean_live: float
    max_live: int
    throughput: float  # output tokens / s (virtual seconds on the fake model)
    preemptions: int


def configs(args: argparse.Namespace) -> dict[str, EngineConfig]:
    common = dict(policy=args.policy, max_seq_len=MAX_SEQ_LEN, kv_budget_tokens=args.budget)
    return {
        "slot": EngineConfig(num_slots=args.budget // MAX_SEQ_LEN, **common),
        "paged": EngineConfig(num_slots=args.paged_slots, kv_cache="paged", block_size=args.block_size, **common),
    }


def run_arm(config: EngineConfig, runner: Runner, clock: Clock, requests: int, rate: float, model: str) -> Arm:
    engine = MeasuredEngine(config, runner, clock)
    result = replay(
        engine,
        bursty_mix(num_requests=requests, rate=rate),
        progress=model != "fake",
        desc=f"{model} {config.kv_cache}",
    )
    weights, reserved, used, live = zip(*engine.samples)
    unused = sum(w * (r - u) for w, r, u in zip(weights, reserved, used)) / sum(
        w * r for w, r in zip(weights, reserved)
    )
    summary = summarize(result.traces)
    return Arm(
        config.kv_cache,
        model,
        config.num_slots,
        requests,
        len(engine.samples),
        unused,
        sum(live) / len(live),
        max(live),
        summary.throughput,
        summary.num_preemptions,
    )


def real_runner(config: EngineConfig) -> Runner:
    from replica.model.runner import ModelRunner  # torch only for part 2

    return ModelRunner(config.model_copy(update={"model": DEFAULT_MODEL}))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=8 * MAX_SEQ_LEN, help="K/V tokens for both caches")
    parser.add_argument("--paged-slots", type=int, default=64, help="most sequences the paged cache runs at once")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--policy", default="chunked", help="batching policy (vLLM v1 schedules as chunked does)")
    parser.add_argument("--requests", type=int, default=256, help="bursty-mix requests on the fake model")
    parser.add_argument("--rate", type=float, default=100.0, help="base arrival rate, requests/s (saturating)")
    parser.add_argument("--real-requests", type=int, default=32, help="requests on the real model (0: skip part 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)

    arms = []
    for config in configs(args).values():
        clock = FakeClock()
        arms.append(
            run_arm(
                config, ScriptedFakeRunner(clock, max_model_len=MAX_SEQ_LEN), clock, args.requests, args.rate, "fake"
            )
        )
    if args.real_requests:
        for config in configs(args).values():
            arms.append(run_arm(config, real_runner(config), WallClock(), args.real_requests, args.rate, DEFAULT_MODEL))

    print(
        f"bursty-mix at base rate {args.rate}/s (saturating), policy {args.policy}, K/V budget {args.budget} tokens "
        f"(slot: {args.budget // MAX_SEQ_LEN} slots x {MAX_SEQ_LEN}; paged: {args.budget // args.block_size} blocks "
        f"x {args.block_size}, up to {args.paged_slots} sequences)"
    )
    print(
        "fake = flat-cost fake model on a virtual clock (throughput in tokens per virtual second: it counts steps); "
        f"{DEFAULT_MODEL} = the real model on the wall clock"
    )
    header = (
        f"{'model':>14} {'cache':>6} {'reqs':>5} {'steps':>6} {'unused K/V':>10} {'mean live':>9} {'max live':>8} "
        f"{'tokens/s':>9} {'preempt':>7}"
    )
    print(header)
    for a in arms:
        print(
            f"{a.model:>14} {a.cache:>6} {a.requests:>5} {a.steps:>6} {a.unused_share:>10.1%} {a.mean_live:>9.1f} "
            f"{a.max_live:>8} {a.throughput:>9.1f} {a.preemptions:>7}"
        )
    for model in dict.fromkeys(a.model for a in arms):
        slot, paged = (next(a for a in arms if a.model == model and a.cache == c) for c in ("slot", "paged"))
        print(
            f"{model}: paged/slot mean concurrency {paged.mean_live / slot.mean_live:.2f}x, "
            f"throughput {paged.throughput / slot.throughput:.2f}x"
        )
    rows = [asdict(a) for a in arms]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
