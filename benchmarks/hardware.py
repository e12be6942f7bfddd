"""Measure what this machine can do, what that predicts for the default model, and what the
engine actually gets; print it and write HARDWARE.md.

Why: a throughput figure means little until it is set against the machine's two roofs,
matrix-product FLOP/s and memory bandwidth. Their ratio (the ridge point) says at what batch
size a decode step stops being limited by reading the weights and starts being limited by
arithmetic; the decode sweep through the real engine then shows how close slotserve gets
and where batching stops paying.

    .venv/bin/python benchmarks/hardware.py [--out HARDWARE.md] [--quick] [--threads N]

Another busy process ruins these numbers (torch's threads spin-wait on each other), so the
script checks the load average first and reports the spread of the step times it measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from replica.engine import Engine, EngineConfig
from replica.model_runner import ModelRunner

MODEL = "smollm2-135m"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LEN = 64
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def machine() -> dict:
    """CPU model, cores, threads, memory: what the numbers below belong to."""
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = next(int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal"))
    flags = Path("/proc/cpuinfo").read_text()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "mem_gib": mem_kb / 2**20,
            "torch": torch.__version__, "python": platform.python_version(), "isa": " ".join(isa)}


def cpu_snapshot() -> tuple[float, float, float]:
    """(CPU seconds busy on the whole machine, CPU seconds of this process, wall time)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = os.times()
    return busy, own.user + own.system, time.monotonic()


def others_share(before: tuple, after: tuple) -> float:
    """Share of the cores other processes kept busy between two snapshots: the load average
    cannot tell, since this script's own threads count in it."""
    busy, own, wall = (a - b for a, b in zip(after, before))
    return max(0.0, busy - own) / (wall * os.cpu_count())


def timed(fn, warmup: int, reps: int) -> list[float]:
    """Seconds per call of fn, after warmup calls (first calls pay for allocation and caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def matmul_flops(dtype: torch.dtype, n_max: int, reps: int) -> tuple[float, float, int]:
    """(best, median) FLOP/s of an n x n matrix product (2 n^3 FLOPs), and n. Without native
    bf16 instructions (AVX-512 BF16, AMX) torch takes a slow path, so n is cut (from n_max
    down to 256) until one product is expected to take under half a second."""
    n = n_max
    probe = min(timed(lambda: torch.matmul(*[torch.ones(256, 256, dtype=dtype)] * 2), 1, 3))
    while n > 256 and probe * (n / 256) ** 3 > 0.5:
        n //= 2
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    times = timed(lambda: torch.matmul(a, b, out=c), 2, reps)
    return 2 * n**3 / min(times), 2 * n**3 / statistics.median(times), n


def copy_bandwidth(nbytes: int, reps: int) -> tuple[float, float]:
    """(best, median) bytes/s of copying a tensor far larger than the caches; read + write counted."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = timed(lambda: dst.copy_(src), 2, reps)
    return 2 * nbytes / min(times), 2 * nbytes / statistics.median(times)


def new_engine(runner: ModelRunner, batch: int, max_tokens: int) -> Engine:
    """An engine holding `batch` requests with distinct 64-token prompts, not yet prefilled."""
    engine = Engine(EngineConfig(policy="mixed", num_slots=batch, max_seq_len=256), runner=runner)
    for i in range(batch):
        prompt = [100 + (7 * i + j) % 5000 for j in range(PROMPT_LEN)]
        engine.add_request(prompt, {"max_tokens": max_tokens, "ignore_eos": True})
    return engine


def decode_steps(runner: ModelRunner, batch: int, max_tokens: int, warmup: int = 2) -> dict:
    """Run `batch` requests to the end; median time of the pure decode steps after `warmup`.
    The first step prefills all prompts together; its time is kept as a prefill figure."""
    engine, times, prefill = new_engine(runner, batch, max_tokens), [], None
    while engine.has_unfinished:
        rec = engine.step().record
        if rec.num_prefill_tokens:
            prefill = (rec.num_prefill_tokens, rec.duration)
        else:
            times.append(rec.duration)
    times = times[warmup:]
    q = statistics.quantiles(times, n=4)
    return {"batch": batch, "step": statistics.median(times), "spread": (q[2] - q[0]) / statistics.median(times),
            "prefill": prefill, "steps": len(times)}


