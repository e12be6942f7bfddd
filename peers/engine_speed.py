# Over 400 lines: each peer's run is a short function, and all run in spawned processes from one plan.
"""`slotserve bench`: slotserve's engine against what a user would run instead, on the
`saturated` workload, in one run on this machine.

Systems, each in a fresh process (so its peak memory is its own):
- slotserve's engine, continuous and chunked policies, at several slot counts;
- transformers' static `generate()` in batches of 8: left padding, each batch runs to its
  longest request; its useful tokens are the requests' own lengths;
- transformers' built-in continuous batching (`init_continuous_batching`, per-request
  `max_new_tokens`) at each setting of HF_CB_GRID, the best taken as the peer;
- one decode step of slotserve and of the plain transformers model ("just call the model",
  DynamicCache) at the same batch sizes, set against the compute roofline in HARDWARE.md;
- bf16 against fp32 on slotserve: speed, and how many requests' greedy outputs agree.

Ratios are within this one run: the machine is noisy, absolute times across runs are not
comparable.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from workloads.standard import saturated
from workloads.workload import request_prompt

# transformers' continuous batching settings tried in every run (the best is the peer):
# small pages waste less of a short request's cache; the token budget bounds a step's work.
# Its K/V cache gets as many tokens as slotserve's largest slot cache (auto-sizing on a CPU
# takes gigabytes of host memory).
HF_CB_GRID = ({"page_size": 16, "max_batch_tokens": 256}, {"page_size": 256, "max_batch_tokens": 1024})
MAX_SEQ_LEN = 64 + 256  # saturated: prompts up to 64 tokens, outputs up to 256
STATIC_BATCH = 8
DECODE_PROMPT_LEN = 64
DECODE_STEPS = 12


@dataclass
class BenchRow:
    system: str  # slotserve | hf-static | hf-continuous | slotserve-decode | hf-decode
    policy: str
    slots: int  # slots, batch size, or max requests in flight
    useful_tokens_per_s: float
    peak_mem_mb: float
    seconds: float = 0.0
    useful_tokens: int = 0
    dtype: str = "float32"
    tag: str = ""  # "bf16": one of the pair of the bf16 comparison
    outputs: list[list[int]] = field(default_factory=list)  # token ids, kept for the bf16 comparison only
    error: str = ""


@dataclass(frozen=True)
class Job:
    """One row's work, run in a fresh process."""

    kind: str  # engine | hf-static | hf-continuous | decode
    model: str
    dtype: str
    device: str
    num_requests: int
    policy: str = ""
    slots: int = 0
    hf: bool = False  # decode: the transformers model instead of slotserve's
    tag: str = ""
    cb_settings: tuple[tuple[str, int], ...] = ()  # hf-continuous: ContinuousBatchingConfig fields


