"""The engine's speed paths keep their answers: dtype "auto" picks bf16 only where the CPU has
bf16 matrix units (or on a GPU); gathered attention over scattered slots equals the range view;
the C++ decode and per-layer kernels equal torch's operators (the matrix products:
test_linear.py); the default model's directory loads in other tools (tied embeddings saved the
standard way); the bench's greedy-agreement and vLLM environment helpers say what they should.
Slow: bf16 and int8 greedy outputs of the real model against fp32 on a few prompts."""

from __future__ import annotations

import argparse
import itertools
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from peers.engine_speed import BenchRow, agreement, format_bench, lossless_and_int8, summarize
from peers.vllm_cpu import VllmSettings, environment
from protocol.cpu import parse_cpuinfo
from replica.config import EngineConfig, resolve_dtype
from replica.model.attention import AttentionMetadata, build_group, slot_attention
from replica.model.linear import Linear

CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 fma {extra}\nprocessor\t: 1\n"


def test_auto_dtype_follows_the_cpu_flags():
    """bf16 with AVX512_BF16 or AMX, fp32 on an AVX2-only CPU, bf16 on a GPU; explicit dtypes kept."""
    avx2 = parse_cpuinfo(CPUINFO.format(extra=""))
    bf16 = parse_cpuinfo(CPUINFO.format(extra="avx512f avx512bw avx512_bf16"))
    amx = parse_cpuinfo(CPUINFO.format(extra="avx512f amx_bf16 amx_tile"))
    assert (avx2.model, avx2.cores, avx2.fast_bf16) == ("AMD EPYC 9R14", 2, False)
    assert resolve_dtype("auto", "cpu", avx2) == "float32"
    assert resolve_dtype("auto", "cpu", bf16) == "bfloat16"
    assert resolve_dtype("auto", "cpu", amx) == "bfloat16"
    assert resolve_dtype("auto", "cuda", avx2) == "bfloat16"
    assert resolve_dtype("float32", "cpu", bf16) == "float32"
    assert resolve_dtype("bfloat16", "cpu", avx2) == "bfloat16"
    assert "avx512_bf16" in bf16.describe() and "avx512_bf16" not in avx2.describe()
    assert EngineConfig().dtype == "auto"


