"""A real replica's step prices, fitted to its own steps (`replica.pricing`): they recover the
cost its steps really follow, count the serving loop's work between busy steps and not an idle
wait, and reach its load reports once enough steps are in, where a fake replica keeps the
prices it states, with the loop work between its steps measured beside them. Pure objects on a
fake clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from protocol.clock import FakeClock
from protocol.cost import LinearCostModel, StepFeatures, StepPricing
from protocol.records import StepRecord
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.fake import ScriptedFakeRunner
from replica.pricing import MIN_SAMPLES, LoopGap, MeasuredPricing

TRUE = LinearCostModel(c0=0.02, c_decode=0.002, c_prefill=0.0004, c_ctx=1e-6, c_held=0.0)


def _steps(n: int, gap: float) -> list[StepRecord]:
    """`n` steps of varied work, each `gap` seconds after the one before ends, priced by TRUE."""
    steps, start = [], 0.0
    for i in range(n):
        decode, prefill = 1 + i % 7, (i * 37) % 200
        context = 50 * decode + 3 * prefill + i
        duration = TRUE.predict(StepFeatures(decode, prefill, context, 0))
        steps.append(StepRecord(i, start, duration, decode, prefill, context, decode, decode + 1, decode + 1, 0, 0))
        start += duration + gap
    return steps


def test_fit_recovers_the_cost_the_steps_follow_and_none_before_enough_steps():
    measured = MeasuredPricing(token_budget=256)
    for step in _steps(MIN_SAMPLES, gap=0.0):
        measured.observe(step, goes_on=True)
    assert measured.pricing is None  # the last step is not priced until the next one starts
    measured.observe(_steps(MIN_SAMPLES + 1, gap=0.0)[-1], goes_on=True)
    assert measured.pricing is not None and measured.pricing.token_budget == 256
    for fitted, true in zip(measured.pricing.cost.coefficients, TRUE.coefficients):
        assert fitted == pytest.approx(true, rel=1e-6, abs=1e-9)


def test_busy_steps_price_the_loop_between_them_and_idle_waits_do_not():
    """Steps the loop went on from at once are timed start to start, so 3 ms of loop work a
    step lands in c0; steps each followed by a second's idle wait are timed alone."""
    busy, idle = MeasuredPricing(None), MeasuredPricing(None)
    for step in _steps(4 * MIN_SAMPLES, gap=0.003):
        busy.observe(step, goes_on=True)
    for step in _steps(4 * MIN_SAMPLES, gap=1.0):
        idle.observe(step, goes_on=True)
    assert busy.pricing.cost.c0 == pytest.approx(TRUE.c0 + 0.003, rel=1e-6)
    assert idle.pricing.cost.c0 == pytest.approx(TRUE.c0, rel=1e-6)


def test_a_step_the_engine_had_nothing_after_is_timed_alone():
    """A loop that found nothing to do after a step waits for an arrival, however soon it came:
    that wait is not the step's."""
    measured = MeasuredPricing(None)
    for step in _steps(4 * MIN_SAMPLES, gap=0.003):
        measured.observe(step, goes_on=False)
    assert measured.pricing.cost.c0 == pytest.approx(TRUE.c0, rel=1e-6)


def test_a_long_run_of_decode_alone_keeps_what_a_prompt_costs():
    """Many more decode-only steps than the window holds, after steps that prefilled: the
    prefill price is still fitted from those, not taken as free."""
    measured = MeasuredPricing(None, window=64)
    for step in _steps(64, gap=0.0):
        measured.observe(step, goes_on=True)
    start = 100.0
    for i in range(300):
        decode, context = 1 + i % 7, 60 * (1 + i % 7) + i
        duration = TRUE.predict(StepFeatures(decode, 0, context, 0))
        measured.observe(StepRecord(64 + i, start, duration, decode, 0, context, decode, decode, decode, 0, 0), True)
        start += duration
    assert measured.pricing.cost.c_prefill == pytest.approx(TRUE.c_prefill, rel=1e-3)


@dataclass(frozen=True)
class _UnstatedCost:
    """A runner's cost that is no `LinearCostModel`, so the runner states no prices, as a real
    model states none; its steps still take TRUE's time on the clock."""

    def step_time(self, out) -> float:
        return TRUE.step_time(out)


def _engine(cost) -> Engine:
    clock = FakeClock()
    config = EngineConfig(policy="chunked", num_slots=4, max_seq_len=256, token_budget=64)
    return Engine(config, ScriptedFakeRunner(clock, cost), clock)


def test_a_replica_that_states_no_prices_reports_the_ones_its_steps_measure():
    engine = _engine(_UnstatedCost())
    assert engine.load_report("r0").pricing is None
    for i in range(40):
        prompt = list(range(5 + 7 * (i % 20)))
        engine.add_request(prompt, {"max_tokens": 3 + i % 5, "ignore_eos": True}, request_id=f"q{i}")
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    assert steps > MIN_SAMPLES + 1
    pricing = engine.load_report("r0").pricing
    assert pricing is not None and pricing.token_budget == 64
    probe = StepFeatures(decode_tokens=3, prefill_tokens=40, context_tokens=300, padding_rows=0)
    assert pricing.cost.predict(probe) == pytest.approx(TRUE.predict(probe), rel=0.01)


def test_a_fake_replica_keeps_the_prices_it_states():
    engine = _engine(TRUE)
    assert engine.measured_pricing is None
    assert engine.load_report("r0").pricing.cost == TRUE


def test_a_fake_replica_states_its_prices_with_the_loop_work_between_its_steps():
    """Stated prices cover a step's work alone: the loop's own time between steps run back to
    back is measured beside them (`LoopGap`) and stated with them on the load report; a gap
    the engine had nothing to do before, or an idle wait, is not loop work."""
    gap = LoopGap()
    for step in _steps(40, gap=0.003):
        gap.observe(step, goes_on=True)
    assert gap.seconds == pytest.approx(0.003)
    for goes_on, wait in ((False, 0.003), (True, 1.0)):
        other = LoopGap()
        for step in _steps(40, gap=wait):
            other.observe(step, goes_on=goes_on)
        assert other.seconds == 0.0

    clock = FakeClock()
    config = EngineConfig(policy="chunked", num_slots=2, max_seq_len=64, token_budget=32)
    engine = Engine(config, ScriptedFakeRunner(clock, TRUE), clock)
    engine.add_request(list(range(20)), {"max_tokens": 6, "ignore_eos": True}, request_id="a", arrival_time=0.0)
    for _ in range(4):
        engine.step()
        clock.sleep(0.002)  # the serving loop's own work after each step
    report = engine.load_report("r0")
    assert report.pricing == StepPricing(TRUE, 32, loop_overhead=pytest.approx(0.002))
