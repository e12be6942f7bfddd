"""Prefill/decode disaggregation inside the engine: a request prefilled on one engine (the
prefill role: chunked, with prefix caching on the paged cache), handed over with its K/V once its
first token is sampled, and decoded to the end on another (the decode role) makes exactly the
tokens and text a colocated engine makes: greedy and seeded, slot and paged cache, from one
layout to the other, with the decode engine full (the hand-over waits with its K/V) or
preempting (the imported request then recomputes). A drained serving loop hands its decoding
requests over the same way and keeps them until taken or expired. Real models: local tiny ones
here, the default model (slow)."""

from __future__ import annotations

import asyncio

import pytest

from protocol.clock import FakeClock, WallClock
from protocol.finish import NATURAL_ENDINGS, FinishReason
from protocol.handover import Handover
from replica import Engine, EngineConfig, InvalidRequestError
from replica.model.fake import FlatCostModel, ScriptedFakeRunner
from replica.model.loader import load_hf_model
from replica.model.runner import ModelRunner
from replica.serving.loop import AsyncEngine
from tests.test_correctness import make_prompts, preemption_cases

SLOTS = 4
KV = {"slot": {}, "paged": {"kv_cache": "paged", "block_size": 8, "prefix_caching": True}}


def engine_config(kv: str, **overrides) -> EngineConfig:
    return EngineConfig(
        **{"policy": "chunked", "token_budget": 16, "num_slots": SLOTS, "max_seq_len": 256, **KV[kv], **overrides}
    )


def runner(model: str, kv: str) -> ModelRunner:
    return ModelRunner(engine_config(kv, model=model, dtype="float32"))


def colocated(engine: Engine, prompts, params) -> list[tuple[list[int], str]]:
    return [(c.token_ids, c.text) for c in engine.generate(prompts, params)]


def disaggregated(prefill: Engine, decode: Engine, prompts, params) -> tuple[list[tuple[list[int], str]], list]:
    """Every prompt prefilled on `prefill` and handed to `decode` as soon as its first token is
    out, both engines stepping in turn; (tokens, text) per prompt as their streams delivered
    them, and the hand-overs."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params):
        prefill.add_request(prompt, p, request_id=request_id, hand_over=True)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    text = dict.fromkeys(ids, "")
    handovers = []
    while prefill.has_unfinished or decode.has_unfinished:
        for out in prefill.step().outputs + decode.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            text[out.request_id] += out.new_text
            if out.handover is not None:
                assert out.finish_reason is FinishReason.MIGRATE
                handovers.append(out.handover)
                assert decode.import_request(out.handover)
            elif out.finished:
                assert out.finish_reason in NATURAL_ENDINGS, out
    return [(tokens[i], text[i]) for i in ids], handovers


@pytest.fixture(scope="module")
def tiny(tiny_qwen2_dir):
    _, tok = load_hf_model(tiny_qwen2_dir)
    cases = make_prompts(tok)
    return tiny_qwen2_dir, [p for p, _ in cases], [n for _, n in cases]


def greedy(lens) -> list[dict]:
    return [{"max_tokens": n} for n in lens]


def seeded(lens) -> list[dict]:
    return [{"max_tokens": n, "temperature": 0.9, "top_p": 0.95, "seed": 7 + i} for i, n in enumerate(lens)]


def check_hand_over(model: str, prompts, lens, prefill_kv: str, decode_kv: str) -> list[Handover]:
    """Greedy, seeded and stop-string runs through a hand-over equal the colocated engine's."""
    prefill_runner, decode_runner = runner(model, prefill_kv), runner(model, decode_kv)
    stops = [{"max_tokens": n, "stop": [" the", "\n"]} for n in lens]
    handovers = []
    for params in (greedy(lens), seeded(lens), stops):
        expected = colocated(Engine(engine_config(prefill_kv), prefill_runner), prompts, params)
        prefill = Engine(engine_config(prefill_kv), prefill_runner)
        decode = Engine(engine_config(decode_kv), decode_runner)
        got, handovers = disaggregated(prefill, decode, prompts, params)
        assert got == expected
        assert decode.scheduler.num_prefix_cached_tokens == 0  # nothing of it was computed there
        assert decode.kv_transfer.tokens_written == sum(h.num_kv_tokens for h in handovers)
        assert not prefill.scheduler.running and prefill.scheduler.slots.num_used_slots == 0  # freed at once
    cache = prefill_runner.cache
    for h in handovers:
        assert h.num_kv_tokens == len(h.prompt_token_ids) and len(h.output_token_ids) == 1
        assert h.nbytes == h.num_kv_tokens * cache.bytes_per_token == h.kv.numel() * h.kv.element_size()
    return handovers


