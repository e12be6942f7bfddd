"""Greedy outputs of the engine equal transformers' own `generate(do_sample=False)` for each
request run alone: for every batching policy, for the default model (slow) and for local
GPT-2 and Qwen2 directories, and with preemption forced by a tiny K/V budget; on the slot
cache and on the paged cache (with prefix caching, whose sharing of a system prompt's blocks
is checked on its own too); and with the C++ kernels turned off, torch's operators alone."""

from __future__ import annotations

import shutil
import weakref

import pytest
import torch

from replica import POLICIES, ConfigError, Engine, EngineConfig
from replica.model.loader import load_hf_model
from replica.model.runner import ModelRunner

SLOTS = 4
# The K/V cache layouts; the paged one with prefix caching, so that preempted requests also
# re-prefill from their own blocks where those are still cached.
KV = {"slot": {}, "paged": {"kv_cache": "paged", "block_size": 8, "prefix_caching": True}}


def make_runners(model: str) -> dict[str, ModelRunner]:
    """One runner per cache layout (a runner owns one cache, so the model is loaded twice), in fp32:
    the dtype transformers' reference runs in (the default, "auto", may pick bf16)."""
    return {
        kv: ModelRunner(EngineConfig(model=model, dtype="float32", num_slots=SLOTS, max_seq_len=256, **c))
        for kv, c in KV.items()
    }


def make_prompts(tokenizer) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): short and long prompts, short and long outputs."""
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "1, 2, 3, 4,",
        "Hello",
        "The three primary colors are",
        " ".join(["The quick brown fox jumps over the lazy dog."] * 12),
        "import numpy as np\n",
    ]
    lens = [12, 30, 20, 8, 25, 16, 10, 24]
    return [(tokenizer.encode(t, add_special_tokens=False), n) for t, n in zip(texts, lens)]


def preemption_cases(cases) -> list[tuple[list[int], int]]:
    """Four 30-token prompts wanting 30 tokens each: 240 K/V tokens at the end, so a
    160-token budget must preempt while they decode."""
    long_prompt = max((p for p, _ in cases), key=len)
    return [(long_prompt[i : i + 30], 30) for i in range(4)] + cases[:3]


# Per reference model (held weakly: a key is never another model's, as an id() can be once the
# first model is freed), its greedy tokens per (prompt, max_tokens).
_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens for this request alone (computed once per model and request)."""
    known = _REFERENCES.setdefault(hf, {})
    key = (tuple(prompt), max_tokens)
    if key not in known:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        known[key] = out[0, len(prompt) :].tolist()
    return known[key]


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