def test_gathered_attention_equals_the_range_view():
    """Decodes in scattered slots (gathered) and the same decodes read through the slot range
    (SDPA's layouts: the decode kernel needs neither)."""
    torch.manual_seed(0)
    k, v = torch.randn(64, 3, 40, 16), torch.randn(64, 3, 40, 16)
    q = torch.randn(3, 9, 16)
    slots, positions = [2, 30, 61], [5, 39, 17]

    def run(spread: int) -> torch.Tensor:
        group = build_group([0, 1, 2], slots, [0, 0, 0], positions, 3, "cpu", gather_spread=spread)
        assert (group.kv_slots is not None) == (spread == 2)
        return slot_attention(q, k, v, AttentionMetadata(torch.tensor(slots), [group], 3), decode_kernel=False)

    gathered, ranged = run(2), run(10**9)
    torch.testing.assert_close(gathered, ranged)
    # and against one sequence at a time
    for i, (s, p) in enumerate(zip(slots, positions)):
        qi = q[i].view(3, 3, 16)
        ref = F.scaled_dot_product_attention(qi, k[s, :, : p + 1], v[s, :, : p + 1]).reshape(-1)
        torch.testing.assert_close(gathered[i], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("group", [1, 3, 5])
def test_decode_kernel_equals_sdpa(dtype, head_dim, group):
    """The C++ decode kernel and the SDPA path give the same attention for decode rows in scattered
    slots, listed out of slot order, with `group` query heads per K/V head (up to 4 the kernel
    keeps the sums in registers, past it in memory), next to a prefill chunk's rows (which stay on
    SDPA); head_dim 24 takes the kernel's scalar tail."""
    from replica.kernels import decode_attention

    if not shutil.which("c++"):
        pytest.skip("no C++ compiler: the kernel is not built and SDPA serves every row")
    assert decode_attention.available("cpu")
    torch.manual_seed(0)
    k, v = (torch.randn(64, 3, 40, head_dim).to(dtype) for _ in range(2))
    q = torch.randn(7, 3 * group, head_dim).to(dtype)
    slots, positions = [61, 2, 30, 7], [17, 5, 39, 0]
    groups = [
        build_group([0, 1, 2, 3], slots, [0, 0, 0, 0], positions, group, "cpu"),
        build_group([4, 5, 6], [9, 9, 9], [0, 1, 2], [10, 11, 12], group, "cpu"),  # a prefill chunk
    ]
    meta = AttentionMetadata(torch.tensor(slots + [9, 9, 9]), groups, group)

    def run(kernel: bool) -> torch.Tensor:
        return slot_attention(q, k, v, meta, decode_kernel=kernel).float()

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(run(True), run(False), rtol=tol, atol=tol)
    # a cache row or key count past the cache is refused, not read
    out, rows = q.new_empty(7, 3 * group * head_dim), torch.tensor([0])
    with pytest.raises(RuntimeError, match="cache row 64 out of range"):
        decode_attention.decode_attention(q, k, v, rows, torch.tensor([64]), torch.tensor([1]), out)
    with pytest.raises(RuntimeError, match="41 keys, the cache holds 40"):
        decode_attention.decode_attention(q, k, v, rows, torch.tensor([0]), torch.tensor([41]), out)


def test_decode_rows_with_idle_slots_between_them_take_the_decode_kernel():
    """Decode rows whose slots leave idle ones between them, too few to gather (requests that
    ended at different steps, the usual state of a busy cache), still go to the decode kernel,
    with each row's own slot and key count; SDPA (kernel off) reads them through the padded range
    and gives the same attention."""
    from replica.kernels import decode_attention

    if not shutil.which("c++"):
        pytest.skip("no C++ compiler: the kernel is not built and SDPA serves every row")
    assert decode_attention.available("cpu")
    torch.manual_seed(0)
    k, v = torch.randn(8, 3, 40, 16), torch.randn(8, 3, 40, 16)
    q = torch.randn(5, 9, 16)
    slots, positions = [4, 0, 6, 1, 3], [12, 30, 7, 39, 0]
    group = build_group(list(range(5)), slots, [0] * 5, positions, 3, "cpu")
    assert group.kv_slots is None and group.num_seqs == 7 and group.seq_rows is None
    assert group.row_slots.tolist() == slots and group.row_lengths.tolist() == [p + 1 for p in positions]
    meta = AttentionMetadata(torch.tensor(slots), [group], 3)
    torch.testing.assert_close(
        slot_attention(q, k, v, meta, decode_kernel=True), slot_attention(q, k, v, meta, decode_kernel=False)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [True, False])
def test_fused_rope_write_and_silu_mul_equal_torch(dtype, rope):
    """rope_write rotates Q and K in place exactly as the torch path does (or leaves them, GPT-2)
    and puts each row's K and V at its (cache row, column), touching nothing else; silu_mul is
    SiLU(gate) * up; a cache row or column past the cache is refused, not written."""
    from replica.kernels import fused_ops
    from replica.model.decoder import Decoder

    if not shutil.which("c++"):
        pytest.skip("no C++ compiler: the kernels are not built and torch's operators serve")
    assert fused_ops.available("cpu")
    torch.manual_seed(0)
    heads, kv_heads, d, rows_n = 9, 3, 64, 5
    qkv = torch.randn(rows_n, (heads + 2 * kv_heads) * d).to(dtype)
    positions = torch.tensor([3, 0, 17, 4, 9])
    angles = torch.randn(32, d)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache, v_cache = torch.zeros(8, kv_heads, 20, d, dtype=dtype), torch.zeros(8, kv_heads, 20, d, dtype=dtype)
    rows, cols = torch.tensor([7, 0, 3, 3, 5]), torch.tensor([3, 0, 17, 4, 9])
    ref = qkv.clone()
    if rope:
        qk = ref[:, : (heads + kv_heads) * d].view(rows_n, heads + kv_heads, d)
        qk.copy_(Decoder._rope(qk.float(), cos[positions].unsqueeze(1).float(), sin[positions].unsqueeze(1).float()))
    fused_ops.rope_write(qkv, positions, *((cos, sin) if rope else (None, None)), k_cache, v_cache, rows, cols, heads)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(qkv, ref, rtol=tol, atol=tol)
    k = ref[:, heads * d : (heads + kv_heads) * d].view(rows_n, kv_heads, d)
    v = ref[:, (heads + kv_heads) * d :].view(rows_n, kv_heads, d)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[rows, :, cols], want_v[rows, :, cols] = k, v
    torch.testing.assert_close(k_cache, want_k, rtol=tol, atol=tol)
    assert torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="cache row 8 out of range"):
        fused_ops.rope_write(qkv, positions, cos, sin, k_cache, v_cache, torch.tensor([8, 0, 0, 0, 0]), cols, heads)
    with pytest.raises(RuntimeError, match="cache column 20 out of range"):
        fused_ops.rope_write(qkv, positions, cos, sin, k_cache, v_cache, rows, torch.tensor([20, 0, 0, 0, 0]), heads)
    gate_up = torch.randn(rows_n, 2 * 50).to(dtype)  # 50: the vector loops' scalar tail runs too
    gate, up = gate_up.float().chunk(2, dim=-1)
    if dtype == torch.bfloat16:  # fp32 SiLU times up, rounded once: to the bit
        assert torch.equal(fused_ops.silu_mul(gate_up), (F.silu(gate) * up).bfloat16())
    else:
        torch.testing.assert_close(fused_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=tol, atol=tol)
    x, weight = torch.randn(rows_n, 576).to(dtype), torch.rand(576).to(dtype)
    want = F.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-5).float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 49152, 50257])