@pytest.mark.parametrize("prefill_kv,decode_kv", [(a, b) for a in KV for b in KV])
def test_tiny_model_hand_over_equals_colocated(tiny, prefill_kv, decode_kv):
    check_hand_over(*tiny, prefill_kv, decode_kv)


@pytest.mark.parametrize("kv", list(KV))
def test_full_decode_engine_queues_hand_overs_with_their_kv(tiny, kv):
    """A decode engine with one slot and a K/V budget too small for all of them at once: the
    hand-overs wait in its queue with their K/V (none is recomputed while it waits), and one
    preempted there recomputes from its tokens; the outputs are still the colocated ones."""
    model, prompts, lens = tiny
    prefill_runner, decode_runner = runner(model, kv), runner(model, kv)
    squeezed = preemption_cases(list(zip(prompts, lens)))
    for overrides, cases in (({"num_slots": 1}, list(zip(prompts, lens))), ({"kv_budget_tokens": 160}, squeezed)):
        params = greedy([n for _, n in cases])
        expected = colocated(Engine(engine_config(kv), prefill_runner), [p for p, _ in cases], params)
        decode = Engine(engine_config(kv, **overrides), decode_runner)
        got, handovers = disaggregated(Engine(engine_config(kv), prefill_runner), decode, [p for p, _ in cases], params)
        assert got == expected
        assert decode.kv_transfer.tokens_written == sum(h.num_kv_tokens for h in handovers)
        assert (decode.scheduler.num_preemptions > 0) == ("kv_budget_tokens" in overrides)


def test_hand_over_of_a_decoding_request_and_refusals(tiny):
    """`Engine.hand_over` moves a request mid-decode (a drain) and the receiver finishes it as
    the colocated engine would; a waiting request cannot be handed over, and K/V of another
    model's shape are refused, the receiver recomputing from the tokens instead."""
    model, prompts, lens = tiny
    prefill_runner, decode_runner = runner(model, "paged"), runner(model, "paged")
    expected = colocated(Engine(engine_config("paged"), prefill_runner), prompts[:2], greedy([20, 20]))
    sender, receiver = Engine(engine_config("paged"), prefill_runner), Engine(engine_config("paged"), decode_runner)
    for i, p in enumerate(prompts[:2]):
        sender.add_request(p, {"max_tokens": 20}, request_id=f"r{i}")
    tokens = {"r0": [], "r1": []}
    while not all(len(t) >= 5 for t in tokens.values()):
        for out in sender.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    for request_id in tokens:
        final = sender.hand_over(request_id)
        assert final.finished and final.finish_reason is FinishReason.MIGRATE and final.new_token_ids == []
        assert final.handover.num_kv_tokens == len(final.handover.prompt_token_ids) + len(tokens[request_id]) - 1
        assert receiver.import_request(final.handover)
    while receiver.has_unfinished:
        for out in receiver.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    assert [tokens["r0"], tokens["r1"]] == [t for t, _ in expected]

    sender.add_request(prompts[0], {"max_tokens": 4}, request_id="waiting")
    with pytest.raises(InvalidRequestError, match="not decoding"):
        sender.hand_over("waiting")
    handover = final.handover
    wrong = Handover(**{**handover.__dict__, "request_id": "wrong", "kv": handover.kv[:, :, :, :1]})
    assert not receiver.import_request(wrong)  # one K/V head where the cache has two: recompute
    tokens_only = Handover(**{**handover.__dict__, "request_id": "tokens-only", "kv": None})
    assert not receiver.import_request(tokens_only)  # a fake's hand-over: recompute
    while receiver.has_unfinished:
        receiver.step()
    assert receiver.kv_transfer.tokens_written == sum(len(prompts[i]) + 4 for i in range(2))
    assert receiver.scheduler.num_prefix_cached_tokens > 0  # the refused ones hit r0's filed blocks


def test_fake_model_hands_over_tokens_and_prices_the_kv():
    """The scripted fake has no tensors: a hand-over carries its tokens and the bytes a real
    cache would send (tokens x kv_bytes_per_token); the decode engine skips the prompt and
    continues the undisturbed sequence."""
    clock = FakeClock()
    prefill = Engine(engine_config("paged"), ScriptedFakeRunner(clock), clock)
    decode = Engine(engine_config("paged"), ScriptedFakeRunner(clock, kv_bytes_per_token=1000), clock)
    prompts = [[(7 * i + j) % 1000 for j in range(40 + 9 * i)] for i in range(5)]
    got, handovers = disaggregated(prefill, decode, prompts, greedy([12] * 5))
    assert [t for t, _ in got] == [prefill.runner.continuation(p, 12) for p in prompts]
    per_token = prefill.runner.kv_bytes_per_token
    assert [(h.kv, h.nbytes) for h in handovers] == [(None, len(p) * per_token) for p in prompts]
    assert decode.kv_transfer.tokens_written == sum(map(len, prompts))


