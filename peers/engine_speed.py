# Over 400 lines: each system's run is a short function, and all run in spawned processes from one plan.
"""`slotserve bench`: slotserve's engine against what a user would run instead, on the
`saturated` workload (the same prompt token ids and per-request max_tokens for every system,
greedy, EOS ignored), in one run on this machine.

It first prints the CPU's model and flags and probes this machine's roofs (matrix-product
FLOP/s in fp32 and bf16, memory bandwidth; ~10 s), and probes them again at the end: every
"% of roofline" is against the higher of the two probes.

Systems, each in a fresh process (so its peak memory is its own):
- slotserve's engine, each policy at each slot count and each dtype (fp32, and bf16 where the
  machine has bf16 matrix units or a GPU; with `--int8-rows N` also `auto`'s dtype with int8
  weights for steps of at most N rows);
- vLLM's CPU engine (`make peers`), thread binding `auto` and all cores, each at bf16 and fp32;
- transformers' static `generate()` in batches of 8 (left padding, each batch runs to its
  longest request; its useful tokens are the requests' own lengths);
- transformers' continuous batching (`init_continuous_batching`, per-request max_new_tokens) at
  each setting of HF_CB_GRID and each dtype;
- single-stream decode (one request alone, batch 1): tokens/s of slotserve, vLLM and
  transformers, each from two generation lengths (prefill and call overhead cancel);
- one decode step of slotserve and of the plain transformers model ("just call the model",
  DynamicCache) at the same batch sizes and dtypes, against the compute roofline, and one
  prefill step of slotserve (four 64-token prompts, one `chunked` token budget) per dtype;
  for each of slotserve's steps on a CPU, where its time goes (`peers.step_parts`, the measurement
  `benchmarks/step_profile.py` prints in full): the host share is the step's time outside
  matrix products and attention.

Summaries: slotserve's best overall; its best lossless setting (no int8 copies, at the dtype
of vLLM's best: outputs are its own run's at that dtype, as vLLM's are) apart from its best
with int8 copies, each against vLLM's best and vLLM's best fp32.

Ratios are within this one run: the machine is noisy, absolute times across runs are not
comparable. Greedy agreement: for each slotserve setting, the share of requests whose tokens
equal the fp32 run's at the same policy and slots (and vLLM's against slotserve's fp32).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import resource
import statistics
import time
from collections.abc import Iterator
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
PROFILE_STEPS = 6  # decode steps after the timed ones, measured by part (`peers.step_parts`)
PREFILL_PROMPTS = 4  # the prefill step: one `chunked` token budget (256) of 64-token prompts
PREFILL_REPS = 5
# Single-stream decode: one 64-token prompt generated to both lengths; tokens/s = 96 / dt.
DECODE1_LENS = (32, 128)
DECODE1_REPEATS = 3


@dataclass
class BenchRow:
    # slotserve | vllm | hf-static | hf-continuous | decode1 | slotserve-decode | hf-decode | slotserve-prefill
    system: str
    policy: str  # policy or settings, in words
    slots: int  # slots, batch size, or max requests in flight
    useful_tokens_per_s: float
    peak_mem_mb: float
    seconds: float = 0.0
    useful_tokens: int = 0
    dtype: str = "float32"
    weights: str = ""  # "int8<=N": weight-only int8 for steps of at most N rows
    engine: str = ""  # decode1: which system (slotserve, vllm, transformers)
    outputs: list[list[int]] = field(default_factory=list)  # greedy token ids, for the agreement
    parts: dict[str, float] = field(default_factory=dict)  # slotserve's steps: seconds per step by part, "host"
    error: str = ""

    @property
    def variant(self) -> str:
        return self.dtype + (f"+{self.weights}" if self.weights else "")


@dataclass(frozen=True)
class Job:
    """One row's work (two for vLLM), run in a fresh process."""

    kind: str  # engine | vllm | hf-static | hf-continuous | decode | decode1 | prefill
    model: str
    dtype: str
    device: str
    num_requests: int
    policy: str = ""
    slots: int = 0
    hf: bool = False  # decode, decode1: the transformers model instead of slotserve's
    int8_rows: int = 0
    binding: str = ""  # vllm: auto | all
    cb_settings: tuple[tuple[str, int], ...] = ()  # hf-continuous: ContinuousBatchingConfig fields