def check_prefix_sharing(hf, runner, cases, block_size: int = 8, max_tokens: int = 12) -> None:
    """Four prompts = one long system prompt + a question; the last three arrive after the
    first's prefill, so with prefix caching they take its full system-prompt blocks. Tokens
    equal transformers' and the run without sharing, and the prefill tokens computed drop by
    exactly the shared blocks' tokens."""
    system = max((p for p, _ in cases), key=len)
    prompts = [system + p for p, _ in cases[:4]]
    runs = {}
    for prefix_caching in (False, True):
        engine = Engine(
            EngineConfig(
                policy="mixed",
                num_slots=SLOTS,
                max_seq_len=256,
                kv_cache="paged",
                block_size=block_size,
                prefix_caching=prefix_caching,
            ),
            runner,
        )
        first = engine.requests[engine.add_request(prompts[0], {"max_tokens": max_tokens})]
        prefill = engine.step().record.num_prefill_tokens
        requests = [first] + [engine.requests[engine.add_request(p, {"max_tokens": max_tokens})] for p in prompts[1:]]
        while engine.has_unfinished:
            prefill += engine.step().record.num_prefill_tokens
        runs[prefix_caching] = (
            [r.output_token_ids for r in requests],
            prefill,
            engine.scheduler.num_prefix_cached_tokens,
        )
    shared = 3 * (len(system) // block_size) * block_size
    assert runs[True][2] == shared and runs[False][2] == 0
    assert runs[True][1] == runs[False][1] - shared == sum(map(len, prompts)) - shared
    for prompt, ours, unshared in zip(prompts, runs[True][0], runs[False][0]):
        ref = reference(hf, prompt, max_tokens)
        assert ours == unshared == ref, mismatch_report(hf, prompt, ours, ref)


@pytest.fixture(scope="module", params=["gpt2", "qwen2"])
def tiny(request, tiny_gpt2_dir, tiny_qwen2_dir):
    path = {"gpt2": tiny_gpt2_dir, "qwen2": tiny_qwen2_dir}[request.param]
    hf, tok = load_hf_model(path)
    runners = make_runners(path)
    runners["torch"] = ModelRunner(
        EngineConfig(
            model=path, dtype="float32", num_slots=SLOTS, max_seq_len=256, fused_ops=False, decode_kernel=False
        )
    )
    return hf, runners, make_prompts(tok)


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_tiny_local_models_match_transformers_greedy(tiny, policy, kv):
    """GPT-2 (learned positions, LayerNorm, fused Conv1D weights) and Qwen2 (RoPE, GQA, Q/K/V
    biases) loaded from local directories decode exactly like transformers, in every policy,
    on either cache."""
    hf, runners, cases = tiny
    check_policy_outputs(hf, runners[kv], policy, cases, **KV[kv])


@pytest.mark.parametrize("kv", list(KV))
def test_tiny_model_matches_under_forced_preemption(tiny, kv):
    """A K/V budget of 160 tokens for 4 slots forces recompute preemption; outputs are unchanged."""
    hf, runners, cases = tiny
    done = check_policy_outputs(hf, runners[kv], "mixed", preemption_cases(cases), kv_budget_tokens=160, **KV[kv])
    assert sum(c.num_preemptions for c in done) > 0


def test_tiny_model_prefix_sharing_matches_transformers(tiny):
    """Requests sharing a long system prompt reuse its computed blocks and still decode like
    transformers (see check_prefix_sharing)."""
    hf, runners, cases = tiny
    check_prefix_sharing(hf, runners["paged"], cases)


@pytest.mark.parametrize("policy", ["mixed", "chunked"])
def test_tiny_models_match_transformers_with_the_cpu_kernels_off(tiny, policy):
    """EngineConfig(fused_ops=False, decode_kernel=False) reaches the model, which then runs
    torch's operators only (RMSNorm, RoPE, the cache write, SiLU, SDPA for decode rows) and still
    decodes like transformers; the default config takes the kernels where they are built."""
    hf, runners, cases = tiny
    assert not runners["torch"].model.fused_ops and not runners["torch"].model.decode_kernel
    if shutil.which("c++"):
        assert runners["slot"].model.fused_ops and runners["slot"].model.decode_kernel
    check_policy_outputs(hf, runners["torch"], policy, cases)


def test_runner_cache_must_match_engine_cache(tiny):
    """A runner holding a slot cache refuses a paged engine and the other way round, naming both."""
    _, runners, _ = tiny
    with pytest.raises(ConfigError, match="slot cache; this engine wants kv_cache='paged'"):
        Engine(EngineConfig(num_slots=SLOTS, max_seq_len=256, kv_cache="paged", block_size=8), runners["slot"])
    with pytest.raises(ConfigError, match="paged cache; this engine wants kv_cache='slot'"):
        Engine(EngineConfig(num_slots=SLOTS, max_seq_len=256), runners["paged"])
    with pytest.raises(ConfigError, match="blocks of 8 tokens"):
        Engine(EngineConfig(num_slots=SLOTS, max_seq_len=256, kv_cache="paged", block_size=16), runners["paged"])


@pytest.fixture(scope="module")
def smollm2():
    hf, tok = load_hf_model("smollm2-135m")
    return hf, make_runners("smollm2-135m"), make_prompts(tok)


@pytest.mark.slow
@pytest.mark.parametrize("policy,kv", [(p, "slot") for p in POLICIES] + [("chunked", "paged"), ("static", "paged")])
def test_default_model_matches_transformers_greedy(smollm2, policy, kv):
    """SmolLM2-135M-Instruct (fp32): every policy's greedy tokens equal transformers' per request;
    on the paged cache for chunked (prefill in chunks) and static (held rows) only, to keep
    the slow suite short (the tiny models cover every policy on it)."""
    hf, runners, cases = smollm2
    check_policy_outputs(hf, runners[kv], policy, cases, **KV[kv])


@pytest.mark.slow
@pytest.mark.parametrize("kv", list(KV))
def test_default_model_matches_under_forced_preemption(smollm2, kv):
    """The default model with a 160-token K/V budget: preempted requests re-prefill and still
    produce transformers' tokens, none twice."""
    hf, runners, cases = smollm2
    done = check_policy_outputs(hf, runners[kv], "chunked", preemption_cases(cases), kv_budget_tokens=160, **KV[kv])
    assert sum(c.num_preemptions for c in done) > 0


@pytest.mark.slow
def test_default_model_prefix_sharing_matches_transformers(smollm2):
    """The default model: a shared system prompt's blocks are computed once and reused, tokens unchanged."""
    hf, runners, cases = smollm2
    check_prefix_sharing(hf, runners["paged"], cases)
