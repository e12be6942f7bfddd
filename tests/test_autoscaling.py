"""Autoscaling policies on a fake clock: each policy's rule (target_ongoing's ceil and delays,
queue_slo's up and down conditions, predictive's forecast), the shared bounds (min and max,
the cooldown, never draining below what holds the requests in the cluster), the registry's
refusal of an unknown name, the diurnal workload's shape, and a simulated cluster that grows
with a step in load and shrinks after it for fewer replica-seconds than static peak."""

from __future__ import annotations

import dataclasses
import random

import pytest
from pydantic import ValidationError

from autoscaling.policies import AUTOSCALING_POLICIES, AutoscaleConfig, make_autoscaling_policy
from protocol.clock import FakeClock
from protocol.messages import LoadReport
from protocol.registry import UnknownChoiceError
from protocol.scaling import ArrivalWindow, ScalingObservation
from replica.config import EngineConfig
from replica.model.fake import FlatCostModel
from sim.autoscaling import AutoscalingSimulator, static_replica_seconds
from sim.simulator import SimulationConfig, measure_capacity, simulate
from workloads.capacity import Capacity
from workloads.diurnal import DiurnalArrivals, DiurnalDay
from workloads.workload import Workload, WorkloadRequest

SLOTS = 8
CAPACITY = Capacity(decode_tokens_per_s=100.0)  # a request of 10 output tokens is 0.1 s of one replica


def report(i: int, running: int = 0, queued: int = 0, slots: int = SLOTS) -> LoadReport:
    return LoadReport(f"r{i}", queued, running, slots - running, slots, 10_000, 0.0)


def observe(
    reports: list[LoadReport], requests: int = 0, start: float = 0.0, end: float = 1.0, starting: int = 0
) -> ScalingObservation:
    return ScalingObservation(
        len(reports), tuple(reports), ArrivalWindow(start, end, requests, 0, 10 * requests), starting
    )


def policy(name: str, clock: FakeClock, capacity: Capacity | None = CAPACITY, **bounds_and_params):
    bounds = {
        k: bounds_and_params.pop(k) for k in ("min_replicas", "max_replicas", "cooldown_s") if k in bounds_and_params
    }
    config = AutoscaleConfig(policy=name, **{"max_replicas": 16, "cooldown_s": 0.0, **bounds}, params=bounds_and_params)
    return make_autoscaling_policy(config, clock, capacity)


# ---- target_ongoing -------------------------------------------------------------------------
def test_target_ongoing_is_the_ceil_of_ongoing_over_target():
    """9 ongoing requests at a target of 4 want 3 replicas, 8 want exactly 2 (no rounding up an
    exact quotient); queued requests count as ongoing."""
    clock = FakeClock()
    p = policy("target_ongoing", clock, target_ongoing_requests=4, upscale_delay_s=0, look_back_s=0.5)
    assert p.decide(observe([report(0, running=8, queued=1)])).desired == 3
    clock.advance(1)
    p = policy("target_ongoing", clock, target_ongoing_requests=4, upscale_delay_s=0, look_back_s=0.5)
    assert p.decide(observe([report(0, running=5, queued=3)])).desired == 2


def test_target_ongoing_acts_only_once_the_wish_held_its_delay():
    """Up after upscale_delay_s of wanting up, with the latest wish; a period on target
    restarts the count; down only after downscale_delay_s."""
    clock = FakeClock()
    p = policy(
        "target_ongoing", clock, target_ongoing_requests=2, upscale_delay_s=3, downscale_delay_s=10, look_back_s=0.5
    )
    busy = [report(0, running=6)]  # wants 3
    for _ in range(3):
        assert p.decide(observe(busy)).desired == 1
        clock.advance(1)
    assert p.decide(observe([report(0, running=8)])).desired == 4  # held 3 s: acts with the latest wish (ceil 8/2)

    clock = FakeClock()
    p = policy(
        "target_ongoing", clock, target_ongoing_requests=2, upscale_delay_s=3, downscale_delay_s=10, look_back_s=0.5
    )
    p.decide(observe(busy))
    clock.advance(2)
    assert p.decide(observe([report(0, running=2)])).desired == 1  # on target: the wish is dropped
    clock.advance(1)
    p.decide(observe(busy))
    clock.advance(2)
    assert p.decide(observe(busy)).desired == 1  # held 2 s since it came back, not 5
    clock.advance(1)
    assert p.decide(observe(busy)).desired == 3

    quiet = [report(i, running=1) for i in range(4)]  # 4 ongoing on 4 replicas wants 2
    for _ in range(10):
        clock.advance(1)
        assert p.decide(observe(quiet)).desired == 4
    clock.advance(1)
    assert p.decide(observe(quiet)).desired == 2