def _workload(num_requests: int, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    w = saturated(num_requests=num_requests)
    return [request_prompt(w.seed, i, r, vocab_size) for i, r in enumerate(w.requests)], w.output_lens


def _decode_prompt(i: int = 0) -> list[int]:
    return [100 + (7 * i + j) % 5000 for j in range(DECODE_PROMPT_LEN)]


def _peak_mem_mb(device: str, children: bool = False) -> float:
    """Peak resident memory of this process (or its largest child) or peak allocated GPU memory."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine(job: Job, slots: int, max_seq_len: int, policy: str):
    from replica.config import EngineConfig
    from replica.engine import Engine

    return Engine(
        EngineConfig(
            model=job.model,
            dtype=job.dtype,
            device=job.device,
            policy=policy,
            num_slots=slots,
            max_seq_len=max_seq_len,
            int8_rows=job.int8_rows,
        )
    )


def _weights(job: Job) -> str:
    return f"int8<={job.int8_rows}" if job.int8_rows else ""


def _engine_run(job: Job) -> list[BenchRow]:
    engine = _engine(job, job.slots, MAX_SEQ_LEN, job.policy)
    prompts, lens = _workload(job.num_requests, engine.runner.vocab_size)
    params = [{"max_tokens": n, "ignore_eos": True} for n in lens]
    engine.generate(prompts[:2], [{"max_tokens": 2, "ignore_eos": True}] * 2)  # warm-up, not timed
    t = time.perf_counter()
    done = engine.generate(prompts, params)
    _sync(engine.runner.device)
    seconds = time.perf_counter() - t
    useful = sum(len(c.token_ids) for c in done)
    row = BenchRow(
        "slotserve", job.policy, job.slots, useful / seconds, _peak_mem_mb(engine.runner.device), seconds, useful
    )
    row.dtype, row.weights, row.outputs = engine.runner.dtype, _weights(job), [c.token_ids for c in done]
    return [row]


def _decode1(job: Job) -> list[BenchRow]:
    """Single-stream decode: the best time of each of two generation lengths, tokens/s from the difference."""
    import torch

    prompt, (short, long) = _decode_prompt(), DECODE1_LENS
    if job.hf:
        from transformers import GenerationConfig

        model, device, dtype = _hf_model(job)
        ids = torch.tensor([prompt], device=device)

        def gen(n: int) -> None:
            config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            _sync(device)

        name = "transformers"
    else:
        engine = _engine(job, 1, DECODE_PROMPT_LEN + long + 1, "chunked")
        device, dtype = engine.runner.device, engine.runner.dtype
        gen = lambda n: engine.generate([prompt], {"max_tokens": n, "ignore_eos": True})
        name = "slotserve"
    gen(4)  # warm-up
    best = {}
    for n in (short, long) * DECODE1_REPEATS:
        t = time.perf_counter()
        gen(n)
        best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
    tpot = (best[long] - best[short]) / (long - short)
    row = BenchRow("decode1", "one request alone (batch 1)", 1, 1 / tpot, _peak_mem_mb(device), tpot, 1, dtype)
    row.engine, row.weights = name, _weights(job)
    return [row]


def _vllm(job: Job) -> list[BenchRow]:
    from peers.vllm_cpu import VllmSettings, run_vllm
    from replica.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(job.model)
    if model_dir is None:
        raise ValueError(f"vLLM needs a model directory; {job.model!r} is built from config")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts, lens = _workload(job.num_requests, vocab)
    settings = VllmSettings(job.dtype, job.binding)
    r = run_vllm(settings, model_dir, prompts, lens, MAX_SEQ_LEN, job.slots, _decode_prompt(), DECODE1_LENS)
    peak = _peak_mem_mb("cpu", children=True)
    described = f"{settings.describe()}, max_num_seqs={job.slots} (vllm {r['vllm']}, start-up {r['startup_s']:.0f} s)"
    tput = BenchRow("vllm", described, job.slots, r["tokens_per_s"], peak, r["seconds"], r["useful_tokens"], job.dtype)
    tput.outputs = r["outputs"]
    decode = BenchRow(
        "decode1", settings.describe(), 1, r["decode1_tokens_per_s"], peak, 1 / r["decode1_tokens_per_s"], 1
    )
    decode.dtype, decode.engine = job.dtype, "vllm"
    return [tput, decode]


def _hf_model(job: Job):
    from replica.config import resolve_dtype
    from replica.model.loader import load_hf_model
    from replica.model.runner import DTYPES, pick_device

    hf, _ = load_hf_model(job.model)
    device = pick_device(job.device)
    dtype = resolve_dtype(job.dtype, device)
    return hf.to(device, DTYPES[dtype]).eval(), device, dtype


def _hf_static(job: Job) -> list[BenchRow]:
    import torch
    from transformers import GenerationConfig

    model, device, dtype = _hf_model(job)
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
    policy = f"generate() batches of {STATIC_BATCH}"
    return [
        BenchRow(
            "hf-static", policy, STATIC_BATCH, sum(lens) / seconds, _peak_mem_mb(device), seconds, sum(lens), dtype
        )
    ]


def _hf_continuous(job: Job) -> list[BenchRow]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, device, dtype = _hf_model(job)
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
    row = BenchRow(
        "hf-continuous", described, job.num_requests, useful / seconds, _peak_mem_mb(device), seconds, useful
    )
    row.dtype = dtype
    return [row]


def _decode_step(job: Job) -> list[BenchRow]:
    """Median time of a pure decode step at batch `slots` (64-token prompts, context 64-76)."""
    import torch

    from peers import step_parts

    times, parts = [], {}
    if job.hf:
        from transformers import DynamicCache

        model, device, dtype = _hf_model(job)
        ids = torch.tensor([_decode_prompt(i) for i in range(job.slots)], device=device)
        with torch.inference_mode():
            cache = DynamicCache()
            nxt = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(DECODE_STEPS):
                t = time.perf_counter()
                nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                _sync(device)
                times.append(time.perf_counter() - t)
    else:
        max_tokens = step_parts.decode_max_tokens(DECODE_STEPS + PROFILE_STEPS)  # none ends in a measured step
        engine = _engine(job, job.slots, DECODE_PROMPT_LEN + max_tokens, "mixed")
        device, dtype = engine.runner.device, engine.runner.dtype
        for i in range(job.slots):
            engine.add_request(_decode_prompt(i), {"max_tokens": max_tokens, "ignore_eos": True})
        engine.step()  # the prefill
        for _ in range(DECODE_STEPS):
            times.append(engine.step().record.duration)  # the step ends with its sampled tokens on the host
        if device == "cpu":  # on a GPU the wrappers would time kernel launches, not the kernels
            parts = step_parts.measure(itertools.repeat(engine), PROFILE_STEPS, step_parts.wrapper_seconds())
    step = statistics.median(times[2:])
    system = "hf-decode" if job.hf else "slotserve-decode"
    row = BenchRow(system, "decode step", job.slots, job.slots / step, _peak_mem_mb(device), step, job.slots, dtype)
    row.parts = parts
    return [row]


def _prefill_step(job: Job) -> list[BenchRow]:
    """Median time of a step prefilling `PREFILL_PROMPTS` 64-token prompts (a fresh engine on one
    runner each time, its first step), then as many such steps measured by part."""
    from peers import step_parts
    from replica.engine import Engine

    first = _engine(job, PREFILL_PROMPTS, DECODE_PROMPT_LEN + 2, "mixed")

    def engines() -> Iterator:
        engine = first
        while True:
            for i in range(PREFILL_PROMPTS):
                engine.add_request(_decode_prompt(i), {"max_tokens": 1, "ignore_eos": True})
            yield engine
            engine = Engine(first.config, runner=first.runner)

    fresh = engines()
    next(fresh).step()  # warm-up
    times = [next(fresh).step().record.duration for _ in range(PREFILL_REPS)]
    on_cpu = first.runner.device == "cpu"  # as for the decode step
    parts = step_parts.measure(fresh, PREFILL_REPS, step_parts.wrapper_seconds()) if on_cpu else {}
    step, tokens = statistics.median(times), PREFILL_PROMPTS * DECODE_PROMPT_LEN
    described = f"prefill step, {PREFILL_PROMPTS} prompts of {DECODE_PROMPT_LEN} tokens"
    row = BenchRow(
        "slotserve-prefill", described, PREFILL_PROMPTS, tokens / step, _peak_mem_mb(first.runner.device), step, tokens
    )
    row.dtype, row.parts = first.runner.dtype, parts
    return [row]


RUNS = {
    "engine": _engine_run,
    "vllm": _vllm,
    "hf-static": _hf_static,
    "hf-continuous": _hf_continuous,
    "decode": _decode_step,
    "decode1": _decode1,
    "prefill": _prefill_step,
}


def run_job(job: Job) -> list[BenchRow]:
    import torch

    torch.manual_seed(0)
    return RUNS[job.kind](job)


def default_dtypes(device: str) -> list[str]:
    """fp32, and bf16 where it has fast matrix units (a GPU, or a CPU with AVX512_BF16 or AMX)."""
    from replica.config import resolve_dtype

    auto = resolve_dtype("auto", device)
    return ["float32"] + (["bfloat16"] if auto == "bfloat16" else [])


def plan(args: argparse.Namespace) -> list[Job]:
    from replica.config import resolve_dtype
    from replica.model.runner import pick_device

    common = {"model": args.model, "device": args.device, "num_requests": args.requests}
    jobs = []
    for dtype in args.dtypes:
        jobs += [Job("engine", dtype=dtype, policy=p, slots=s, **common) for p in args.policies for s in args.slots]
    # int8 copies of the weights `auto` picks here (bf16 or fp32), at the most slots only: int8 pays
    # in the small-batch tail, which every slot count shares
    int8_dtype = resolve_dtype("auto", pick_device(args.device))
    if args.int8_rows:
        jobs += [
            Job("engine", dtype=int8_dtype, policy=p, slots=max(args.slots), int8_rows=args.int8_rows, **common)
            for p in args.policies
        ]
    jobs += [Job("decode1", dtype=d, **common) for d in args.dtypes]
    if args.int8_rows:
        jobs += [Job("decode1", dtype=int8_dtype, int8_rows=args.int8_rows, **common)]
    if args.vllm and pick_device(args.device) == "cpu":  # vLLM's CPU build is the peer of a CPU run only
        jobs += [
            Job("vllm", dtype=d, binding=b, slots=max(args.slots), **common)
            for b in ("all", "auto")
            for d in ("bfloat16", "float32")
        ]
    if args.peers:
        jobs += [Job("hf-static", dtype="auto", **common)]
        jobs += [
            Job("hf-continuous", dtype=d, slots=max(args.slots), cb_settings=tuple(c.items()), **common)
            for d in args.dtypes
            for c in HF_CB_GRID
        ]
        jobs += [Job("decode1", dtype=d, hf=True, **common) for d in args.dtypes]
    for d in args.dtypes if args.decode_batches else ():
        for s in args.decode_batches:
            jobs += [Job("decode", dtype=d, slots=s, **common), Job("decode", dtype=d, slots=s, hf=True, **common)]
        jobs += [Job("prefill", dtype=d, **common)]
    return jobs


def run(args: argparse.Namespace) -> dict:
    """Probe the roofs, then every row in turn; a row that fails is kept with its error (a peer's
    API may differ between versions, vLLM's environment may be missing) and the JSON is rewritten
    after each row, so a run cut short still leaves what it measured."""
    from peers.roofline import probe
    from protocol.cpu import cpu_info
    from replica.model.runner import pick_device

    print(f"CPU: {cpu_info().describe()}", flush=True)
    args.dtypes = args.dtypes or default_dtypes(pick_device(args.device))
    roof = probe(quick=True)
    print(
        f"roofs here: fp32 {roof.fp32_flops / 1e9:.0f} GFLOP/s, bf16 {roof.bf16_flops / 1e9:.0f} GFLOP/s, "
        f"read {roof.read_bytes_per_s / 1e9:.1f} GB/s, copy {roof.copy_bytes_per_s / 1e9:.1f} GB/s",
        flush=True,
    )
    rows: list[BenchRow] = []
    # One fresh process per row (spawned, so no torch state is inherited): peak memory is the row's own.
    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        for job in tqdm(plan(args), desc="bench", unit="row"):
            try:
                rows += pool.submit(run_job, job).result()
            except Exception as err:  # noqa: BLE001 - reported in the row, the other rows still run
                system = {"engine": "slotserve", "prefill": "slotserve-prefill"}.get(job.kind, job.kind)
                if job.kind == "decode":
                    system = "hf-decode" if job.hf else "slotserve-decode"
                described = job.policy or job.binding or " ".join(f"{k}={v}" for k, v in job.cb_settings)
                failed = BenchRow(system, described, job.slots, 0.0, 0.0, dtype=job.dtype, weights=_weights(job))
                failed.error = f"{type(err).__name__}: {err}"[:300]
                rows.append(failed)
            if args.json:
                write_json(summarize(rows, args, roof), args.json)
    # A roof is the most the machine gave: probed again at the end, the higher of each figure is
    # kept (a neighbour's load during one 10-second probe would otherwise lower every roof).
    roof = roof.best(probe(quick=True))
    print(
        f"roofs, the higher of the start's and the end's probes: fp32 {roof.fp32_flops / 1e9:.0f} GFLOP/s, "
        f"bf16 {roof.bf16_flops / 1e9:.0f} GFLOP/s, read {roof.read_bytes_per_s / 1e9:.1f} GB/s",
        flush=True,
    )
    return summarize(rows, args, roof)


def write_json(result: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


def _best(rows: list[BenchRow], system: str, engine: str = "") -> BenchRow | None:
    found = [r for r in rows if r.system == system and r.engine == engine and not r.error]
    return max(found, key=lambda r: r.useful_tokens_per_s) if found else None


def agreement(rows: list[BenchRow]) -> list[dict]:
    """For each slotserve setting other than fp32 (and each vLLM run), the share of requests whose
    greedy tokens equal slotserve's fp32 run at the same policy and slots (vLLM: the fp32 run
    with the most slots, under its own scheduler)."""
    fp32 = {(r.policy, r.slots): r for r in rows if r.system == "slotserve" and r.variant == "float32" and not r.error}
    out = []
    for r in rows:
        if r.error or not r.outputs or (r.system == "slotserve" and r.variant == "float32"):
            continue
        ref = (
            fp32.get((r.policy, r.slots))
            if r.system == "slotserve"
            else max(fp32.values(), key=lambda x: x.slots, default=None)
        )
        if ref is None:
            continue
        same = sum(a == b for a, b in zip(r.outputs, ref.outputs))
        out.append(
            {
                "system": r.system,
                "setting": r.variant if r.system == "slotserve" else f"{r.dtype}, {r.policy.split(',')[0]}",
                "policy": ref.policy,
                "slots": ref.slots,
                "identical": same,
                "requests": len(ref.outputs),
                "share": same / len(ref.outputs),
            }
        )
    return out


def summarize(rows: list[BenchRow], args: argparse.Namespace, roof) -> dict:
    from replica.model.runner import pick_device

    on_cpu = pick_device(args.device) == "cpu"
    params = _params_per_token(args.model)
    result: dict = {
        "model": args.model,
        "workload": f"saturated ({args.requests} requests)",
        "machine": roof.to_dict(),
        "params_per_token": params,
        "rows": [],
    }
    if on_cpu:
        result["roofline_tokens_per_s"] = {d: roof.compute_tokens_per_s(params, d) for d in ("float32", "bfloat16")}
        result["memory_roof_batch1_tokens_per_s"] = {
            d: roof.memory_tokens_per_s(params, d) for d in ("float32", "bfloat16", "int8")
        }
    for r in rows:
        d = asdict(r)
        d.pop("outputs")
        if r.parts:
            d["host_share"] = r.parts["host"] / r.parts["step"]
        if r.system == "slotserve-decode":
            peer = next(
                (
                    p
                    for p in rows
                    if p.system == "hf-decode" and (p.slots, p.dtype) == (r.slots, r.dtype) and not p.error
                ),
                None,
            )
            d["ratio_to_hf_decode"] = r.useful_tokens_per_s / peer.useful_tokens_per_s if peer else None
            if on_cpu:
                d["pct_of_roofline"] = 100 * r.useful_tokens_per_s / roof.compute_tokens_per_s(params, r.dtype)
        result["rows"].append(d)
    best = _best(rows, "slotserve")
    if best is not None:
        result["best_slotserve"] = {
            "policy": best.policy,
            "slots": best.slots,
            "setting": best.variant,
            "useful_tokens_per_s": best.useful_tokens_per_s,
        }
        for peer in ("vllm", "hf-continuous", "hf-static"):
            if (p := _best(rows, peer)) is not None:
                result[f"ratio_to_{peer}"] = best.useful_tokens_per_s / p.useful_tokens_per_s
                result[f"best_{peer}"] = {
                    "setting": f"{p.variant}, {p.policy}",
                    "useful_tokens_per_s": p.useful_tokens_per_s,
                }
    result |= lossless_and_int8(rows)
    result["host_overhead"] = [
        {
            "dtype": r.dtype,
            "step": "prefill" if r.system == "slotserve-prefill" else "decode",
            "rows": r.useful_tokens,
            "step_ms": 1e3 * r.parts["step"],
            "host_ms": 1e3 * r.parts["host"],
            "host_share": r.parts["host"] / r.parts["step"],
            "parts_ms": {k: 1e3 * v for k, v in r.parts.items() if k not in ("step", "host")},
        }
        for r in rows
        if r.parts and not r.error
    ]
    single = _best(rows, "decode1", "slotserve")
    if single is not None:
        result["decode1"] = {"slotserve": single.useful_tokens_per_s, "slotserve_setting": single.variant}
        for peer in ("vllm", "transformers"):
            if (p := _best(rows, "decode1", peer)) is not None:
                result["decode1"][f"ratio_to_{peer}"] = single.useful_tokens_per_s / p.useful_tokens_per_s
                result["decode1"][peer] = p.useful_tokens_per_s
        if on_cpu:
            weights = "int8" if single.weights else single.dtype  # int8 copies serve batch 1 where used
            result["decode1"]["pct_of_memory_roof"] = (
                100 * single.useful_tokens_per_s / roof.memory_tokens_per_s(params, weights)
            )
    result["greedy_agreement_vs_fp32"] = agreement(rows)
    return result


def lossless_and_int8(rows: list[BenchRow]) -> dict:
    """slotserve's best lossless setting (no int8 copies, at the dtype of vLLM's best, or any
    dtype without vLLM) and its best with int8 copies, each with its ratios to vLLM's best and to
    vLLM's best fp32: the int8 copies change outputs, so they are never what the lossless
    comparison counts."""
    vllm, vllm_fp32 = _best(rows, "vllm"), _best([r for r in rows if r.dtype == "float32"], "vllm")
    slotserve = [r for r in rows if r.system == "slotserve"]
    lossless = [r for r in slotserve if not r.weights and (vllm is None or r.dtype == vllm.dtype)]
    out = {}
    for key, found in (
        ("best_lossless", _best(lossless, "slotserve")),
        ("best_int8", _best([r for r in slotserve if r.weights], "slotserve")),
    ):
        if found is None:
            continue
        out[key] = {
            "policy": found.policy,
            "slots": found.slots,
            "setting": found.variant,
            "useful_tokens_per_s": found.useful_tokens_per_s,
        }
        for name, peer in (("vllm_best", vllm), ("vllm_float32", vllm_fp32)):
            if peer is not None:
                out[key][f"ratio_to_{name}"] = found.useful_tokens_per_s / peer.useful_tokens_per_s
                out[key][name] = {
                    "setting": f"{peer.variant}, {peer.policy}",
                    "useful_tokens_per_s": peer.useful_tokens_per_s,
                }
    return out


def _params_per_token(model: str) -> int:
    """Weights one token multiplies through, from the model's config (no weights loaded)."""
    from transformers import AutoConfig, GPT2Config

    from replica.model.decoder import ModelShape
    from replica.model.loader import resolve_model_dir

    path = resolve_model_dir(model)
    config = (
        GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12)
        if path is None
        else AutoConfig.from_pretrained(path)
    )
    return ModelShape.from_hf_config(config).num_params_per_token


