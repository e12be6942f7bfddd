"""The replica's serving loop (no Ray): concurrent requests stream their tokens while the
engine steps in a background thread; bad requests are refused without disturbing the
others; a consumer that goes away aborts its request. The loop runs on a FakeClock (the
engine's), so its timers fire at once, at their time, and no test waits on the wall clock."""

from __future__ import annotations

import asyncio

import pytest

from protocol.clock import FakeClock
from replica import Engine, EngineConfig, FinishReason, InvalidRequestError
from replica.model.fake import FlatCostModel, LinearCostModel, ScriptedFakeRunner
from replica.serving.loop import AsyncEngine, ReplicaConfig, build_engine


def make(policy: str = "continuous", slots: int = 4, step: float = 0.002, **kw):
    clock = FakeClock()
    runner = ScriptedFakeRunner(clock, FlatCostModel(step))
    finished, steps, loads = [], [], []
    serving = AsyncEngine(
        Engine(EngineConfig(policy=policy, num_slots=slots, max_seq_len=128, **kw), runner, clock),
        steps.append,
        finished.append,
        loads.append,
    )
    return serving, runner, finished, steps, loads


async def collect(serving, prompt, n, rid):
    outs = [o async for o in serving.generate(prompt, {"max_tokens": n, "ignore_eos": True}, rid)]
    return outs


def test_concurrent_requests_stream_their_own_tokens():
    """12 requests on 4 slots: each gets its tokens one per event, in order, then one final event;
    the step and finish callbacks see every step and every request."""
    serving, runner, finished, steps, loads = make()

    async def main():
        prompts = [[i + 1] * (i + 2) for i in range(12)]
        results = await asyncio.gather(*[collect(serving, p, 5 + i, f"r{i}") for i, p in enumerate(prompts)])
        return prompts, results

    prompts, results = asyncio.run(asyncio.wait_for(main(), 60))
    for i, (prompt, outs) in enumerate(zip(prompts, results)):
        assert [t for o in outs for t in o.new_token_ids] == runner.continuation(prompt, 5 + i)
        assert all(len(o.new_token_ids) == 1 for o in outs)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason is FinishReason.LENGTH
    assert sorted(o.request_id for o in finished) == sorted(f"r{i}" for i in range(12))
    assert max(s.live_slots for s in steps) == 4
    assert loads and loads[-1].free_slots == 4 and loads[-1].running == 0


def test_bad_request_is_refused_and_others_finish():
    """A bad request raises InvalidRequestError at its caller only; concurrent good ones finish."""
    serving, runner, _, _, _ = make()

    async def bad():
        return [o async for o in serving.generate([], {"max_tokens": 3}, "bad")]

    async def main():
        return await asyncio.gather(
            collect(serving, [1, 2], 6, "a"), bad(), collect(serving, [3], 4, "b"), return_exceptions=True
        )

    a, err, b = asyncio.run(asyncio.wait_for(main(), 60))
    assert isinstance(err, InvalidRequestError) and err.field == "prompt"
    assert [t for o in a for t in o.new_token_ids] == runner.continuation([1, 2], 6)
    assert [t for o in b for t in o.new_token_ids] == runner.continuation([3], 4)


def test_consumer_that_stops_reading_aborts_its_request():
    """Closing the stream early aborts the request: its slot is freed and it ends with ABORT."""
    serving, _, finished, _, _ = make(step=0.005)

    async def main():
        stream = serving.generate([5, 6], {"max_tokens": 100, "ignore_eos": True}, "x")
        await stream.__anext__()
        await stream.aclose()
        while not finished:  # the abort is applied before the next step; no wall time passes
            await asyncio.sleep(0)

    asyncio.run(asyncio.wait_for(main(), 60))
    assert [o.finish_reason for o in finished] == [FinishReason.ABORT]
    assert serving.engine.scheduler.slots.num_free_slots == 4


def test_dynamic_policy_wakes_on_its_timer():
    """With 'dynamic', a lone request waits max_wait for company (on the engine's clock), then
    runs without any new arrival."""
    serving, runner, _, steps, _ = make(policy="dynamic", max_wait=0.1)

    outs = asyncio.run(asyncio.wait_for(collect(serving, [7], 3, "lone"), 60))
    assert [t for o in outs for t in o.new_token_ids] == runner.continuation([7], 3)
    assert steps[0].start == pytest.approx(0.1)  # arrived at 0, admitted when max_wait ran out


def test_prefix_cache_reset_happens_between_steps_and_a_repeat_then_hits_nothing():
    """A prompt sent twice hits the prefix cache the second time; after reset_prefix_cache()
    (what a replica does when a run begins) the same prompt is computed whole again."""
    serving, *_ = make(slots=2, kv_cache="paged", prefix_caching=True)
    scheduler = serving.engine.scheduler
    prompt = list(range(100, 164))

    async def main():
        await collect(serving, prompt, 2, "a")
        cold = scheduler.num_prefix_cached_tokens
        await collect(serving, prompt, 2, "b")
        warm = scheduler.num_prefix_cached_tokens
        serving.reset_prefix_cache()
        await collect(serving, prompt, 2, "c")
        return cold, warm, scheduler.num_prefix_cached_tokens

    cold, warm, after_reset = asyncio.run(asyncio.wait_for(main(), 60))
    assert cold == 0 and warm == 48 and after_reset == warm


def test_build_engine_picks_the_fake_model():
    """ReplicaConfig.fake_step_seconds serves the flat-cost fake model (no weights loaded)."""
    engine = build_engine(ReplicaConfig(fake_step_seconds=0.01))
    assert isinstance(engine.runner, ScriptedFakeRunner) and engine.runner.cost.step_seconds == 0.01
    with pytest.raises(ValueError):
        ReplicaConfig(fake_step_seconds=0)


def test_a_work_priced_fake_replica_pays_for_prefill_and_not_for_cached_blocks():
    """ReplicaConfig.fake_cost serves the fake model with each step priced by its work: a step
    prefilling a prompt takes c_prefill per token longer, and the same prompt again (its blocks
    in the prefix cache) takes less. The config travels as JSON (to Ray actors and Serve)
    intact, and a flat step and a work price are not given together."""
    cost = LinearCostModel(c0=0.001, c_decode=0.0, c_prefill=0.0004, c_ctx=0.0, c_held=0.0)
    engine_config = EngineConfig(num_slots=2, max_seq_len=256, kv_cache="paged", prefix_caching=True)
    config = ReplicaConfig.model_validate(ReplicaConfig(engine=engine_config, fake_cost=cost).model_dump())
    engine = build_engine(config)
    assert engine.runner.cost == cost and config.fake

    def first_step_seconds(request_id: str) -> float:
        engine.add_request(list(range(100, 196)), {"max_tokens": 1, "ignore_eos": True}, request_id)
        start = engine.clock.now()
        engine.step()
        elapsed = engine.clock.now() - start
        while engine.has_unfinished:
            engine.step()
        return elapsed

    cold, warm = first_step_seconds("a"), first_step_seconds("b")
    assert cold >= 0.001 + 96 * 0.0004 * 0.9  # every prompt token prefilled
    assert warm < cold - 64 * 0.0004  # most blocks came from the cache
    with pytest.raises(ValueError, match="not both"):
        ReplicaConfig(fake_step_seconds=0.01, fake_cost=cost)
