"""Where one engine step's time goes, per dtype and step size, on the real default model: matrix
products, attention, the per-layer C++ kernels, the other torch operators of the forward pass,
and the Python around it (scheduler, step metadata, sampling, the engine's bookkeeping); and how
many torch operators and Python calls a step makes, which do not depend on what else the machine
runs, so they compare across runs on a shared machine where times do not.

    .venv/bin/python -m benchmarks.step_profile [--dtypes float32 bfloat16] [--batches 1 8 64]
        [--prefill 4] [--steps 8] [--reps 3] [--json PATH]

Step sizes: decode steps at each batch (B requests with 64-token prompts, prefilled first), and
one prefill step of `--prefill` 64-token prompts (4: one `chunked` token budget of 256 tokens).
Times: each part's seconds summed by wrappers around the engine's phases and the forward pass's
calls (`Linear`, the attention functions, the fused kernels), per step, the wrappers' own cost
taken off (`peers/step_parts.py`, the measurement `slotserve bench` prints its host shares
from); the median over `--reps` runs of `--steps` steps each. "Host" is the step less its
matrix products and attention. The same parts are also timed as the main thread's CPU time
(`time.thread_time`), which a neighbour's load on a shared machine does not stretch as it
does wall time (it still slows a cache-cold step somewhat). Each case also runs one step
with oneDNN's verbose log on, to name the implementation every matrix product took
(`brg_matmul:avx512_core_bf16` is oneDNN's AVX-512 BF16 path).

`benchmarks/hardware.py` measures the roofs and the decode sweep; this script explains a step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.hardware import PROMPT_LEN, decode_engine, drain
from peers.step_parts import PARTS, Parts, measure, wrapped, wrapper_seconds
from protocol.cpu import cpu_info
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.runner import ModelRunner

MODEL = "smollm2-135m"


class OpCounter(TorchDispatchMode):
    """Counts every torch operator dispatched, under the part of the step running it."""

    def __init__(self, parts: Parts) -> None:
        super().__init__()
        self.parts = parts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.parts.ops[self.parts.stack[-1]][str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def captured_fd1() -> Iterator[list[str]]:
    """Lines written to file descriptor 1 (oneDNN's verbose log is C's stdout, not Python's)."""
    lines: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            lines += tmp.read().splitlines()


def onednn_products(step: Callable[[], None]) -> dict[str, int]:
    """One step under oneDNN's verbose log: executed matrix products by (implementation, dtype)."""
    with captured_fd1() as lines, torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        step()
    found: collections.Counter[str] = collections.Counter()
    for line in lines:
        f = line.split(",")
        if len(f) > 8 and f[2] == "primitive" and f[3] == "exec" and f[5] in ("inner_product", "matmul"):
            src = re.search(r"src:(\w+):", f[8])
            found[f"{f[6]} ({src.group(1) if src else '?'})"] += 1
    return dict(found)


def python_calls(step: Callable[[], None]) -> int:
    """Python function calls one step makes (C functions not counted)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def case_engines(runner: ModelRunner, case: tuple[str, int], steps: int) -> Iterator[Engine]:
    """Fresh engines whose next step is the case: a decode step of B rows (one engine, stepped
    on), or a prefill step of n prompts (a new engine each time)."""
    kind, n = case
    if kind == "decode":
        engine = decode_engine(runner, n, steps)
        while True:
            yield engine
    while True:
        engine = Engine(EngineConfig(policy="mixed", num_slots=n, max_seq_len=256), runner=runner)
        for i in range(n):
            prompt = [100 + (7 * i + j) % 5000 for j in range(PROMPT_LEN)]
            engine.add_request(prompt, {"max_tokens": 1, "ignore_eos": True})
        yield engine


def profile_case(runner: ModelRunner, case: tuple[str, int], steps: int, reps: int) -> dict:
    """Median part times of `reps` runs of `steps` steps, torch operators and Python calls per
    step, and the oneDNN products of one step."""
    total_steps = (2 * reps + 1) * steps + 4
    engines = case_engines(runner, case, total_steps)
    wrapper_s, wrapper_cpu = wrapper_seconds(), wrapper_seconds(clock=time.thread_time)
    runs = [measure(engines, steps, wrapper_s) for _ in range(reps + 1)][1:]  # the first run warms up
    cpu_runs = [measure(engines, steps, wrapper_cpu, time.thread_time) for _ in range(reps)]
    counted = Parts()
    engine = next(engines)
    with wrapped(engine, counted) as step, OpCounter(counted):
        step()
    calls = python_calls(next(engines).step)
    products = onednn_products(next(engines).step)
    drain(engine)
    times = {p: statistics.median(r[p] for r in runs) for p in (*PARTS, "step", "host")}
    cpu = {p: statistics.median(r[p] for r in cpu_runs) for p in (*PARTS, "step", "host")}
    return {
        "case": f"{case[0]} {'B=' if case[0] == 'decode' else ''}{case[1]}"
        + ("" if case[0] == "decode" else f"x{PROMPT_LEN}"),
        "rows": case[1] if case[0] == "decode" else case[1] * PROMPT_LEN,
        "seconds": times,
        "host_seconds": times["host"],
        "cpu_seconds": cpu,
        "host_cpu_seconds": cpu["host"],
        "torch_ops": sum(sum(c.values()) for c in counted.ops.values()),
        "torch_ops_by_part": {p: sum(c.values()) for p, c in counted.ops.items()},
        "top_ops": collections.Counter(op for c in counted.ops.values() for op in c.elements()).most_common(8),
        "python_calls": calls,
        "onednn": products,
    }


def format_case(r: dict) -> list[str]:
    t = r["seconds"]
    shares = ", ".join(f"{p} {t[p] / t['step']:.0%}" for p in PARTS)
    by_part = ", ".join(f"{p} {n}" for p, n in sorted(r["torch_ops_by_part"].items(), key=lambda x: -x[1]))
    c = r["cpu_seconds"]
    cpu_parts = ", ".join(f"{p} {c[p] * 1e3:.2f}" for p in PARTS)
    return [
        f"{r['case']:>14}: step {t['step'] * 1e3:7.2f} ms, host {r['host_seconds'] * 1e3:6.2f} ms; {shares}",
        f"{'':16}main thread CPU: step {c['step'] * 1e3:.2f} ms, host {c['host'] * 1e3:.2f} ms; ms: {cpu_parts}",
        f"{'':16}torch ops {r['torch_ops']} ({by_part}); python calls {r['python_calls']}",
        f"{'':16}top ops: " + ", ".join(f"{op} {n}" for op, n in r["top_ops"]),
        f"{'':16}oneDNN products: " + (", ".join(f"{k} x{n}" for k, n in r["onednn"].items()) or "none"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64], help="decode batch sizes")
    parser.add_argument("--prefill", type=int, default=4, help="prompts of 64 tokens in the prefill step (0: none)")
    parser.add_argument("--steps", type=int, default=8, help="steps per timed run")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per case (the median is kept)")
    parser.add_argument("--int8-rows", type=int, default=0, help="EngineConfig.int8_rows of the runners")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()

    print(f"CPU: {cpu_info().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}: times on a shared machine are noisy")
    cases = [("decode", b) for b in args.batches] + ([("prefill", args.prefill)] if args.prefill else [])
    slots = max([*args.batches, args.prefill])
    result = {"cpu": cpu_info().describe(), "torch": torch.__version__, "dtypes": {}}
    for dtype in args.dtypes:
        config = EngineConfig(model=MODEL, dtype=dtype, num_slots=slots, max_seq_len=256, int8_rows=args.int8_rows)
        runner = ModelRunner(config)
        print(f"{dtype} (int8_rows={args.int8_rows}); shares of the step time:")
        rows = []
        for case in cases:
            rows.append(profile_case(runner, case, args.steps, args.reps))
            print("\n".join(format_case(rows[-1])), flush=True)
        result["dtypes"][dtype] = rows
        del runner
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