def format_bench(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"{result['model']}, {result['workload']}",
        f"CPU: {m['cpu']}; flags: {m['flags']}; {m['threads']} torch threads",
        f"roofs measured here: fp32 {m['fp32_flops'] / 1e9:.0f} GFLOP/s, bf16 {m['bf16_flops'] / 1e9:.0f} GFLOP/s, "
        f"read {m['read_bytes_per_s'] / 1e9:.1f} GB/s"
        + (
            "; decode roofline (compute) "
            + ", ".join(f"{d} {v:.0f} tok/s" for d, v in result["roofline_tokens_per_s"].items())
            if "roofline_tokens_per_s" in result
            else ""
        ),
        f"{'system':17} {'policy / settings':74} {'slots':>5} {'dtype':>15} {'useful tok/s':>12} {'peak MB':>8}  note",
    ]
    for r in result["rows"]:
        note = ""
        if r["system"] == "slotserve-decode":
            ratio, pct = r.get("ratio_to_hf_decode"), r.get("pct_of_roofline")
            note = ", ".join(
                ([f"{ratio:.2f}x hf decode"] if ratio else [])
                + ([f"{pct:.0f}% of roofline"] if pct else [])
                + ([f"host {r['host_share']:.0%}"] if "host_share" in r else [])
            )
        elif "host_share" in r:
            note = f"host {r['host_share']:.0%}"
        if r["error"]:
            note = f"FAILED: {r['error']}"
        system = f"decode1:{r['engine']}" if r["system"] == "decode1" else r["system"]
        variant = r["dtype"] + (f"+{r['weights']}" if r["weights"] else "")
        lines.append(
            f"{system:17} {r['policy'][:74]:74} {r['slots']:5d} {variant:>15} "
            f"{r['useful_tokens_per_s']:12.1f} {r['peak_mem_mb']:8.0f}  {note}"
        )
    if "best_slotserve" in result:
        b = result["best_slotserve"]
        lines.append(
            f"best slotserve ({b['policy']}, {b['slots']} slots, {b['setting']}): {b['useful_tokens_per_s']:.1f} tok/s"
        )
        for peer, target in (("vllm", 1.2), ("hf-continuous", 3.0), ("hf-static", None)):
            if f"ratio_to_{peer}" in result:
                p = result[f"best_{peer}"]
                lines.append(
                    f"  {result[f'ratio_to_{peer}']:.2f}x {peer} best ({p['setting'][:60]}: "
                    f"{p['useful_tokens_per_s']:.1f} tok/s)" + (f"  target >= {target}x" if target else "")
                )
    for key, name in (("best_lossless", "best lossless"), ("best_int8", "best with int8 copies")):
        if key in result:
            b = result[key]
            lines.append(
                f"{name} ({b['policy']}, {b['slots']} slots, {b['setting']}): {b['useful_tokens_per_s']:.1f} tok/s"
                + "".join(
                    f"; {b[f'ratio_to_{peer}']:.2f}x {label} ({b[peer]['setting'][:40]}: "
                    f"{b[peer]['useful_tokens_per_s']:.1f})"
                    for peer, label in (("vllm_best", "vLLM's best"), ("vllm_float32", "vLLM's fp32"))
                    if f"ratio_to_{peer}" in b
                )
                + ("  target >= 1.2x" if key == "best_lossless" else "")
            )
    if result.get("host_overhead"):
        lines.append("host overhead per step (time outside matrix products and attention, `peers.step_parts`):")
        for h in result["host_overhead"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(h["parts_ms"].items(), key=lambda kv: -kv[1]))
            size = f"decode B={h['rows']}" if h["step"] == "decode" else f"prefill {h['rows']} tokens"
            lines.append(
                f"  {h['dtype']:>8} {size:>19}: step {h['step_ms']:8.2f} ms, host {h['host_ms']:7.2f} ms "
                f"({h['host_share']:.0%}); ms by part: {parts}"
            )
    if "decode1" in result:
        d = result["decode1"]
        lines.append(
            f"single-stream decode (batch 1): slotserve {d['slotserve']:.1f} tok/s ({d['slotserve_setting']})"
            + "".join(f"; {d[f'ratio_to_{p}']:.2f}x {p} ({d[p]:.1f})" for p in ("vllm", "transformers") if p in d)
            + (f"; {d['pct_of_memory_roof']:.0f}% of the batch-1 memory roof" if "pct_of_memory_roof" in d else "")
            + "  target >= 1.2x vllm"
        )
    for a in result["greedy_agreement_vs_fp32"]:
        lines.append(
            f"greedy agreement vs slotserve fp32 ({a['policy']}, {a['slots']} slots): {a['system']} {a['setting']}: "
            f"{a['identical']}/{a['requests']} requests identical ({a['share']:.0%})"
        )
    return "\n".join(lines)
