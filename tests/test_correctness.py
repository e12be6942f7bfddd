"""Greedy outputs of the engine equal transformers' own `generate(do_sample=False)` for each
request run alone: for every batching policy, for the default model (slow) and for local
GPT-2 and Qwen2 directories, and with preemption forced by a tiny K/V budget."""

from __future__ import annotations

import pytest
import torch

from replica import POLICIES, Engine, EngineConfig
from replica.model_loader import load_hf_model
from replica.model_runner import ModelRunner

SLOTS = 4


def make_prompts(tokenizer) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): short and long prompts, short and long outputs."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "1, 2, 3, 4,", "Hello", "The three primary colors are",
             " ".join(["The quick brown fox jumps over the lazy dog."] * 12), "import numpy as np\n"]
    lens = [12, 30, 20, 8, 25, 16, 10, 24]
    return [(tokenizer.encode(t, add_special_tokens=False), n) for t, n in zip(texts, lens)]


def preemption_cases(cases) -> list[tuple[list[int], int]]:
    """Four 30-token prompts wanting 30 tokens each: 240 K/V tokens at the end, so a
    160-token budget must preempt while they decode."""
    long_prompt = max((p for p, _ in cases), key=len)
    return [(long_prompt[i : i + 30], 30) for i in range(4)] + cases[:3]


_REFERENCES: dict[tuple, list[int]] = {}


def reference(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens for this request alone (computed once per model and request)."""
    key = (id(hf), tuple(prompt), max_tokens)
    if key not in _REFERENCES:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        _REFERENCES[key] = out[0, len(prompt):].tolist()
    return _REFERENCES[key]


def mismatch_report(hf, prompt: list[int], ours: list[int], ref: list[int]) -> str:
    """Where the two greedy sequences part, and the reference model's logit margin there:
    a near-tie flipped by a different fp32 summation order shows as a tiny margin."""
    k = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if k >= min(len(ours), len(ref)):
        return f"lengths differ: ours {len(ours)} tokens, reference {len(ref)}"
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:k]])).logits[0, -1]
    margin = float(logits[ref[k]] - logits[ours[k]])
    return f"first difference at output token {k}: reference {ref[k]}, ours {ours[k]}, logit margin {margin:.3g}"


def check_policy_outputs(hf, runner, policy: str, cases, **config) -> list:
    engine = Engine(EngineConfig(policy=policy, num_slots=SLOTS, max_seq_len=256, token_budget=16, **config), runner)
    done = engine.generate([p for p, _ in cases], [{"max_tokens": n} for _, n in cases])
    for (prompt, n), got in zip(cases, done):
        ref = reference(hf, prompt, n)
        assert got.token_ids == ref, f"{policy}: {mismatch_report(hf, prompt, got.token_ids, ref)}"
    return done


@pytest.fixture(scope="module", params=["gpt2", "qwen2"])
def tiny(request, tiny_gpt2_dir, tiny_qwen2_dir):
    path = {"gpt2": tiny_gpt2_dir, "qwen2": tiny_qwen2_dir}[request.param]
    hf, tok = load_hf_model(path)
    return hf, ModelRunner(path, SLOTS, 256), make_prompts(tok)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_tiny_local_models_match_transformers_greedy(tiny, policy):
    """GPT-2 (learned positions, LayerNorm, fused Conv1D weights) and Qwen2 (RoPE, GQA, Q/K/V
    biases) loaded from local directories decode exactly like transformers, in every policy."""
    hf, runner, cases = tiny
    check_policy_outputs(hf, runner, policy, cases)


def test_tiny_model_matches_under_forced_preemption(tiny):
    """A K/V budget of 160 tokens for 4 slots forces recompute preemption; outputs are unchanged."""
    hf, runner, cases = tiny
    done = check_policy_outputs(hf, runner, "mixed", preemption_cases(cases), kv_budget_tokens=160)
    assert sum(c.num_preemptions for c in done) > 0


@pytest.fixture(scope="module")
def smollm2():
    hf, tok = load_hf_model("smollm2-135m")
    return hf, ModelRunner("smollm2-135m", SLOTS, 256), make_prompts(tok)


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_default_model_matches_transformers_greedy(smollm2, policy):
    """SmolLM2-135M-Instruct (fp32): every policy's greedy tokens equal transformers' per request."""
    hf, runner, cases = smollm2
    check_policy_outputs(hf, runner, policy, cases)


@pytest.mark.slow
def test_default_model_matches_under_forced_preemption(smollm2):
    """The default model with a 160-token K/V budget: preempted requests re-prefill and still
    produce transformers' tokens, none twice."""
    hf, runner, cases = smollm2
    done = check_policy_outputs(hf, runner, "chunked", preemption_cases(cases), kv_budget_tokens=160)
    assert sum(c.num_preemptions for c in done) > 0