def drained(ttl: float) -> tuple[AsyncEngine, dict[str, list], list[int]]:
    """A serving loop of one slot (the fake model, 2 ms steps on the wall clock, since the test
    waits on the hand-over's expiry) running request "a" and holding "b" waiting, drained
    after 0.05 s with K/V moved; the loop, each request's outputs, and a's prompt."""
    clock = WallClock()
    engine = Engine(EngineConfig(num_slots=1, max_seq_len=256), ScriptedFakeRunner(clock, FlatCostModel(0.002)), clock)
    serving = AsyncEngine(engine, handover_ttl=ttl)
    outs: dict[str, list] = {"a": [], "b": []}
    prompt = list(range(3, 43))

    async def main():
        for request_id, p in (("a", prompt), ("b", [9, 8, 7])):
            await serving.submit(p, {"max_tokens": 200}, request_id, None, outs[request_id].append)
        assert await serving.drain(0.05) == {"finished": 0, "migrated": 2, "kv_moved": 1}

    asyncio.run(main())
    return serving, outs, prompt


def test_a_drain_hands_decoding_requests_over_and_keeps_them_until_taken():
    """Drained with `move_kv` (the default), the decoding request leaves with a hand-over of its
    K/V (every token delivered but the last), the waiting one with its tokens only (it has no
    K/V to continue from); `handovers_taken` waits until the hand-over is taken, and another
    engine finishes the request from it with the undisturbed tokens, computing no prompt
    token. A hand-over nobody takes is given up at its expiry, and the wait ends then, or at
    its own bound if that comes first."""
    serving, outs, prompt = drained(ttl=30.0)
    final_a, final_b = outs["a"][-1], outs["b"][-1]
    assert final_b.finish_reason is FinishReason.MIGRATE and final_b.handover is None and len(outs["b"]) == 1
    assert final_a.finish_reason is FinishReason.MIGRATE and "draining" in final_a.error
    delivered = [t for o in outs["a"] for t in o.new_token_ids]
    handover = final_a.handover
    assert delivered and handover.output_token_ids == delivered
    assert handover.num_kv_tokens == len(prompt) + len(delivered) - 1

    async def take_while_waiting():
        waiting = asyncio.ensure_future(serving.handovers_taken(60.0))
        for _ in range(20):  # let the wait run until it blocks: on the take, or the expiry 30 s on
            await asyncio.sleep(0)
        assert not waiting.done()  # kept for the replica the client moves it to
        taken = serving.take_handover("a")
        await asyncio.wait_for(waiting, 5)
        return taken

    assert asyncio.run(take_while_waiting()) is handover
    clock = FakeClock()
    receiver = Engine(EngineConfig(num_slots=1, max_seq_len=256), ScriptedFakeRunner(clock), clock)
    assert receiver.import_request(handover)
    while receiver.has_unfinished:
        delivered += [t for o in receiver.step().outputs for t in o.new_token_ids]
    assert delivered == receiver.runner.continuation(prompt, 200)
    assert receiver.kv_transfer.tokens_written == handover.num_kv_tokens and receiver.scheduler.num_preemptions == 0

    expiring, _, _ = drained(ttl=0.3)

    async def expire(serving: AsyncEngine, within: float) -> float:
        start = serving.clock.now()
        await asyncio.wait_for(serving.handovers_taken(within), 5)
        return serving.clock.now() - start

    assert asyncio.run(expire(expiring, 60.0)) > 0.1 and expiring.take_handover("a") is None
    kept, _, _ = drained(ttl=30.0)  # a wait shorter than the expiry ends first, the hand-over still kept
    assert 0.1 < asyncio.run(expire(kept, 0.2)) < 5 and kept.take_handover("a") is not None


@pytest.fixture(scope="module")
def smollm2():
    _, tok = load_hf_model("smollm2-135m")
    cases = make_prompts(tok)
    return "smollm2-135m", [p for p, _ in cases], [n for _, n in cases]


@pytest.mark.slow
@pytest.mark.parametrize("kv", list(KV))
def test_default_model_hand_over_equals_colocated(smollm2, kv):
    """SmolLM2-135M (fp32), the correctness suite's prompts: greedy, seeded and stop-string
    outputs through a hand-over equal the colocated engine's; each hand-over sends the prompt's
    K/V, 46,080 bytes a token in fp32 (30 layers x 3 K/V heads x 64 x K and V x 4 bytes)."""
    handovers = check_hand_over(*smollm2, kv, kv)
    assert {h.nbytes // h.num_kv_tokens for h in handovers} == {2 * 30 * 3 * 64 * 4}
