# Over 400 lines: one probe script (peak FLOP/s, bandwidth, roofline, decode sweep) writing one page.
"""Measure what this machine can do, what that predicts for the default model, and what the
engine actually gets; print it and write HARDWARE.md.

Why: a throughput figure means little until it is set against the machine's two roofs,
matrix-product FLOP/s and memory bandwidth. Their ratio (the ridge point) says at what batch
size a decode step stops being limited by reading the weights and starts being limited by
arithmetic; the decode sweep through the real engine then shows how close slotserve gets
and where batching stops paying.

    .venv/bin/python benchmarks/hardware.py [--out HARDWARE.md] [--quick] [--threads N]

A busy neighbour ruins these numbers (torch's threads wait on each other, and small ops
slow down tenfold), so the script checks the load average first, measures how much CPU
other processes took during the run, and reports the spread of the step times.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from peers.roofline import bandwidth, matmul_flops
from protocol.cpu import cpu_info
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.decoder import Decoder
from replica.model.runner import ModelRunner

MODEL = "smollm2-135m"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROFILED = (1, 64)
PROMPT_LEN = 64
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")


def this_machine() -> dict:
    """CPU model, vector extensions, cores, threads, memory: what the numbers belong to."""
    info = cpu_info()
    mem_kb = next(
        int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")
    )
    return {
        "cpu": info.model,
        "isa": info.shown_flags,
        "fast_bf16": info.fast_bf16,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "mem_gib": mem_kb / 2**20,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def cpu_snapshot() -> tuple[float, float, float]:
    """(CPU seconds busy on the whole machine, CPU seconds of this process, wall seconds)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    own = os.times()
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic()


def others_share(before: tuple, after: tuple) -> float:
    """Share of the cores that other processes kept busy between two snapshots (the load
    average cannot tell: this script's own threads count in it)."""
    busy, own, wall = (a - b for a, b in zip(after, before))
    return max(0.0, busy - own) / (wall * os.cpu_count())


def decode_sweep_point(runner: ModelRunner, batch: int, max_tokens: int, profile_steps: int) -> dict:
    """B requests with distinct 64-token prompts through a fresh engine on the shared runner.
    Step 1 prefills them all; the next max_tokens - 1 steps are pure decodes, of which the
    median after 2 warmups is kept; then `profile_steps` more decodes run under torch.profiler."""
    engine = Engine(EngineConfig(policy="mixed", num_slots=batch, max_seq_len=256), runner=runner)
    for i in range(batch):
        engine.add_request(
            [100 + (7 * i + j) % 5000 for j in range(PROMPT_LEN)],
            {"max_tokens": max_tokens + profile_steps, "ignore_eos": True},
        )
    first = engine.step().record
    assert first.num_prefill_tokens == batch * PROMPT_LEN, first
    records = [engine.step().record for _ in range(max_tokens - 1)]
    assert all(r.num_prefill_tokens == 0 and r.num_decode_tokens == batch for r in records)
    times = [r.duration for r in records[2:]]
    q = statistics.quantiles(times, n=4)
    out = {
        "batch": batch,
        "step": statistics.median(times),
        "spread": (q[2] - q[0]) / statistics.median(times),
        "prefill": (first.num_prefill_tokens, first.duration),
    }
    if profile_steps:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profile_steps):
                engine.step()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        mm = sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS)  # microseconds
        out["mm_ms"], out["mm_share"] = mm / 1e3 / profile_steps, mm / total
        out["top_ops"] = [(e.key, e.self_cpu_time_total / 1e3 / profile_steps) for e in ops[:5]]
    assert not engine.has_unfinished
    return out


