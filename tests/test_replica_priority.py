"""A replica's scheduler orders by priority (lower first, as vLLM's `priority`): a more urgent
request is admitted before less urgent ones that came earlier, and takes the place of a less
urgent running one when no slot or K/V is free; equal priorities keep first-come order. On a
scripted fake model and a fake clock, with `check_invariants()` after every step."""

from __future__ import annotations

import pytest

from protocol.clock import FakeClock
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.fake import ScriptedFakeRunner
from replica.scheduling.request import FinishReason


def _engine(num_slots: int, **config) -> Engine:
    clock = FakeClock()
    runner = ScriptedFakeRunner(clock, vocab_size=50)
    return Engine(EngineConfig(policy="continuous", num_slots=num_slots, max_seq_len=64, **config), runner, clock)


def _run(engine: Engine) -> list[str]:
    """Step to the end; the request ids in the order they finished."""
    finished = []
    while engine.has_unfinished:
        result = engine.step()
        engine.scheduler.check_invariants()
        finished += [o.request_id for o in result.outputs if o.finished]
    return finished


def _add(engine: Engine, request_id: str, priority: int, max_tokens: int = 4) -> None:
    engine.add_request([1, 2, 3], {"max_tokens": max_tokens, "ignore_eos": True, "priority": priority}, request_id)


def test_a_more_urgent_request_is_admitted_before_earlier_less_urgent_ones():
    engine = _engine(num_slots=1)
    for i in range(3):
        _add(engine, f"batch-{i}", priority=2)
    _add(engine, "urgent", priority=0)
    _add(engine, "middle", priority=1)
    assert [r.request_id for r in engine.scheduler.waiting] == ["urgent", "middle", "batch-0", "batch-1", "batch-2"]
    assert _run(engine) == ["urgent", "middle", "batch-0", "batch-1", "batch-2"]


def test_equal_priorities_keep_first_come_order():
    engine = _engine(num_slots=1)
    for i in range(4):
        _add(engine, f"r{i}", priority=1)
    assert _run(engine) == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("cache", [{}, {"kv_cache": "paged", "block_size": 4}])
def test_an_urgent_request_preempts_the_least_urgent_running_one_and_it_resumes_whole(cache):
    """Both slots are taken by long batch requests; an urgent one arrives: the youngest of the
    least urgent goes back to the queue (at the front of its band), the urgent one runs and
    finishes first, and the preempted one still makes all its tokens."""
    engine = _engine(num_slots=2, **cache)
    _add(engine, "batch-old", priority=2, max_tokens=20)
    _add(engine, "standard", priority=1, max_tokens=20)
    for _ in range(3):
        engine.step()
        engine.scheduler.check_invariants()
    _add(engine, "urgent", priority=0, max_tokens=3)
    requests = dict(engine.requests)  # an engine forgets a request once it ends
    result = engine.step()
    engine.scheduler.check_invariants()
    assert [r.request_id for r in engine.scheduler.running] == ["standard", "urgent"]
    assert requests["batch-old"].num_preemptions == 1
    finished = [o.request_id for o in result.outputs if o.finished] + _run(engine)
    assert finished[0] == "urgent"
    assert all(r.finish_reason == FinishReason.LENGTH for r in requests.values())
    assert len(requests["batch-old"].output_token_ids) == 20


def test_no_preemption_among_equals_or_for_a_less_urgent_arrival():
    engine = _engine(num_slots=1)
    _add(engine, "running", priority=1, max_tokens=6)
    running = engine.requests["running"]
    engine.step()
    _add(engine, "same", priority=1)
    _add(engine, "lower", priority=2)
    assert _run(engine) == ["running", "same", "lower"]
    assert running.num_preemptions == 0