def _workload(num_requests: int, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    w = saturated(num_requests=num_requests)
    return [request_prompt(w.seed, i, r, vocab_size) for i, r in enumerate(w.requests)], w.output_lens


def _peak_mem_mb(device: str) -> float:
    """Peak resident memory of this process (CPU) or peak allocated GPU memory."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine_run(job: Job) -> BenchRow:
    from replica.config import EngineConfig
    from replica.engine import Engine

    config = EngineConfig(
        model=job.model,
        dtype=job.dtype,
        device=job.device,
        policy=job.policy,
        num_slots=job.slots,
        max_seq_len=MAX_SEQ_LEN,
    )
    engine = Engine(config)
    prompts, lens = _workload(job.num_requests, engine.runner.vocab_size)
    params = [{"max_tokens": n, "ignore_eos": True} for n in lens]
    engine.generate(prompts[:2], [{"max_tokens": 2, "ignore_eos": True}] * 2)  # warm-up, not timed
    t = time.perf_counter()
    done = engine.generate(prompts, params)
    _sync(engine.runner.device)
    seconds = time.perf_counter() - t
    useful = sum(len(c.token_ids) for c in done)
    return BenchRow(
        "slotserve",
        job.policy,
        job.slots,
        useful / seconds,
        _peak_mem_mb(engine.runner.device),
        seconds,
        useful,
        job.dtype,
        job.tag,
        [c.token_ids for c in done] if job.tag == "bf16" else [],
    )


def _hf_model(job: Job):

    from replica.model_loader import load_hf_model
    from replica.model_runner import DTYPES, pick_device

    hf, _ = load_hf_model(job.model)
    device = pick_device(job.device)
    return hf.to(device, DTYPES[job.dtype]).eval(), device


def _hf_static(job: Job) -> BenchRow:
    import torch
    from transformers import GenerationConfig

    model, device = _hf_model(job)
    prompts, lens = _workload(job.num_requests, model.config.vocab_size)
    t = time.perf_counter()
    for b in range(0, len(prompts), STATIC_BATCH):
        batch, outs = prompts[b : b + STATIC_BATCH], lens[b : b + STATIC_BATCH]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        config = GenerationConfig(
            max_new_tokens=max(outs), min_new_tokens=max(outs), do_sample=False, eos_token_id=None, pad_token_id=0
        )
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    _sync(device)
    seconds = time.perf_counter() - t
    return BenchRow(
        "hf-static",
        f"generate() batches of {STATIC_BATCH}",
        STATIC_BATCH,
        sum(lens) / seconds,
        _peak_mem_mb(device),
        seconds,
        sum(lens),
        job.dtype,
    )


def _hf_continuous(job: Job) -> BenchRow:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, device = _hf_model(job)
    prompts, lens = _workload(job.num_requests, model.config.vocab_size)
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(lens))
    settings = dict(job.cb_settings)
    settings["num_blocks"] = job.slots * MAX_SEQ_LEN // settings["page_size"]
    t = time.perf_counter()
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**settings)
    )
    manager.start()
    ids = {manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lens)}
    useful = 0
    while ids:
        result = manager.get_result(timeout=10)
        if result is not None and result.is_finished():
            ids.discard(result.request_id)
            useful += len(result.generated_tokens)
    manager.stop(block=True)
    seconds = time.perf_counter() - t
    described = " ".join(f"{k}={v}" for k, v in settings.items())
    return BenchRow(
        "hf-continuous", described, job.num_requests, useful / seconds, _peak_mem_mb(device), seconds, useful, job.dtype
    )


def _decode_step(job: Job) -> BenchRow:
    """Median time of a pure decode step at batch `slots` (64-token prompts, context 64-76)."""
    import torch

    times = []
    if job.hf:
        from transformers import DynamicCache

        model, device = _hf_model(job)
        ids = torch.tensor(
            [[100 + (7 * i + j) % 5000 for j in range(DECODE_PROMPT_LEN)] for i in range(job.slots)], device=device
        )
        with torch.inference_mode():
            cache = DynamicCache()
            nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(DECODE_STEPS):
                t = time.perf_counter()
                nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                _sync(device)
                times.append(time.perf_counter() - t)
    else:
        from replica.config import EngineConfig
        from replica.engine import Engine

        engine = Engine(
            EngineConfig(
                model=job.model,
                dtype=job.dtype,
                device=job.device,
                policy="mixed",
                num_slots=job.slots,
                max_seq_len=DECODE_PROMPT_LEN + DECODE_STEPS + 2,
            )
        )
        device = engine.runner.device
        for i in range(job.slots):
            engine.add_request(
                [100 + (7 * i + j) % 5000 for j in range(DECODE_PROMPT_LEN)],
                {"max_tokens": DECODE_STEPS + 1, "ignore_eos": True},
            )
        engine.step()  # the prefill
        for _ in range(DECODE_STEPS):
            times.append(engine.step().record.duration)  # the step ends with its sampled tokens on the host
    step = statistics.median(times[2:])
    return BenchRow(
        "hf-decode" if job.hf else "slotserve-decode",
        "decode step",
        job.slots,
        job.slots / step,
        _peak_mem_mb(device),
        step,
        job.slots,
        job.dtype,
    )


def run_job(job: Job) -> BenchRow:
    import torch

    torch.manual_seed(0)
    return {"engine": _engine_run, "hf-static": _hf_static, "hf-continuous": _hf_continuous, "decode": _decode_step}[
        job.kind
    ](job)


def hardware_roofline(path: Path) -> float | None:
    """The compute roofline (tokens/s) that benchmarks/hardware.py wrote into HARDWARE.md."""
    if not path.exists():
        return None
    match = re.search(r"compute roof[^*]*\*\*(\d+(?:\.\d+)?) tokens/s\*\*", path.read_text())
    return float(match.group(1)) if match else None


def plan(args: argparse.Namespace) -> list[Job]:
    common = {"model": args.model, "dtype": args.dtype, "device": args.device, "num_requests": args.requests}
    jobs = [Job("engine", policy=p, slots=s, **common) for p in args.policies for s in args.slots]
    if args.peers:
        jobs += [Job("hf-static", **common)]
        jobs += [
            Job("hf-continuous", slots=max(args.slots), cb_settings=tuple(c.items()), **common) for c in HF_CB_GRID
        ]
    for s in args.decode_batches:
        jobs += [Job("decode", slots=s, **common), Job("decode", slots=s, hf=True, **common)]
    if args.bf16:
        pair = {
            **common,
            "num_requests": args.bf16_requests,
            "policy": "continuous",
            "slots": max(args.slots),
            "tag": "bf16",
        }
        jobs += [Job("engine", **{**pair, "dtype": "float32"}), Job("engine", **{**pair, "dtype": "bfloat16"})]
    return jobs


def run(args: argparse.Namespace) -> dict:
    """Every row in turn; a row that fails is kept with its error (a peer's API may differ
    between transformers versions) and the JSON is rewritten after each row, so a run cut
    short still leaves what it measured."""
    rows: list[BenchRow] = []
    # One fresh process per row (spawned, so no torch state is inherited): peak memory is the row's own.
    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        for job in tqdm(plan(args), desc="bench", unit="row"):
            try:
                rows.append(pool.submit(run_job, job).result())
            except Exception as err:  # noqa: BLE001 - reported in the row, the other rows still run
                rows.append(
                    BenchRow(
                        job.kind,
                        job.policy,
                        job.slots,
                        0.0,
                        0.0,
                        dtype=job.dtype,
                        tag=job.tag,
                        error=f"{type(err).__name__}: {err}"[:300],
                    )
                )
            if args.json:
                write_json(summarize(rows, args), args.json)
    return summarize(rows, args)


def write_json(result: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


def _best(rows: list[BenchRow], system: str, dtype: str) -> BenchRow | None:
    found = [r for r in rows if r.system == system and r.dtype == dtype and not r.tag and not r.error]
    return max(found, key=lambda r: r.useful_tokens_per_s) if found else None


def summarize(rows: list[BenchRow], args: argparse.Namespace) -> dict:
    from replica.model_runner import pick_device

    on_cpu = pick_device(args.device) == "cpu"  # HARDWARE.md's roofline is this CPU's
    roofline = args.roofline or (hardware_roofline(Path(args.hardware)) if on_cpu else None)
    pair = [r for r in rows if r.tag == "bf16" and not r.error]
    result: dict = {
        "model": args.model,
        "workload": f"saturated ({args.requests} requests)",
        "roofline_tokens_per_s": roofline,
        "rows": [],
    }
    engine_rows = [r for r in rows if r.system == "slotserve" and not r.tag and not r.error]
    best = max(engine_rows, key=lambda r: r.useful_tokens_per_s) if engine_rows else None
    for r in rows:
        d = asdict(r)
        d.pop("outputs")
        if r.system == "slotserve-decode":
            peer = next((p for p in rows if p.system == "hf-decode" and p.slots == r.slots and not p.error), None)
            d["ratio_to_hf_decode"] = r.useful_tokens_per_s / peer.useful_tokens_per_s if peer else None
            d["pct_of_roofline"] = 100 * r.useful_tokens_per_s / roofline if roofline else None
        result["rows"].append(d)
    if best is not None:
        result["best_slotserve"] = {
            "policy": best.policy,
            "slots": best.slots,
            "useful_tokens_per_s": best.useful_tokens_per_s,
        }
        for peer in ("hf-static", "hf-continuous"):
            if (p := _best(rows, peer, best.dtype)) is not None:
                result[f"ratio_to_{peer}"] = best.useful_tokens_per_s / p.useful_tokens_per_s
    if len(pair) == 2:
        fp32, bf16 = pair
        same = sum(a == b for a, b in zip(fp32.outputs, bf16.outputs))
        result["bf16"] = {
            "speedup_over_fp32": bf16.useful_tokens_per_s / fp32.useful_tokens_per_s,
            "identical_greedy_share": same / len(fp32.outputs),
            "requests": len(fp32.outputs),
        }
    return result


def format_bench(result: dict) -> str:
    lines = [
        f"{result['model']}, {result['workload']}; roofline {result['roofline_tokens_per_s'] or '?'} tokens/s",
        f"{'system':18} {'policy / settings':58} {'slots':>5} {'dtype':>8} {'useful tok/s':>12} "
        f"{'peak MB':>8}  vs peer",
    ]
    for r in result["rows"]:
        note = ""
        if r["system"] == "slotserve-decode":
            ratio, pct = r.get("ratio_to_hf_decode"), r.get("pct_of_roofline")
            note = (f"{ratio:.2f}x hf decode" if ratio else "") + (f", {pct:.0f}% of roofline" if pct else "")
        if r["error"]:
            note = f"FAILED: {r['error']}"
        lines.append(
            f"{r['system']:18} {r['policy']:58} {r['slots']:5d} {r['dtype']:>8} "
            f"{r['useful_tokens_per_s']:12.1f} {r['peak_mem_mb']:8.0f}  {note}"
        )
    if "best_slotserve" in result:
        b = result["best_slotserve"]
        lines.append(
            f"best slotserve: {b['policy']} at {b['slots']} slots, {b['useful_tokens_per_s']:.1f} tok/s"
            + "".join(
                f"; {result[k]:.2f}x {k[9:]}" for k in ("ratio_to_hf-continuous", "ratio_to_hf-static") if k in result
            )
        )
    if "bf16" in result:
        b = result["bf16"]
        lines.append(
            f"bf16 vs fp32 (continuous, {b['requests']} requests): speed {b['speedup_over_fp32']:.2f}x, "
            f"identical greedy outputs {b['identical_greedy_share']:.0%}"
        )
    return "\n".join(lines)