def in_turns(variants: dict, reps: int) -> dict[str, float]:
    """Median seconds of each variant's call, taken in turns (a, b, a, b, ...) so a
    neighbour's burst hits both alike; the first round only warms up."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(reps + 1):
        for name, call in variants.items():
            t = time.perf_counter()
            call()
            if round_:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def _with(switch, step):
    """A call that switches a variant on, then runs the step (the switch costs microseconds)."""
    return lambda: (switch(), step())


def _use(runner: ModelRunner, model: Decoder):
    """A switch that puts `model` (a variant of the runner's own, same weights) on the runner."""
    return lambda: setattr(runner, "model", model)


def decode_engine(runner: ModelRunner, batch: int, steps: int, scattered: bool = False) -> Engine:
    """An engine on `runner` with `batch` requests decoding (prefilled already); `scattered`: they
    hold slots spread over the runner's whole cache, as the last requests of a big batch do."""
    slots = runner.cache.num_slots if scattered else batch
    engine = Engine(EngineConfig(policy="mixed", num_slots=slots, max_seq_len=256), runner=runner)
    ids = [
        engine.add_request(
            [100 + (7 * i + j) % 5000 for j in range(PROMPT_LEN)], {"max_tokens": steps, "ignore_eos": True}
        )
        for i in range(slots)
    ]
    engine.step()
    for rid in set(ids) - set(ids[:: slots // batch][:batch]):
        engine.abort(rid)
    return engine


def drain(engine: Engine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()


def switched(runner: ModelRunner, reps: int, steps: int, what: str, without: Decoder, cases) -> list[dict]:
    """Decode steps on `without` (the runner's model built with one option off) and on the
    runner's own model ("with"), in turns, for each (batch, scattered) case; the runner keeps its
    own model after."""
    own, rows = runner.model, []
    for batch, scattered in cases:
        engine = decode_engine(runner, batch, steps, scattered=scattered)
        t = in_turns(
            {"off": _with(_use(runner, without), engine.step), "on": _with(_use(runner, own), engine.step)}, reps
        )
        runner.model = own
        where = f"B={batch} in {runner.cache.num_slots} slots" if scattered else f"B={batch}"
        rows.append({"what": f"{what} (decode step, {where})", "without": t["off"], "with": t["on"]})
        drain(engine)
    return rows


def two_runners(without: ModelRunner, with_: ModelRunner, reps: int, steps: int, what: str, cases) -> list[dict]:
    """Decode steps on one runner ("without") and on another built with one option more ("with"),
    in turns, for each (batch, scattered) case."""
    rows = []
    for batch, scattered in cases:
        a, b = decode_engine(without, batch, steps, scattered), decode_engine(with_, batch, steps, scattered)
        t = in_turns({"without": a.step, "with": b.step}, reps)
        where = f"B={batch} in {without.cache.num_slots} slots" if scattered else f"B={batch}"
        rows.append({"what": f"{what} (decode step, {where})", **t})
        drain(a), drain(b)
    return rows


# The Decoder's C++ kernel options, what their rows say, and the (batch, scattered) cases measured.
KERNEL_OPTIONS = (
    ("decode_kernel", "C++ decode attention kernel instead of SDPA", ((8, False), (64, False), (16, True))),
    ("fused_ops", "per-layer C++ kernels instead of torch's operators", ((1, False), (8, False), (64, False))),
)


def kernels(runner: ModelRunner, hf, reps: int, steps: int) -> list[dict]:
    """Each C++ kernel against torch's operators, on a decoder built with that option off: the
    decode attention kernel against SDPA for contiguous and scattered groups, the per-layer
    kernels (RMSNorm, RoPE with the cache write, SiLU times up; `replica.kernels.fused_ops`);
    none for a kernel not built here."""
    rows = []
    for option, what, cases in KERNEL_OPTIONS:
        if getattr(runner.model, option):  # asked for and built here
            without = Decoder.from_hf(hf, runner.model.dtype, "cpu", **{option: False})
            rows += switched(runner, reps, steps, what, without, cases)
    return rows


def optimisations(runner: ModelRunner, reps: int) -> list[dict]:
    """What each optimisation of the forward pass buys, each measured against its absence in
    one run, in turns: bf16 against fp32 weights (where the CPU has bf16 units), prepacked oneDNN
    matrices, weight-only int8 in the small-batch tail, attention over only the slots a
    scattered decode group holds, torch's thread count (decode steps of the real engine), fused
    QKV and gate/up projections, one batched attention call against a loop over sequences, the
    C++ decode attention kernel against SDPA, the per-layer C++ kernels against torch's operators."""
    from replica.model.attention import AttentionMetadata, build_group, slot_attention
    from replica.model.linear import Linear
    from replica.model.loader import load_hf_model

    rows, steps = [], 4 * reps + 10
    hf, dtype = load_hf_model(MODEL)[0], runner.model.dtype
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    if dtype == torch.bfloat16:
        fp32 = ModelRunner(EngineConfig(model=MODEL, dtype="float32", num_slots=64, max_seq_len=256))
        rows += two_runners(
            fp32, runner, reps, steps, "bf16 weights instead of fp32", ((1, False), (8, False), (64, False))
        )
        del fp32
    # oneDNN's packed product against MKL's plain one, the skinny kernel off on both arms
    plain = Decoder.from_hf(hf, dtype, "cpu", pack_weights=False, skinny_matmul=False)
    onednn = Decoder.from_hf(hf, dtype, "cpu", skinny_matmul=False)
    int8 = Decoder.from_hf(hf, dtype, "cpu", int8_rows=64, measure_int8=False)  # int8 at every batch measured
    packed = runner.model
    for batch in (1, 8, 64):
        engine = decode_engine(runner, batch, steps)
        t = in_turns(
            {"plain": _with(_use(runner, plain), engine.step), "packed": _with(_use(runner, onednn), engine.step)}, reps
        )
        rows.append(
            {
                "what": f"prepacked oneDNN {name} matrices (decode step, B={batch})",
                "without": t["plain"],
                "with": t["packed"],
            }
        )
        runner.model = packed
        if batch == 64 and (threads := torch.get_num_threads()) > 1:
            t = in_turns(
                {
                    "1": _with(lambda: torch.set_num_threads(1), engine.step),
                    "n": _with(lambda: torch.set_num_threads(threads), engine.step),
                },
                reps,
            )
            rows.append(
                {"what": f"{threads} torch threads instead of 1 (decode step, B=64)", "without": t["1"], "with": t["n"]}
            )
            torch.set_num_threads(threads)
        drain(engine)
    for batch in (1, 4, 8, 16):
        engine = decode_engine(runner, batch, steps)
        t = in_turns(
            {"dense": _with(_use(runner, packed), engine.step), "int8": _with(_use(runner, int8), engine.step)}, reps
        )
        rows.append(
            {"what": f"weight-only int8 copies (decode step, B={batch})", "without": t["dense"], "with": t["int8"]}
        )
        runner.model = packed
        drain(engine)
    rows += kernels(runner, hf, reps, steps)
    # SDPA's layouts (the decode kernel needs none), on a runner that never gathers and on one that does
    sdpa = EngineConfig(model=MODEL, dtype=runner.dtype, num_slots=64, max_seq_len=256, decode_kernel=False)
    rows += two_runners(
        ModelRunner(sdpa, gather_spread=10**9),
        ModelRunner(sdpa),
        reps,
        steps,
        "attention over the held slots only, not their range",
        ((4, True), (16, True)),
    )
    s = runner.model.shape
    x = torch.randn(64, s.hidden_size)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for what, outs in (("QKV", (q, kv, kv)), ("gate/up", (s.intermediate_size, s.intermediate_size))):
        parts = [Linear(torch.randn(n, s.hidden_size)) for n in outs]
        fused = Linear(torch.randn(sum(outs), s.hidden_size))
        t = in_turns({"separate": lambda: [p(x) for p in parts], "fused": lambda: fused(x)}, reps * 4)
        rows.append(
            {
                "what": f"fused {what} projection (one layer, 64 rows, fp32)",
                "without": t["separate"],
                "with": t["fused"],
            }
        )
    # Attention at B=64, context 100: one SDPA call over the padded slot range, or one per sequence.
    kc, vc = (torch.randn(64, s.num_kv_heads, 256, s.head_dim) for _ in range(2))
    qs = torch.randn(64, s.num_heads, s.head_dim)
    q_per_kv = s.num_heads // s.num_kv_heads
    positions = [60 + (7 * i) % 80 for i in range(64)]
    meta = AttentionMetadata(
        torch.arange(64),
        [build_group(list(range(64)), list(range(64)), [0] * 64, positions, q_per_kv, "cpu")],
        q_per_kv,
    )

    def per_sequence():
        for i, p in enumerate(positions):
            qi = qs[i].view(s.num_kv_heads, q_per_kv, s.head_dim)
            torch.nn.functional.scaled_dot_product_attention(qi, kc[i, :, : p + 1], vc[i, :, : p + 1])

    t = in_turns(
        {"loop": per_sequence, "batched": lambda: slot_attention(qs, kc, vc, meta, decode_kernel=False)}, reps * 4
    )
    rows.append(
        {
            "what": "batched attention, one call per group (one layer, B=64, context 60-140)",
            "without": t["loop"],
            "with": t["batched"],
        }
    )
    return rows


def knee(rows: list[dict]) -> tuple[int, int | None]:
    """(knee, the B after it). Counted from B=2 (see render): up to the knee every doubling
    of B gained at least 1.5x tokens/s, i.e. grew nearly linearly; the next one gained less."""
    for prev, row in zip(rows[1:], rows[2:]):
        if row["tps"] / prev["tps"] < 1.5:
            return prev["batch"], row["batch"]
    return rows[-1]["batch"], None


def render(m: dict, hw: dict, pred: dict, rows: list[dict], opts: list[dict], args, load: float, others: float) -> str:
    """HARDWARE.md as markdown."""
    fp32, bf16, bw = hw["fp32"], hw["bf16"], hw["bw"]
    dt, nb, peak = pred["dt"], pred["nb"], pred["peak"]
    k, after = knee(rows)
    close = [r["batch"] for p, r in zip(rows[1:], rows[2:]) if abs(r["tps"] / p["tps"] - 1.5) < 0.15]
    pf_tokens, pf_time = rows[-1]["prefill"]
    no_bf16 = not {"avx512_bf16", "amx_bf16"} & set(m["isa"].split())
    lines = [
        "# Hardware: what this machine allows, and what slotserve gets",
        "",
        f"Written by `benchmarks/hardware.py`{' --quick' if args.quick else ''}. Rerun: "
        "`.venv/bin/python benchmarks/hardware.py [--out HARDWARE.md] [--quick] [--threads N]` (~5 minutes).",
        f"Before the run the 1-minute load average was {load:.2f}; during it other processes kept {others:.0%} "
        "of the cores busy" + (" (**disturbed: numbers may be low**)." if others > 0.05 else "."),
        "",
        "## This machine",
        "",
        "Every figure on this page belongs to the CPU named here. Machines of this kind differ (AVX2-only EPYCs "
        "and AVX-512 ones with AVX512_BF16 both occur); on another one, rerun this script. `slotserve bench` "
        "does not read this page: it probes the roofs of the machine it runs on.",
        "",
        f"- CPU: {m['cpu']}; vector extensions: {m['isa']}",
        f"- cores: {m['cores']} (`os.cpu_count()`); torch threads: {m['threads']} (`torch.get_num_threads()`)",
        f"- memory: {m['mem_gib']:.1f} GiB; torch {m['torch']}, Python {m['python']}",
        "- threads: in a plain process torch uses one thread per core. Inside a Ray actor, Ray sets "
        "`OMP_NUM_THREADS` to the actor's `num_cpus`, so torch uses that many threads (1 at `num_cpus=1`): a "
        "replica's speed depends on what it asks Ray for. `--threads N` reruns all of this with N threads.",
        "",
        "## Measured roofs (best of several reps; median in brackets)",
        "",
        f"- fp32 matrix product ({fp32[2]}x{fp32[2]}): **{fp32[0] / 1e9:.0f} GFLOP/s** ({fp32[1] / 1e9:.0f})",
        f"- bf16 matrix product ({bf16[2]}x{bf16[2]}): **{bf16[0] / 1e9:.1f} GFLOP/s** ({bf16[1] / 1e9:.1f})"
        + (
            ': no AVX-512 BF16 / AMX here, so bf16 takes a slow path; use `dtype="float32"` on this machine'
            if no_bf16
            else ""
        ),
        f"- memory, {args.mib} MiB: copy **{bw['copy'] / 1e9:.1f} GB/s** (read + write bytes counted), "
        f"read-only (sum) {bw['read'] / 1e9:.1f} GB/s",
        f"- ridge point = {dt} FLOP/s / copy bytes/s = **{pred['ridge']:.1f} FLOP/byte**: work doing fewer FLOPs "
        "per byte it moves is memory-bound",
        "",
        f"## What they predict for the default model (SmolLM2-135M-Instruct, {dt}: the dtype `auto` picks here)",
        "",
        f"- weights per token P = {pred['P'] / 1e6:.1f} M (all matrix products, "
        f"incl. the {pred['lm_head'] / 1e6:.1f} M lm_head); weight bytes {nb}P = {nb * pred['P'] / 1e6:.0f} MB",
        f"- FLOPs per token 2P = {2 * pred['P'] / 1e6:.0f} MFLOP (attention adds {pred['attn_flops'] / 1e6:.1f} "
        f"MFLOP at context {pred['ctx']}: ignored)",
        f"- a decode step at batch B does 2PB FLOP while reading {nb}P bytes of weights: intensity "
        f"**{2 / nb:g}B FLOP/byte**, so "
        f"it turns compute-bound at B = ridge x {nb / 2:g} = **{pred['ridge'] * nb / 2:.0f}**",
        f"- best decode rate: compute roof {dt} FLOP/s / 2P = **{pred['compute_tps']:.0f} tokens/s** (any batch); "
        f"at batch 1 the memory roof copy bandwidth / {nb}P = **{pred['mem_tps']:.0f} tokens/s** "
        f"({nb * 1e3 * pred['P'] / bw['copy']:.1f} ms per step)",
        f"- the K/V cache adds {pred['kv_per_token'] / 1e3:.0f} KB read per sequence per token of context "
        f"({64 * pred['ctx'] * pred['kv_per_token'] / 1e6:.0f} MB per step at B=64, context {pred['ctx']})",
        "",
        "## Decode step time against batch size (the real engine)",
        "",
        f'`Engine(EngineConfig(policy="mixed", num_slots=B), runner=...)` on one shared 64-slot `ModelRunner`: B '
        f"requests with distinct {PROMPT_LEN}-token prompts and `ignore_eos`, prefilled together in the first step; "
        f"median of the {args.max_tokens - 3} pure decode steps after 2 warmups (context {PROMPT_LEN + 3}-"
        f"{PROMPT_LEN + args.max_tokens - 1}). A step's time is the engine's own record: scheduling, the forward "
        "pass and sampling.",
        "",
        f"| B | step ms | spread | tokens/s | x prev | GFLOP/s | % {dt} peak | roofline ms | % of roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for prev, r in zip([None] + rows, rows):
        lines.append(
            f"| {r['batch']} | {r['step'] * 1e3:.1f} | {r['spread']:.0%} | {r['tps']:.0f} | "
            + (f"{r['tps'] / prev['tps']:.2f}" if prev else "-")
            + f" | {r['flops'] / 1e9:.1f} | {r['flops'] / peak[0]:.0%} | {r['roof'] * 1e3:.1f} | "
            f"{r['roof'] / r['step']:.0%} |"
        )
    lines += [
        "",
        "spread = interquartile range / median of the decode steps. GFLOP/s counts 2P per token. roofline ms = "
        f"max(2PB / {dt} FLOP/s, ({nb}P + K/V bytes) / copy bandwidth), the fastest the step could be.",
        "",
        f"**Knee: B = {k}.** Definition: counting from B=2, the largest B up to which every doubling of B still gained "
        "at least 1.5x tokens/s (nearly linear growth)"
        + (
            f"; doubling to {after} gained {rows[BATCHES.index(after)]['tps'] / rows[BATCHES.index(k)]['tps']:.2f}x."
            if after
            else "; no doubling measured fell below."
        )
        + f" B=1 is left out of the count: going from 1 to 2 gained {rows[1]['tps'] / rows[0]['tps']:.2f}x."
        + (
            f" Doublings to B = {', '.join(map(str, close))} gained within 10% of 1.5x: given the noise above, the "
            "knee can move by a doubling between runs."
            if close
            else ""
        ),
        f"Prefill for comparison: {pf_tokens} prompt tokens in one step took {pf_time:.2f} s = "
        f"{pf_tokens / pf_time:.0f} tokens/s = {2 * pred['P'] * pf_tokens / pf_time / 1e9:.0f} GFLOP/s.",
        "",
        "## Per-sequence loops",
        "",
        "`replica/model/attention.py` runs attention per group (one for single-token rows, one for multi-token prefill "
        "chunks). Single-token rows go through one call of the C++ decode kernel "
        "(`replica/kernels/decode_attention.py`), "
        "which reads each row's own slot up to its own position; prefill chunks (and decode rows where the kernel "
        "is not built) through one `scaled_dot_product_attention` call up to the group's longest live position "
        "(over the slot range, or, where the group's slots are scattered, over those slots only): no per-sequence "
        "Python loop remains in the forward pass. Where a decode step's time goes (torch.profiler, self CPU time; "
        "the C++ kernels are not torch operators, so the profiler does not see them and the shares below are of "
        "the time it sees):",
        "",
    ]
    for r in rows:
        if "top_ops" in r:
            ops = ", ".join(f"`{name}` {ms:.1f}" for name, ms in r["top_ops"])
            mm_s = r["mm_ms"] / 1e3
            lines.append(
                f"- B={r['batch']}: matrix products (`mm`, `addmm`, `bmm`, `_linear_pointwise`) "
                f"{r['mm_share']:.0%}, in which the "
                f"weights stream at {nb * pred['P'] / mm_s / 1e9:.1f} GB/s and the arithmetic runs at "
                f"{2 * pred['P'] * r['batch'] / mm_s / 1e9:.0f} GFLOP/s; top ops, ms per step: {ops}"
            )
    lines += [
        "",
        "## Where a step's time goes, by part",
        "",
        "`benchmarks/step_profile.py` splits one engine step, per dtype and step size (decode at B = 1, 8, 64; a "
        "prefill of four 64-token prompts), into matrix products, attention, the per-layer C++ kernels, the rest of "
        "the forward pass, step metadata, sampling, the scheduler and the engine's bookkeeping (wrappers around "
        "each, summed per step, the wrappers' own cost taken off: `peers/step_parts.py`), and counts the torch "
        "operators and Python calls a step makes (a `TorchDispatchMode`, `sys.setprofile`), which do not move "
        "with a neighbour's load as times do; it also names the oneDNN implementation every matrix product took "
        "(oneDNN's verbose log for one step). Host time is the step less its matrix products and attention. "
        "`slotserve bench` prints the same host figures from the same measurement, for its decode steps "
        "(`--decode-batches`, default 1 8 64) and one such prefill step, per dtype (a `host overhead per step` "
        "block; `host_overhead` in its JSON). Run: `.venv/bin/python -m benchmarks.step_profile [--dtypes "
        "float32 bfloat16] [--batches 1 8 64] [--json PATH]`.",
        "",
        "## What each optimisation bought",
        "",
        "Each measured against its absence in the same run, in turns (median of several; `optimisations()` in "
        '`benchmarks/hardware.py`). In the default engine: bf16 weights where `dtype="auto"` picks them (a '
        "CPU with AVX512_BF16 or AMX), prepacked matrices, attention over held slots only, fused projections, "
        "batched attention, the C++ decode attention kernel, the per-layer C++ kernels, all threads. "
        "Weight-only int8 is opt-in (`EngineConfig(int8_rows=N)`, `slotserve bench --int8-rows N`): it "
        "changes outputs (the bench reports its greedy agreement) and pays where a step reads its "
        "weights for few rows (the table says up to which batch); N is a bound, and each weight shape's int8 "
        "copy serves only up to the row count where it was measured faster than the dense paths on the "
        "machine at hand (`replica.model.linear.crossover`, cached in "
        "`~/.cache/slotserve/crossover.json`; the rows below force int8 at every batch). Dense steps of a "
        "few rows take the skinny kernel (`replica/kernels/skinny_matmul.py`: a plain row-major copy of the "
        "weights read once for all the step's rows, fp32 FMAs or AVX512_BF16 dot products, fp32 sums), up to "
        "the row count measured faster than oneDNN's packed product by the same crossover; larger steps, and "
        "every step on a weight where it never pays, take the packed product. The plain copies cost about "
        "those weights' bytes again beside the packed ones (`EngineConfig(skinny_matmul=False)`: none kept, "
        "the packed product at every step).",
        "",
        "| optimisation | without ms | with ms | speedup |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {o['what']} | {o['without'] * 1e3:.2f} | {o['with'] * 1e3:.2f} | {o['without'] / o['with']:.2f}x |"
        for o in opts
    ]
    lines += [
        "",
        ("bf16: no AVX-512 BF16 or AMX here (see the roofs above), so `auto` keeps fp32. " if no_bf16 else "")
        + "Not kept: `torch.compile` of the decode step. One layer's block compiled once with dynamic rows and "
        "the prepacked weights as inputs (so 30 layers share a graph) fails: inductor's oneDNN linear "
        "lowering asserts the packed weight is a frozen constant (torch 2.13). With the prepacked products "
        "hidden from inductor in a custom op (measured in turns against eager, bf16, before the decode "
        "kernel, on a loaded machine): the pointwise regions (norms, RoPE with the K/V write and attention, "
        "SiLU) compiled with dynamic shapes and called four times a layer, or one compiled layer called 30 "
        "times, gained 1.0-1.05x at B=4 (dynamo's guard and wrapper cost, tens of microseconds a call, ate "
        "what fusion saved); the whole decode forward as one graph ran B=4 steps 1.38x and B=64 steps 1.20x "
        "faster but took 176 s to compile cold on these two cores and 35 s to start with inductor's cache "
        "warm, plus one more graph for batch 1: too slow a start for the default engine, not built in. A "
        "decode attention written for inductor ran 0.9-1.15x SDPA (the C++ kernel replaced it); the per-layer "
        "C++ kernels above do its fusion without a compile. Residual adds fused into the packed products' "
        "epilogue (`_linear_pointwise.binary`): 2-5% per product and within the noise per decode step when "
        "measured alone (0.98x at B=1, 1.03x at B=64, AVX-512 machine); in since the per-layer kernels, as "
        "part of taking the small operators off the step (not measured apart on this machine). Not tried: "
        "thread pinning (torch's OpenMP threads already run one per core).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="HARDWARE.md", help="markdown file to write (default: HARDWARE.md)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and decode steps (noisier)")
    parser.add_argument(
        "--threads", type=int, help="torch.set_num_threads(N) first, e.g. to match a Ray actor's num_cpus"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.mib = 256
    reps, args.max_tokens, profile_steps = (4, 10, 2) if args.quick else (15, 24, 4)

    load = os.getloadavg()[0]
    if load > 1.0:
        print(f"WARNING: 1-minute load average is {load:.2f}: another process may be using the cores")
    snap = cpu_snapshot()
    m = this_machine()
    print(
        f"{m['cpu']} ({m['isa']}): {m['cores']} cores, {m['threads']} torch threads, {m['mem_gib']:.1f} GiB, "
        f"torch {m['torch']}"
    )
    hw = {
        "fp32": matmul_flops(torch.float32, 2048, reps),
        "bf16": matmul_flops(torch.bfloat16, 2048, reps),
        "bw": bandwidth(args.mib * 2**20, 2 * reps),
    }
    print(
        f"fp32 {hw['fp32'][0] / 1e9:.0f} GFLOP/s, bf16 {hw['bf16'][0] / 1e9:.1f} GFLOP/s, "
        f"copy {hw['bw']['copy'] / 1e9:.1f} GB/s, read {hw['bw']['read'] / 1e9:.1f} GB/s"
    )

    runner = ModelRunner(EngineConfig(model=MODEL, num_slots=max(BATCHES), max_seq_len=256))  # dtype "auto"
    s, P = runner.model.shape, runner.model.shape.num_params_per_token
    dt, nb = ("bf16", 2) if runner.dtype == "bfloat16" else ("fp32", 4)
    peak = hw[dt]
    print(f"dtype auto -> {runner.dtype}")
    ctx = PROMPT_LEN + args.max_tokens // 2
    pred = {
        "P": P,
        "lm_head": s.vocab_size * s.hidden_size,
        "ctx": ctx,
        "kv_per_token": runner.cache.bytes_per_token,
        "attn_flops": 4 * s.num_layers * s.num_heads * s.head_dim * ctx,
        "dt": dt,
        "nb": nb,
        "peak": peak,
        "ridge": peak[0] / hw["bw"]["copy"],
        "compute_tps": peak[0] / (2 * P),
        "mem_tps": hw["bw"]["copy"] / (nb * P),
    }
    print(
        f"P = {P / 1e6:.1f} M weights per token; ridge {pred['ridge']:.1f} FLOP/byte, so decode is compute-bound "
        f"from B ~ {2 * pred['ridge']:.0f}; roofs {pred['compute_tps']:.0f} tok/s (compute), "
        f"{pred['mem_tps']:.0f} tok/s (memory, B=1)"
    )

    rows = []
    for batch in BATCHES:
        r = decode_sweep_point(runner, batch, args.max_tokens, profile_steps if batch in PROFILED else 0)
        r["tps"], r["flops"] = batch / r["step"], 2 * P * batch / r["step"]
        r["roof"] = max(2 * P * batch / peak[0], (nb * P + batch * ctx * pred["kv_per_token"]) / hw["bw"]["copy"])
        rows.append(r)
        print(
            f"B={batch:3d}: {r['step'] * 1e3:7.1f} ms/step (spread {r['spread']:.0%}), {r['tps']:5.0f} tok/s, "
            f"{r['flops'] / 1e9:5.1f} GFLOP/s, roofline {r['roof'] * 1e3:.1f} ms"
            + (f"; matrix products {r['mm_share']:.0%} of profiled CPU time" if "mm_share" in r else "")
        )
    print(f"knee: B = {knee(rows)[0]}")
    opts = optimisations(runner, reps=4 if args.quick else 8)
    for o in opts:
        print(f"{o['what']}: {o['without'] * 1e3:.2f} -> {o['with'] * 1e3:.2f} ms ({o['without'] / o['with']:.2f}x)")

    others = others_share(snap, cpu_snapshot())
    if others > 0.05:
        print(f"WARNING: other processes kept {others:.0%} of the cores busy during the run: numbers may be low")
    if noisy := [r["batch"] for r in rows if r["spread"] > 0.2]:
        print(f"WARNING: decode step times spread > 20% at B = {noisy}: consider rerunning on a quiet machine")
    Path(args.out).write_text(render(m, hw, pred, rows, opts, args, load, others))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
