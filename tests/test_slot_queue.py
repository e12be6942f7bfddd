"""The slot-queue model of an autoscaled cluster (`sim.slot_queue`): its queue, its routing, its
cold starts and drains, its agreement with the step simulator on one day, and the array draws
of a day's traffic it reads."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from autoscaling.policies import AutoscaleConfig
from metrics.definitions import SLO
from protocol.cost import LinearCostModel
from replica.config import EngineConfig
from replica.errors import ConfigError
from sim.autoscaling import AutoscalingSimulator
from sim.cost_model import FittedCostModel
from sim.simulator import SimulationConfig, measure_capacity
from sim.slot_queue import SlotQueueCluster
from workloads.arrivals import DiurnalArrivals
from workloads.diurnal import DiurnalDay
from workloads.lengths import LognormalLength, MixtureLength, UniformLength
from workloads.workload import WorkloadColumns

STEP = LinearCostModel(c0=0.1, c_decode=0.0, c_prefill=0.0, c_ctx=0.0, c_held=0.0)
COST_MODEL = Path(__file__).resolve().parent.parent / "workloads" / "experiments" / "cost_model.json"


def columns(*requests: tuple[float, int, int]) -> WorkloadColumns:
    times, prompts, outputs = zip(*requests)
    return WorkloadColumns(np.array(times), np.array(prompts), np.array(outputs))


def fixed(replicas: int) -> AutoscaleConfig:
    """A cluster that never changes size: target_ongoing between `replicas` and `replicas`."""
    return AutoscaleConfig(policy="target_ongoing", min_replicas=replicas, max_replicas=replicas)


def eager() -> AutoscaleConfig:
    """Up to 4 replicas, 4 ongoing requests each, acting on every wish at once (no delays, no cooldown)."""
    return AutoscaleConfig(
        policy="target_ongoing",
        min_replicas=1,
        max_replicas=4,
        cooldown_s=0.0,
        params={"target_ongoing_requests": 4, "upscale_delay_s": 0, "downscale_delay_s": 0, "look_back_s": 1},
    )


def config(replicas: int, slots: int, policy: str = "continuous") -> SimulationConfig:
    return SimulationConfig(num_replicas=replicas, engine=EngineConfig(policy=policy, num_slots=slots))


def test_a_request_waits_for_the_slot_that_frees_first():
    # one slot, steps of 0.1 s: the first request's 5 tokens end at 0.5 s, the second starts
    # then and makes its first token a step (and, behind nobody, no half step) later
    run = SlotQueueCluster(columns((0.0, 10, 5), (0.0, 10, 5)), config(1, 1), fixed(1), STEP).run()
    assert run.ttft.tolist() == pytest.approx([0.1, 0.6])
    assert run.tpot.tolist() == pytest.approx([0.1, 0.1])
    assert run.end == pytest.approx(1.0)


def test_least_loaded_sends_each_request_to_the_replica_with_fewest_ongoing():
    run = SlotQueueCluster(columns(*[(0.0, 10, 20)] * 4, (1.0, 10, 2)), config(2, 4), fixed(2), STEP).run()
    assert run.replica.tolist()[:4] == [0, 1, 0, 1]
    # a busy replica's step under way ends first: half a step before the first token
    assert run.ttft[4] == pytest.approx(0.05 + 0.1)


def test_a_prompt_longer_than_a_slot_is_refused_and_judged_unmet():
    cfg = SimulationConfig(num_replicas=1, engine=EngineConfig(policy="continuous", num_slots=2, max_seq_len=64))
    run = SlotQueueCluster(columns((0.0, 60, 10), (0.0, 10, 10)), cfg, fixed(1), STEP).run()
    assert run.replica.tolist() == [-1, 0]
    assert math.isnan(run.ttft[0])
    assert run.slo_attainment(SLO(ttft=1.0, tpot=1.0)) == 0.5


def test_a_replica_asked_for_takes_traffic_only_after_its_cold_start_and_a_drained_one_none():
    requests = columns(*[(i * 0.05, 10, 40) for i in range(400)])  # 20 s of 20 req/s on 4-slot replicas
    run = SlotQueueCluster(requests, config(1, 4), eager(), STEP, cold_start_s=3.0).run()
    assert len(run.spans) > 1, "the queue should have grown the cluster"
    for span in run.spans[1:]:
        routed = requests.arrival[run.replica == int(span.replica_id[1:])]
        if span.ready is None:
            assert routed.size == 0
            continue
        assert span.ready == pytest.approx(span.requested + 3.0)
        assert routed.size and routed.min() >= span.ready
        if span.drain_started is not None:
            assert (routed < span.drain_started).all()
    assert run.replica_seconds == pytest.approx(sum(s.ended - s.requested for s in run.spans))


def test_it_refuses_what_it_does_not_model():
    with pytest.raises(ConfigError, match="static"):
        SlotQueueCluster(columns((0.0, 10, 5)), config(1, 2, policy="static"), fixed(1), STEP)
    cfg = SimulationConfig(num_replicas=1, engine=EngineConfig(policy="chunked"), routing_policy="round_robin")
    with pytest.raises(ConfigError, match="least_loaded"):
        SlotQueueCluster(columns((0.0, 10, 5)), cfg, fixed(1), STEP)


def test_it_agrees_with_the_step_simulator_on_a_compressed_day():
    cost = FittedCostModel.load(COST_MODEL)
    engine = EngineConfig(policy="chunked", num_slots=8, max_seq_len=1536)
    cfg = SimulationConfig(num_replicas=1, engine=engine)
    capacity = measure_capacity(cfg, cost)
    arrivals = DiurnalArrivals(rate=6.0, day_s=240.0, peak_to_trough=4.0, bursts=2, burst_s=10.0, burst_factor=1.5)
    workload = DiurnalDay(arrivals=arrivals, seed=3).build()
    autoscale = AutoscaleConfig(
        policy="predictive", max_replicas=16, params={"window_s": 30.0, "horizon_s": 10.0, "headroom": 0.25}
    )
    steps = AutoscalingSimulator(workload, cfg, autoscale, cost, capacity, 5.0, keep_records=False).simulate()
    queues = SlotQueueCluster(workload.columns(), cfg, autoscale, cost, capacity, 5.0).run()
    slo = SLO(ttft=1.0, tpot=2.0)  # past the TTFTs' p90: the model's tail is thinner than the engines'
    attainment = sum(1 for t in steps.simulation.traces if slo.met_by(t)) / len(workload.requests)
    assert queues.replica_seconds == pytest.approx(steps.replica_seconds, rel=0.1)
    assert queues.slo_attainment(slo) == pytest.approx(attainment, abs=0.03)
    assert queues.peak_replicas > 1


def test_a_days_array_draws_follow_the_same_curve_and_lengths():
    arrivals = DiurnalArrivals(rate=50.0, day_s=1000.0, peak_to_trough=4.0, bursts=0)
    day = DiurnalDay(arrivals=arrivals, seed=1)
    drawn = day.columns()
    assert len(drawn) == pytest.approx(arrivals.mean_rate * 1000.0, rel=0.03)
    midday = ((drawn.arrival > 450) & (drawn.arrival < 550)).sum()
    edges = ((drawn.arrival < 50) | (drawn.arrival > 950)).sum()
    assert midday / edges == pytest.approx(4.0, rel=0.15)
    assert np.all(np.diff(drawn.arrival) >= 0)
    assert len(DiurnalDay(arrivals=arrivals, seed=2).columns()) != len(drawn)
    rng = np.random.default_rng(0)
    uniform = UniformLength(low=16, high=96).sample_array(50_000, rng)
    assert uniform.min() == 16 and uniform.max() == 96 and uniform.mean() == pytest.approx(56, rel=0.01)
    lognormal = LognormalLength(median=12, sigma=0.8, low=2, high=64).sample_array(50_000, rng)
    assert lognormal.min() >= 2 and lognormal.max() <= 64 and np.median(lognormal) == 12
    mixed = MixtureLength(components=((3, UniformLength(low=1, high=1)), (1, UniformLength(low=9, high=9))))
    assert (mixed.sample_array(40_000, rng) == 9).mean() == pytest.approx(0.25, abs=0.01)


def test_a_replica_cancelled_while_starting_takes_nothing_and_counts_until_cancelled():
    # 30 two-token requests at once on one 1-slot replica: 6 s of work; replicas asked for at
    # 1 s start for 20 s, and are cancelled when the queue has run down
    requests = columns(*[(0.0, 10, 2)] * 30, (12.0, 10, 2))
    run = SlotQueueCluster(requests, config(1, 1), eager(), STEP, cold_start_s=20.0).run()
    cancelled = [s for s in run.spans if s.ready is None]
    assert cancelled and all(s.ended < s.requested + 20.0 for s in cancelled)
    assert set(run.replica.tolist()) == {0}