def test_target_ongoing_averages_over_its_look_back():
    """A one-period spike is averaged with the periods before it inside look_back_s."""
    clock = FakeClock()
    p = policy("target_ongoing", clock, target_ongoing_requests=4, upscale_delay_s=0, look_back_s=3)
    for _ in range(3):
        assert p.decide(observe([report(0, running=2)])).desired == 1
        clock.advance(1)
    decision = p.decide(observe([report(0, running=8, queued=6)]))  # (2 + 2 + 2 + 14) / 4 = 5 -> 2
    assert decision.inputs["ongoing_avg"] == pytest.approx(5.0) and decision.desired == 2


# ---- queue_slo ------------------------------------------------------------------------------
def test_queue_slo_scales_up_when_the_predicted_ttft_nears_the_slo():
    """Work 0.1 s a request: 4 waiting per replica predict 0.4 s, under half a 1 s SLO; 6 predict
    0.6 s, over it, and the replicas that bring it back to 0.5 s are asked for (ceil(2 x 0.6 /
    0.5) = 3)."""
    clock = FakeClock()
    p = policy("queue_slo", clock, ttft_slo_s=1.0, up_at=0.5)
    calm = p.decide(observe([report(0, 8, 4), report(1, 8, 4)], requests=10))
    assert calm.desired == 2 and calm.inputs["predicted_ttft"] == pytest.approx(0.4)
    clock.advance(1)
    hot = p.decide(observe([report(0, 8, 6), report(1, 8, 6)], requests=10))
    assert hot.inputs["predicted_ttft"] == pytest.approx(0.6) and hot.desired == 3
    clock.advance(1)
    assert p.decide(observe([report(0, 8, 6), report(1, 8, 6)], requests=10, starting=1)).desired == 3  # already asked


def test_queue_slo_scales_down_only_after_every_replica_had_headroom_for_its_time():
    """Headroom: nothing waiting and at most half the slots busy. Four replicas running 2 each
    for down_after_s fit in 2 (8 running at 4 a replica); one replica without headroom restarts
    the wait."""
    clock = FakeClock()
    p = policy("queue_slo", clock, headroom=0.5, down_after_s=5)
    roomy = [report(i, running=2) for i in range(4)]
    for _ in range(3):
        assert p.decide(observe(roomy)).desired == 4
        clock.advance(1)
    assert p.decide(observe([*roomy[:3], report(3, running=6)])).desired == 4
    for _ in range(5):
        clock.advance(1)
        assert p.decide(observe(roomy)).desired == 4
    clock.advance(1)
    decision = p.decide(observe(roomy))
    assert decision.desired == 2 and "headroom" in decision.reason


# ---- predictive -----------------------------------------------------------------------------
def test_predictive_sizes_for_the_forecast_load_plus_headroom():
    """20 requests/s of 0.1 s work is a load of 2 replicas; with 25% headroom, 3."""
    clock = FakeClock()
    p = policy("predictive", clock, window_s=10, horizon_s=5, headroom=0.25)
    for t in range(10):
        clock.advance(1)
        decision = p.decide(observe([report(0)], requests=20, start=t, end=t + 1))
    assert decision.inputs["load_mean"] == pytest.approx(2.0) and decision.desired == 3


def test_predictive_follows_a_rising_trend_past_its_horizon():
    """Arrivals rising by 10 requests/s each second (load +1 a second): the trend line 5 s ahead
    is above the window's mean, and the decision follows the trend."""
    clock = FakeClock()
    p = policy("predictive", clock, window_s=5, horizon_s=5, headroom=0.0)
    for t in range(5):
        clock.advance(1)
        decision = p.decide(observe([report(0)], requests=10 * (t + 1), start=t, end=t + 1))
    # loads 1..5 at midpoints 0.5..4.5: the line is load = t + 0.5, so 10.5 at t = 10
    assert decision.inputs["load_mean"] == pytest.approx(3.0)
    assert decision.inputs["load_trend"] == pytest.approx(10.5) and decision.desired == 11


