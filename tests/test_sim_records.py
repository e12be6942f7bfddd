"""What a simulation keeps: bounded per-replica decision figures and the lean mode
(`keep_records=False`) change what is stored, never what is simulated."""

from __future__ import annotations

import pytest

from autoscaling.policies import AutoscaleConfig
from metrics.store import open_store
from replica.config import EngineConfig
from replica.errors import ConfigError
from replica.model.fake import FlatCostModel
from sim.autoscaling import AutoscalingSimulator, run_end
from sim.simulator import SimulationConfig, Simulator, measure_capacity, record_simulation, simulate
from workloads.standard import heavy_tail_spec, long_prompts
from workloads.workload import Workload, WorkloadRequest

# A K/V budget below 4 full slots of the paged cache: long prompts grow blocks and preempt.
ENGINE = EngineConfig(
    policy="chunked", num_slots=4, max_seq_len=640, token_budget=64, kv_budget_tokens=1200, kv_cache="paged"
)
CONFIG = SimulationConfig(num_replicas=4, routing_policy="least_loaded", engine=ENGINE)
COST = FlatCostModel(0.02)


def workload() -> Workload:
    """Long prompts on the paged cache's small budget: blocks grow and requests are preempted."""
    return long_prompts(120, rate=40.0, seed=3)


@pytest.mark.parametrize("make", [workload, lambda: heavy_tail_spec(120, rate=20.0, seed=3).build()])
def test_a_lean_run_simulates_exactly_what_a_full_one_does_and_keeps_counts_only(make, tmp_path):
    """Without records the traces are the full run's, token for token; each replica's step
    count and last step end are those of its records; nothing else is kept, and the store,
    which needs the steps, refuses the run."""
    full = simulate(make(), CONFIG, COST)
    lean = Simulator(make(), CONFIG, COST, keep_records=False).run()
    assert lean.traces == full.traces
    assert lean.step_counts == {r: len(steps) for r, steps in full.steps.items()}
    assert lean.step_ends == {r: steps[-1].start + steps[-1].duration for r, steps in full.steps.items() if steps}
    assert full.records_kept and full.token_ids and full.decisions
    assert not lean.records_kept and lean.decisions == [] and lean.token_ids == {}
    assert all(steps == [] for steps in lean.steps.values())
    with pytest.raises(ConfigError, match="keep_records"):
        record_simulation(open_store(tmp_path / "m.db"), lean)


def test_decision_figures_are_kept_up_to_the_bound_then_only_the_choice():
    """Past `max_decision_figures`, a decision keeps its chosen replica's score and in-flight
    count alone (the rest as in an unbounded run); the decisions before keep every figure, and
    the routing is unchanged."""
    full = simulate(workload(), CONFIG, COST)
    assert any(t.num_preemptions for t in full.traces)
    bounded = Simulator(workload(), CONFIG, COST, max_decision_figures=100).run()
    assert bounded.traces == full.traces
    assert len(bounded.decisions) == len(full.decisions)
    figures = [len(d.scores) + len(d.in_flight) for d in full.decisions]
    assert set(figures) == {8}  # 4 replicas scored in every decision: 12 decisions fit in 100 figures
    cut = next(i for i, (whole, part) in enumerate(zip(full.decisions, bounded.decisions)) if part != whole)
    kept = sum(figures[:cut])  # the figures kept when the first decision is cut
    assert cut == 12 and kept == 96 and kept + figures[cut] > 100
    for whole, part in zip(full.decisions[cut:], bounded.decisions[cut:]):
        chosen = whole.replica_id
        assert part.scores == {chosen: whole.scores[chosen]} and part.in_flight == {chosen: whole.in_flight[chosen]}
        assert (part.request_id, part.replica_id, part.predicted_ttft) == (
            whole.request_id,
            chosen,
            whole.predicted_ttft,
        )
    with pytest.raises(ConfigError, match="max_decision_figures"):
        Simulator(workload(), CONFIG, COST, max_decision_figures=-1)


def step_day() -> Workload:
    """Quiet, four times busier, quiet: the cluster grows, then drains replicas."""
    requests, t = [], 0.0
    for until, gap in ((10.0, 0.1), (30.0, 0.0125), (70.0, 0.1)):
        while t < until:
            requests.append(WorkloadRequest(t, 8, 10))
            t += gap
    return Workload("step", 0, requests)


def test_a_lean_autoscaled_run_accounts_the_same_replica_seconds():
    """Drained replicas leave at their last step end, read from the counts without records:
    the spans, scaling decisions and run end are the full run's."""
    config = SimulationConfig(num_replicas=1, engine=EngineConfig(num_slots=4, max_seq_len=64))
    capacity = measure_capacity(config, COST)
    autoscale = AutoscaleConfig(
        policy="predictive", min_replicas=1, max_replicas=8, cooldown_s=5, params={"window_s": 10, "horizon_s": 5}
    )
    runs = [
        AutoscalingSimulator(
            step_day(), config, autoscale, COST, capacity, cold_start_s=3, keep_records=keep
        ).simulate()
        for keep in (True, False)
    ]
    full, lean = runs
    assert any(s.drain_started is not None for s in full.spans) and full.peak_replicas > 2
    assert lean.spans == full.spans and lean.decisions == full.decisions
    assert lean.simulation.traces == full.simulation.traces
    assert run_end(lean.simulation) == run_end(full.simulation) == full.end