def profile_decode(runner: ModelRunner, batch: int, steps: int) -> tuple[list[tuple[str, float]], float, float]:
    """Top ops by self CPU time per decode step at `batch`, the matrix products' share, and
    the step's wall time under the profiler (which inflates small ops)."""
    from torch.profiler import ProfilerActivity, profile

    engine = new_engine(runner, batch, steps + 4)
    for _ in range(3):  # prefill, then two decodes
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t) / steps
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    mm = sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS)
    top = [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in ops[:6]]
    return top, mm / total, wall


def knee(rows: list[dict]) -> tuple[int, int | None]:
    """(knee, first B whose doubling gained < 1.5x tokens/s). Up to the knee every doubling
    of B gained at least 1.5x tokens/s (nearly linear); the next doubling gained less."""
    for prev, row in zip(rows, rows[1:]):
        if row["tps"] / prev["tps"] < 1.5:
            return prev["batch"], row["batch"]
    return rows[-1]["batch"], None


def render(m: dict, hw: dict, pred: dict, rows: list[dict], prof: dict, args, load: tuple[float, float]) -> str:
    """HARDWARE.md as markdown."""
    g = lambda x: f"{x / 1e9:.0f}"  # noqa: E731
    k, first_slow = knee(rows)
    big = rows[-1]
    pf_tokens, pf_time = big["prefill"]
    lines = [
        "# Hardware: what this machine allows, and what slotserve gets",
        "",
        f"Written by `benchmarks/hardware.py` ({'--quick' if args.quick else 'full run'}). Rerun: "
        "`.venv/bin/python benchmarks/hardware.py [--out HARDWARE.md] [--quick] [--threads N]`.",
        f"Before the run the 1-minute load average was {load[0]:.2f}; during it other processes kept "
        f"{load[1]:.0%} of the cores busy"
        + (" (**disturbed: numbers may be low**)." if load[0] > 1.0 or load[1] > 0.05 else "."),
        "",
        "## This machine",
        "",
        f"- CPU: {m['cpu']} ({m['isa']})",
        f"- cores: {m['cores']} (`os.cpu_count()`); torch threads: {m['threads']} (`torch.get_num_threads()`)",
        f"- memory: {m['mem_gib']:.1f} GiB; torch {m['torch']}, Python {m['python']}",
        "- Threads: torch here uses one thread per core. Inside a Ray actor, Ray sets `OMP_NUM_THREADS` to the "
        "actor's `num_cpus`, so torch uses that many threads (1 at `num_cpus=1`): a replica's speed depends on "
        "what it asks Ray for. `--threads N` reruns this with N threads.",
        "",
        "## Measured roofs (best of several reps; median in brackets)",
        "",
        f"- fp32 matrix product ({hw['fp32'][2]}x{hw['fp32'][2]}): **{g(hw['fp32'][0])} GFLOP/s** ({g(hw['fp32'][1])})",
        f"- bf16 matrix product ({hw['bf16'][2]}x{hw['bf16'][2]}): **{hw['bf16'][0] / 1e9:.1f} GFLOP/s** "
        f"({hw['bf16'][1] / 1e9:.1f})",
        f"- memory copy ({args.copy_mib} MiB, read + write bytes counted): **{hw['bw'][0] / 1e9:.1f} GB/s** "
        f"({hw['bw'][1] / 1e9:.1f})",
        f"- ridge point (fp32 FLOP/s / bytes/s): **{pred['ridge']:.1f} FLOP/byte**; a kernel doing less work per "
        "byte it reads is memory-bound.",
        "",
        "## What they predict for the default model (SmolLM2-135M-Instruct, fp32)",
        "",
        f"- weights per token P = {pred['P'] / 1e6:.1f} M (matrix products incl. the {pred['lm_head'] / 1e6:.1f} M "
        f"lm_head); weight bytes = 4P = {pred['P'] * 4 / 1e6:.0f} MB",
        f"- FLOPs per token = 2P = {2 * pred['P'] / 1e6:.0f} MFLOP (attention adds ~{pred['attn_flops'] / 1e6:.1f} "
        f"MFLOP at context {pred['ctx']}: ignored)",
        "- a decode step at batch B does 2PB FLOP over 4P bytes of weights: intensity **B/2 FLOP/byte**",
        f"- so a decode step turns compute-bound at B ≈ 2 x ridge = **{2 * pred['ridge']:.0f}**",
        f"- compute roof: fp32 FLOP/s / 2P = **{pred['compute_tps']:.0f} tokens/s** at any batch; "
        f"memory roof at batch 1: bandwidth / 4P = **{pred['mem_tps']:.0f} tokens/s** ({1e3 / pred['mem_tps']:.0f} ms/step)",
        f"- the K/V cache adds {pred['kv_per_token'] / 1e3:.0f} KB read per token of context per sequence: "
        f"{pred['ctx'] * 64 * pred['kv_per_token'] / 1e6:.0f} MB per step at B=64, context {pred['ctx']} "
        "(the roofline column below includes it)",
        "",
        "## Decode step time against batch size (the real engine)",
        "",
        f"`Engine(EngineConfig(policy=\"mixed\", num_slots=B))` on one shared `ModelRunner`; B requests with "
        f"{PROMPT_LEN}-token prompts and `ignore_eos`, prefilled together in one step, then median of the "
        f"pure decode steps after 2 warmups (context {PROMPT_LEN + 3}-{PROMPT_LEN + args.max_tokens}). "
        "A step's time is the engine's own record (scheduling, runner, sampling).",
        "",
        "| B | step ms | spread | tokens/s | x prev | GFLOP/s | % fp32 peak | roofline ms | % roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for prev, r in zip([None] + rows, rows):
        gain = f"{r['tps'] / prev['tps']:.2f}" if prev else "-"
        lines.append(
            f"| {r['batch']} | {r['step'] * 1e3:.1f} | {r['spread']:.0%} | {r['tps']:.0f} | {gain} | "
            f"{r['flops'] / 1e9:.1f} | {r['flops'] / hw['fp32'][0]:.0%} | {r['roof'] * 1e3:.1f} | "
            f"{r['roof'] / r['step']:.0%} |")
    lines += [
        "",
        "spread = interquartile range / median of the decode steps; roofline ms = max(2PB / fp32 FLOP/s, "
        "(4P + K/V bytes) / bandwidth); GFLOP/s counts 2P per token.",
        "",
        f"**Knee: B = {k}.** Defined as the largest B up to which every doubling of B still gained at least 1.5x "
        "tokens/s" + (f"; doubling to {first_slow} gained less." if first_slow else "; no doubling measured fell below."),
        f"Prefill for comparison: {pf_tokens} prompt tokens in one step took {pf_time:.2f} s = "
        f"{pf_tokens / pf_time:.0f} tokens/s, {2 * pred['P'] * pf_tokens / pf_time / 1e9:.0f} GFLOP/s.",
        "",
        "## Per-sequence loops",
        "",
        "`replica/attention.py` runs attention per group (one for single-token rows, one for multi-token prefill "
        "chunks), each group one `scaled_dot_product_attention` call over a padded slot range: no per-sequence "
        "Python loop remains in the forward pass.",
    ]
    for batch, (top, mm_share, wall) in prof.items():
        ops = ", ".join(f"`{name}` {ms:.1f}" for name, ms in top)
        lines.append(f"- torch.profiler at B={batch} (step {wall * 1e3:.0f} ms under the profiler): matrix products "
                     f"(`mm`/`addmm`/`bmm`) take {mm_share:.0%} of self CPU time; top ops, ms per step: {ops}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="HARDWARE.md", help="markdown file to write (default: HARDWARE.md)")
    parser.add_argument("--quick", action="store_true", help="fewer reps and decode steps (~1 minute, noisier)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.n, args.copy_mib = 2048, 256
    reps, args.max_tokens = (4, 12) if args.quick else (10, 24)

    load0 = os.getloadavg()[0]
    if load0 > 1.0:
        print(f"WARNING: 1-minute load average is {load0:.2f}: another process may be using the cores")
    snap = cpu_snapshot()
    m = machine()
    print(f"{m['cpu']}: {m['cores']} cores, {m['threads']} torch threads, {m['mem_gib']:.1f} GiB, torch {m['torch']}")
    hw = {"fp32": matmul_flops(torch.float32, args.n, reps), "bf16": matmul_flops(torch.bfloat16, args.n, reps),
          "bw": copy_bandwidth(args.copy_mib * 2**20, 2 * reps)}
    print(f"fp32 {hw['fp32'][0] / 1e9:.0f} GFLOP/s, bf16 {hw['bf16'][0] / 1e9:.0f} GFLOP/s, "
          f"copy {hw['bw'][0] / 1e9:.1f} GB/s")

    runner = ModelRunner(MODEL, num_slots=max(BATCHES), max_seq_len=256)
    s = runner.model.shape
    P, ctx = s.num_params_per_token, PROMPT_LEN + (3 + args.max_tokens) // 2
    pred = {"P": P, "lm_head": s.vocab_size * s.hidden_size, "ridge": hw["fp32"][0] / hw["bw"][0], "ctx": ctx,
            "attn_flops": 4 * s.num_layers * s.num_heads * s.head_dim * ctx,
            "kv_per_token": runner.cache.bytes_per_token,
            "compute_tps": hw["fp32"][0] / (2 * P), "mem_tps": hw["bw"][0] / (4 * P)}
    print(f"P = {P / 1e6:.1f} M weights/token, ridge {pred['ridge']:.1f} FLOP/B, compute-bound from B ~ "
          f"{2 * pred['ridge']:.0f}; roofs: {pred['compute_tps']:.0f} tok/s compute, {pred['mem_tps']:.0f} tok/s at B=1")

    rows = []
    for batch in BATCHES:
        r = decode_steps(runner, batch, args.max_tokens)
        r["tps"], r["flops"] = batch / r["step"], 2 * P * batch / r["step"]
        kv_bytes = batch * ctx * pred["kv_per_token"]
        r["roof"] = max(2 * P * batch / hw["fp32"][0], (4 * P + kv_bytes) / hw["bw"][0])
        rows.append(r)
        print(f"B={batch:3d}: {r['step'] * 1e3:7.1f} ms/step (spread {r['spread']:.0%}), {r['tps']:6.0f} tok/s, "
              f"{r['flops'] / 1e9:5.1f} GFLOP/s, roofline {r['roof'] * 1e3:.1f} ms")
    print(f"knee (last B with >= 1.5x per doubling): {knee(rows)[0]}")

    prof = {}
    for batch in (1, max(BATCHES)):
        prof[batch] = profile_decode(runner, batch, 2 if args.quick else 4)
        print(f"profile B={batch}: mm share {prof[batch][1]:.0%}; " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in prof[batch][0]))

    others = others_share(snap, cpu_snapshot())
    if others > 0.05:
        print(f"WARNING: other processes kept {others:.0%} of the cores busy during the run: numbers may be low")
    noisy = [r["batch"] for r in rows if r["spread"] > 0.2]
    if noisy:
        print(f"WARNING: decode steps noisy (spread > 20%) at B = {noisy}: rerun on a quiet machine")
    Path(args.out).write_text(render(m, hw, pred, rows, prof, args, (load0, others)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