def test_predictive_looks_at_least_one_measured_cold_start_ahead():
    """The same rising arrivals as above with a 5 s horizon, but replicas took 15 s to start:
    one asked for now serves no sooner, so the trend is read 15 s ahead (load 20.5, not 10.5)."""
    clock = FakeClock()
    p = policy("predictive", clock, window_s=5, horizon_s=5, headroom=0.0)
    for t in range(5):
        clock.advance(1)
        obs = observe([report(0)], requests=10 * (t + 1), start=t, end=t + 1)
        decision = p.decide(dataclasses.replace(obs, cold_start_s=15.0))
    assert decision.inputs["horizon_s"] == 15.0
    assert decision.inputs["load_trend"] == pytest.approx(20.5) and decision.desired == 16


def test_predictive_counts_waiting_work_over_its_horizon():
    """No arrivals in the window but 40 requests of 0.1 s waiting: 4 s of work to clear in a
    2 s horizon is 2 replicas."""
    clock = FakeClock()
    p = policy("predictive", clock, window_s=10, horizon_s=2, headroom=0.0)
    p.decide(observe([report(0)], requests=1, start=0, end=1))  # one arrival sets the mean work
    clock.advance(1)
    decision = p.decide(observe([report(0, running=8, queued=20), report(1, running=8, queued=20)], start=1, end=2))
    assert decision.inputs["load_backlog"] == pytest.approx(2.0)


# ---- the shared bounds ------------------------------------------------------------------------
def test_the_count_stays_within_min_and_max():
    clock = FakeClock()
    p = policy("predictive", clock, min_replicas=2, max_replicas=4, window_s=5, horizon_s=1, headroom=0.0)
    up = p.decide(observe([report(0), report(1)], requests=100))  # load 10
    assert up.desired == 4 and "max_replicas" in up.reason
    clock.advance(10)
    down = p.decide(observe([report(i) for i in range(4)], start=9, end=10))  # nothing arrives
    assert down.desired == 2 and "min_replicas" in down.reason


def test_a_scale_down_never_leaves_waiting_requests_the_kept_replicas_cannot_hold():
    """The policy wants 1 replica, but 20 requests are in the cluster and a replica has 8 slots:
    3 stay."""
    clock = FakeClock()
    p = policy("predictive", clock, window_s=5, horizon_s=100, headroom=0.0)
    reports = [report(0, running=8, queued=4), report(1, running=8), report(2), report(3)]
    decision = p.decide(observe(reports, requests=1))
    assert decision.inputs["wanted"] == 1 and decision.desired == 3 and "20 requests" in decision.reason


def test_the_cooldown_holds_back_scale_downs_but_never_scale_ups():
    clock = FakeClock()
    p = policy("predictive", clock, cooldown_s=10, window_s=1, horizon_s=1, headroom=0.0)
    assert p.decide(observe([report(0)], requests=30)).desired == 3  # up at t=0
    clock.advance(5)
    held = p.decide(observe([report(i) for i in range(3)], requests=10, start=4, end=5))
    assert held.desired == 3 and "cooldown" in held.reason
    clock.advance(1)
    assert p.decide(observe([report(i) for i in range(3)], requests=50, start=5, end=6)).desired == 5
    clock.advance(10)
    assert p.decide(observe([report(i) for i in range(5)], requests=10, start=15, end=16)).desired == 1


# ---- the registry and configuration -----------------------------------------------------------
def test_an_unknown_policy_name_is_refused_with_the_choices():
    with pytest.raises(UnknownChoiceError, match="unknown autoscaling policy 'nope'; choose one of target_ongoing"):
        AUTOSCALING_POLICIES["nope"]
    with pytest.raises(ValidationError, match="unknown autoscaling policy 'nope'"):
        AutoscaleConfig(policy="nope")