def test_fused_argmax_equals_torch_argmax(vocab, dtype):
    """The sampler's argmax kernel returns torch.argmax's index for every row, fp32 or bf16 (a
    bf16 step's logits are not widened first): the first of equal maxima, the first NaN of a row
    that has one, 0 for a row of -inf, on strided rows too."""
    from replica.kernels import fused_ops

    if not shutil.which("c++"):
        pytest.skip("no C++ compiler: the kernels are not built and torch's operators serve")
    torch.manual_seed(0)
    x = torch.randn(70, vocab + 3).to(dtype)[:, 1 : vocab + 1]  # bf16 rounding makes more ties: still the first
    x[1, :] = float("-inf")
    x[2, vocab // 2] = x[2, vocab - 1] = 1e3  # a tie: the first wins
    x[3, vocab - 1] = float("nan")
    x[4, vocab // 3] = x[4, vocab - 1] = float("nan")
    x[5, :] = 0.0
    x[5, vocab - 1] = -0.0
    got = fused_ops.argmax(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(fused_ops.argmax(x[:1]), x[:1].argmax(dim=-1))


def test_greedy_agreement_counts_identical_requests():
    """bf16 is compared with fp32 at the same policy and slots; vLLM with the largest fp32 run."""
    fp32 = BenchRow("slotserve", "chunked", 64, 1.0, 0.0, outputs=[[1, 2], [3, 4], [5]])
    bf16 = BenchRow("slotserve", "chunked", 64, 1.0, 0.0, dtype="bfloat16", outputs=[[1, 2], [3, 9], [5]])
    other = BenchRow("slotserve", "chunked", 32, 1.0, 0.0, dtype="bfloat16", outputs=[[0], [0], [0]])
    vllm = BenchRow(
        "vllm", "VLLM_CPU_OMP_THREADS_BIND=0-1, x", 64, 1.0, 0.0, dtype="bfloat16", outputs=[[1, 2], [3, 4], [5]]
    )
    rows = agreement([fp32, bf16, other, vllm])
    assert [(a["system"], a["identical"], a["requests"]) for a in rows] == [("slotserve", 2, 3), ("vllm", 3, 3)]


def test_bench_keeps_the_lossless_best_apart_from_int8_and_prints_host_shares():
    """The lossless best is the fastest setting without int8 copies at the dtype of vLLM's best
    (neither a faster int8 run nor a faster run at another dtype counts), the best with int8 is
    kept apart, each with its ratios to vLLM's best and to vLLM's fp32; every step measured by
    part prints its host share (the step less its matrix products and attention)."""
    from peers.roofline import Roofline

    parts = {"matrix products": 6e-3, "attention": 2e-3, "forward, other": 1.5e-3, "sampling": 0.5e-3}
    rows = [
        BenchRow("slotserve", "chunked", 64, 500.0, 0.0, dtype="bfloat16"),
        BenchRow("slotserve", "chunked", 64, 600.0, 0.0, dtype="bfloat16", weights="int8<=16"),
        BenchRow("slotserve", "chunked", 32, 550.0, 0.0, dtype="float32"),
        BenchRow("vllm", "bind all", 64, 400.0, 0.0, dtype="bfloat16"),
        BenchRow("vllm", "bind all", 64, 250.0, 0.0, dtype="float32"),
        BenchRow(
            "slotserve-decode",
            "decode step",
            1,
            100.0,
            0.0,
            0.01,
            1,
            "bfloat16",
            parts=parts | {"step": 0.01, "host": 0.002},
        ),
    ]
    best = lossless_and_int8(rows)
    assert (best["best_lossless"]["setting"], best["best_lossless"]["slots"]) == ("bfloat16", 64)
    assert best["best_lossless"]["ratio_to_vllm_best"] == 500 / 400
    assert best["best_lossless"]["ratio_to_vllm_float32"] == 500 / 250
    assert best["best_int8"]["setting"] == "bfloat16+int8<=16" and best["best_int8"]["ratio_to_vllm_best"] == 600 / 400
    roof = Roofline("AMD EPYC", "avx2 fma avx512_bf16", 2, 200e9, 900e9, 25e9, 30e9)
    args = argparse.Namespace(model="gpt2-small-random", device="cpu", requests=48)
    result = summarize(rows, args, roof)
    assert result["best_lossless"] == best["best_lossless"] and result["best_slotserve"]["useful_tokens_per_s"] == 600
    [host] = result["host_overhead"]
    assert (host["dtype"], host["rows"], host["host_share"]) == ("bfloat16", 1, 0.2)
    text = format_bench(result)
    assert "best lossless (chunked, 64 slots, bfloat16): 500.0 tok/s; 1.25x vLLM's best" in text
    assert "2.00x vLLM's fp32" in text and "best with int8 copies (chunked, 64 slots, bfloat16+int8<=16)" in text
    assert "decode B=1: step    10.00 ms, host    2.00 ms (20%)" in text
    assert "CPU: AMD EPYC; flags: avx2 fma avx512_bf16" in text


def test_vllm_environment_binds_threads_and_drops_ours(monkeypatch):
    """auto keeps vLLM's default; all binds every core; our OMP settings do not leak into vLLM."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert environment(VllmSettings("bfloat16", "auto"))["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    env = environment(VllmSettings("float32", "all"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-") and "OMP_NUM_THREADS" not in env


@pytest.mark.slow
def test_default_model_dir_loads_with_tied_embeddings_saved_the_standard_way():
    """vLLM and transformers read `model.embed_tokens.weight` and tie the LM head to it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from replica.model.loader import default_model_dir

    path = default_model_dir()
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in names and embed.abs().sum() > 0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, embed) and torch.equal(hf.model.embed_tokens.weight, embed)


@pytest.mark.slow
def test_bf16_and_int8_greedy_outputs_agree_with_fp32():
    """The real model on a few prompts, 16 greedy tokens each: bf16 (prepacked), and bf16 or fp32
    activations with int8 weights at batch 1, mostly reproduce fp32; where they part, it is after
    the first tokens."""
    from replica.engine import Engine

    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time", "Hello, my name"]
    params = {"max_tokens": 16}

    def outputs(**config) -> list[list[int]]:
        engine = Engine(EngineConfig(policy="continuous", num_slots=1, max_seq_len=64, **config))
        return [engine.generate([p], params)[0].token_ids for p in prompts]

    fp32 = outputs(dtype="float32")
    for config in ({"dtype": "bfloat16"}, {"dtype": "bfloat16", "int8_rows": 1}, {"dtype": "float32", "int8_rows": 1}):
        got = outputs(**config)
        same = sum(a == b for a, b in zip(got, fp32))
        print(f"{config}: {same}/{len(prompts)} identical to fp32")
        assert same >= len(prompts) // 2, (config, got, fp32)
        assert all(a[:2] == b[:2] for a, b in zip(got, fp32)), (config, got, fp32)


def test_roofs_keep_the_higher_of_two_probes():
    """A probe slowed by a neighbour lowers no roof: each figure is the higher of the two."""
    from peers.roofline import Roofline

    start = Roofline("AMD EPYC", "avx2 fma", 2, 101e9, 1e9, 25e9, 27e9)
    end = Roofline("AMD EPYC", "avx2 fma", 2, 176e9, 0.9e9, 30e9, 26e9)
    best = start.best(end)
    assert (best.fp32_flops, best.bf16_flops, best.copy_bytes_per_s, best.read_bytes_per_s) == (176e9, 1e9, 30e9, 27e9)
    assert best.compute_tokens_per_s(134_500_000, "float32") == 176e9 / (2 * 134_500_000)


def test_step_parts_add_up_to_the_step_and_leave_nothing_wrapped(tiny_qwen2_dir):
    """A decode step measured by part: the parts (each exclusive of those nested in it) add up
    to the step, host is the step less its matrix products and attention, the matrix products
    were seen, and after the measurement every wrapped callable is the original again."""
    from peers import step_parts
    from replica.engine import Engine
    from replica.kernels import fused_ops
    from replica.model import decoder

    engine = Engine(EngineConfig(model=tiny_qwen2_dir, dtype="float32", policy="mixed", num_slots=2))
    for i in range(2):
        engine.add_request([5 + i, 6, 7, 8], {"max_tokens": 6, "ignore_eos": True})
    engine.step()  # the prefill
    originals = (Linear.__call__, decoder.slot_attention, fused_ops.rms_norm, engine.runner.execute)
    parts = step_parts.measure(itertools.repeat(engine), 3, step_parts.wrapper_seconds())
    assert (Linear.__call__, decoder.slot_attention, fused_ops.rms_norm, engine.runner.execute) == originals
    assert "execute" not in engine.runner.__dict__ and "forward" not in engine.runner.model.__dict__
    assert parts["matrix products"] > 0 and parts["step"] > 0


def test_bench_decode_step_finishes_no_request_in_a_measured_step(tiny_qwen2_dir, monkeypatch):
    """The bench's decode step (timed, then measured by part) keeps every request decoding: a step
    that also finished them would free their slots and detokenize their ends, host work the
    other decode steps do not (step_profile's engines never finish in a measured step)."""
    from peers import engine_speed
    from replica.engine import Engine

    finished: list[int] = []  # requests each step of the bench's engine finished
    real_step = Engine.step

    def step(engine: Engine):
        result = real_step(engine)
        finished.append(sum(o.finished for o in result.outputs))
        return result

    monkeypatch.setattr(Engine, "step", step)
    job = engine_speed.Job("decode", tiny_qwen2_dir, "float32", "cpu", 0, slots=2)
    (row,) = engine_speed.RUNS["decode"](job)
    measured = engine_speed.DECODE_STEPS + engine_speed.PROFILE_STEPS
    assert len(finished) == 1 + measured  # the prefill, then every measured step
    assert finished == [0] * (1 + measured)
    assert row.parts["step"] > 0
