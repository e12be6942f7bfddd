"""The C++ decode attention kernel (`replica/kernels/decode_attention.py`) against
scaled_dot_product_attention, in one process, in turns: decode steps at a few batch sizes and
a small `saturated` run, each on a runner built with `EngineConfig(decode_kernel=False)` ("before")
and on one with the kernel ("after"). A quick check (2-4 minutes) where `slotserve bench` takes 20.

    .venv/bin/python benchmarks/decode_speed.py [--batches 1 8 64] [--requests 24] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.runner import ModelRunner
from workloads.standard import saturated
from workloads.workload import request_prompt

MAX_SEQ_LEN = 64 + 256  # saturated: prompts up to 64 tokens, outputs up to 256
DECODE_STEPS_BEFORE = 100  # decode this far first, so contexts (140-200) are mid-run ones


def decode_steps(runners: dict[bool, ModelRunner], batch: int, reps: int) -> dict[bool, float]:
    """Median step seconds without and with the kernel (runners[False], runners[True]) in turns,
    `batch` requests decoding together on each."""
    engines = {}
    for on, runner in runners.items():
        config = EngineConfig(policy="mixed", num_slots=runner.cache.num_slots, max_seq_len=MAX_SEQ_LEN)
        engines[on] = engine = Engine(config, runner)
        for i in range(batch):
            prompt = [100 + (7 * i + j) % 5000 for j in range(40 + i % 24)]
            engine.add_request(prompt, {"max_tokens": DECODE_STEPS_BEFORE + 2 * reps + 4, "ignore_eos": True})
        for _ in range(DECODE_STEPS_BEFORE):
            engine.step()
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(reps + 1):
        for on, engine in engines.items():
            record = engine.step().record
            assert record.num_decode_tokens == batch and record.num_prefill_tokens == 0
            if round_:
                times[on].append(record.duration)
    for engine in engines.values():
        for rid in list(engine.requests):
            engine.abort(rid)
    return {on: statistics.median(t) for on, t in times.items()}


def saturated_run(engine: Engine, num_requests: int) -> float:
    """Useful tokens/s of `saturated` with `num_requests` requests on `engine`."""
    w = saturated(num_requests=num_requests)
    prompts = [request_prompt(w.seed, i, r, engine.runner.vocab_size) for i, r in enumerate(w.requests)]
    t = time.perf_counter()
    done = engine.generate(prompts, [{"max_tokens": n, "ignore_eos": True} for n in w.output_lens])
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--reps", type=int, default=8, help="decode steps per side and batch size")
    parser.add_argument("--requests", type=int, default=24, help="saturated requests (0: skip that run)")
    parser.add_argument("--runs", type=int, default=2, help="saturated runs per side, in turns")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--int8-rows", type=int, default=0)
    args = parser.parse_args()

    config = EngineConfig(
        dtype=args.dtype, num_slots=max(args.batches), max_seq_len=MAX_SEQ_LEN, int8_rows=args.int8_rows
    )
    runners = {on: ModelRunner(config.model_copy(update={"decode_kernel": on})) for on in (False, True)}
    print(f"{args.dtype}, int8_rows={args.int8_rows}; before = SDPA, after = the decode kernel (in turns)")
    for batch in args.batches:
        t = decode_steps(runners, batch, args.reps)
        print(
            f"decode step B={batch:3d}: before {t[False] * 1e3:7.1f} ms, after {t[True] * 1e3:7.1f} ms, "
            f"{t[False] / t[True]:.2f}x"
        )
    if args.requests:
        chunked = config.model_copy(update={"policy": "chunked"})
        engines = {on: Engine(chunked, runner) for on, runner in runners.items()}
        for engine in engines.values():  # warm-up
            engine.generate([[100, 101, 102]] * 2, [{"max_tokens": 2, "ignore_eos": True}] * 2)
        tps: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.runs):
            for on, engine in engines.items():
                tps[on].append(saturated_run(engine, args.requests))
        before, after = statistics.median(tps[False]), statistics.median(tps[True])
        print(
            f"saturated, {args.requests} requests, chunked, {config.num_slots} slots: before {before:.0f} tok/s, "
            f"after {after:.0f} tok/s, {after / before:.2f}x (runs: {[round(x) for x in tps[False]]} -> "
            f"{[round(x) for x in tps[True]]})"
        )


if __name__ == "__main__":
    main()