def test_a_policy_refuses_unknown_parameters_bad_bounds_and_a_missing_capacity():
    clock = FakeClock()
    with pytest.raises(ValidationError, match="target_ongoing_request"):
        make_autoscaling_policy(AutoscaleConfig(policy="target_ongoing", params={"target_ongoing_request": 2}), clock)
    with pytest.raises(ValidationError, match="max_replicas"):
        AutoscaleConfig(policy="predictive", min_replicas=4, max_replicas=2)
    with pytest.raises(ValueError, match="needs one replica's capacity"):
        make_autoscaling_policy(AutoscaleConfig(policy="predictive"), clock)


# ---- the diurnal workload -------------------------------------------------------------------
def test_a_diurnal_day_peaks_at_midday_and_its_seed_changes_the_traffic():
    arrivals = DiurnalArrivals(rate=20, day_s=200, peak_to_trough=4, bursts=0)
    day = DiurnalDay(arrivals=arrivals, seed=1).build()
    times = [r.arrival for r in day.requests]
    edges = sum(1 for t in times if t < 20 or t >= 180)
    midday = sum(1 for t in times if 80 <= t < 120)
    assert 3 < midday / edges < 5  # a cosine from 1x to 4x: these windows' rates are about 1.1x and 3.9x
    assert len(times) == pytest.approx(20 * 200, rel=0.1)
    assert DiurnalDay(arrivals=arrivals, seed=1).build().requests == day.requests
    assert DiurnalDay(arrivals=arrivals, seed=2).build().requests != day.requests
    bursty = arrivals.replace(bursts=2, burst_s=10, burst_factor=3)
    assert bursty.mean_rate == pytest.approx(20 * (1 + 2 * 10 * 2 / 200))


# ---- in the simulator -----------------------------------------------------------------------
def step_load() -> Workload:
    """5 requests/s for 30 s, 60 for 40 s, 5 for 60 s: Poisson, 8-token prompts, 10-token outputs."""
    rng = random.Random(7)
    requests, t = [], 0.0
    for rate, until in ((5.0, 30.0), (60.0, 70.0), (5.0, 130.0)):
        while True:
            gap = rng.expovariate(rate)
            if t + gap >= until:
                t = until
                break
            t += gap
            requests.append(WorkloadRequest(t, 8, 10))
    return Workload("step", 0, requests)


def test_a_simulated_cluster_follows_a_step_in_load_up_and_back_down():
    """Flat 20 ms steps and 4 slots: a replica serves 20 requests/s of this work, so the step
    needs 3-4 replicas and the quiet parts 1. The predictive policy grows the cluster during
    the step and shrinks it after; replicas started take traffic only after their cold start,
    drained ones get no request after their drain began; every request is served, for fewer
    replica-seconds than a static cluster sized for the step (its 3 replicas of work at 75%)."""
    engine = EngineConfig(num_slots=4, max_seq_len=64)
    cost = FlatCostModel(0.02)
    capacity = measure_capacity(SimulationConfig(num_replicas=1, engine=engine), cost)
    autoscale = AutoscaleConfig(
        policy="predictive", min_replicas=1, max_replicas=8, cooldown_s=5, params={"window_s": 10, "horizon_s": 5}
    )
    workload = step_load()
    run = AutoscalingSimulator(
        workload, SimulationConfig(num_replicas=1, engine=engine), autoscale, cost, capacity, cold_start_s=3
    ).simulate()
    assert all(t.finish_reason == "length" for t in run.simulation.traces)

    def replicas_at(t: float) -> int:
        return next(d for d in reversed(run.decisions) if d.time <= t).desired

    assert replicas_at(25) == 1 and replicas_at(65) >= 3 and replicas_at(125) == 1
    spans = {s.replica_id: s for s in run.spans}
    for decision in run.simulation.decisions:
        span = spans[decision.replica_id]
        assert span.ready <= decision.time and (span.drain_started is None or decision.time < span.drain_started)
    assert any(s.drain_started is not None for s in run.spans) and any(s.requested > 0 for s in run.spans)

    static = simulate(workload, SimulationConfig(num_replicas=4, engine=engine), cost)
    assert run.replica_seconds < 0.75 * static_replica_seconds(static)
