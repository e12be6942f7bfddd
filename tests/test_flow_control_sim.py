"""Flow control in the simulator: the flood workload at small scale, FCFS against priority +
VTC on the same traffic. No Ray; the flow controller's invariants are checked at every turn of
the event loop."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from metrics.definitions import percentiles
from protocol.flow import FlowConfig, SaturationConfig
from replica.config import EngineConfig
from replica.model.fake import FlatCostModel
from sim.simulator import SimulationConfig, Simulator, measure_capacity
from workloads.standard import flood_spec


class CheckedSimulator(Simulator):
    """The simulator with every router's flow controller checked after each release."""

    def _release_held(self, now: float) -> None:
        super()._release_held(now)
        for router in self.routers:
            router.flow.check_invariants()


@pytest.fixture(scope="module")
def runs():
    base = SimulationConfig(num_replicas=2, engine=EngineConfig(num_slots=4, max_seq_len=512), dispatch_delay=0.002)
    cost = FlatCostModel(0.01)
    workload = flood_spec(duration=12.0).at_load(1.0, measure_capacity(base, cost)).build()
    results = {}
    for policy in ("fcfs", "vtc"):
        flow = FlowConfig(policy=policy, max_wait={2: 30.0}, saturation=SaturationConfig(queue_depth=1))
        config = base.model_copy(update={"flow": flow})
        results[policy] = CheckedSimulator(workload, config, cost, check_invariants=True).run()
    # Before request classes: the same traffic with no priority (every request in band 0), no flow control.
    classless = replace(workload, requests=[replace(r, priority=0) for r in workload.requests])
    results["classless"] = Simulator(classless, base, cost, check_invariants=True).run()
    return workload, results


def test_priority_keeps_the_interactive_class_fast_under_a_flood(runs):
    """Under a 2.5x flood in the batch band, the interactive tenant's TTFT p90 is far below what
    it was with no request classes, where it waits behind the flood: with vtc (strict priority
    between bands at the router), and with fcfs at the router too, whose replicas still admit
    by priority (and preempt for it)."""
    _, results = runs
    p90 = {
        policy: percentiles(t.ttft for t in result.traces if t.tenant == "interactive" and t.ttft is not None)["p90"]
        for policy, result in results.items()
    }
    assert p90["vtc"] < 0.25 * p90["classless"], p90
    assert p90["fcfs"] < 0.25 * p90["classless"], p90


def test_every_request_ends_once_finished_or_rejected_with_a_reason(runs):
    """Nothing is lost silently: each workload request has exactly one trace, with its class,
    ending finished or rejected, and each rejected one has its reason."""
    workload, results = runs
    for result in results.values():
        ids = [t.request_id for t in result.traces]
        assert len(ids) == len(set(ids)) == len(workload.requests)
        endings = Counter(t.finish_reason for t in result.traces)
        assert set(endings) <= {"length", "rejected"}, endings
        for trace in result.traces:
            assert trace.tenant == result.arrivals[trace.request_id].spec.tenant
            if trace.finish_reason == "rejected":
                assert result.errors[trace.request_id]
            else:
                assert trace.num_output_tokens == result.arrivals[trace.request_id].spec.output_len


def test_flow_sweep_runs_each_policy_over_the_table_and_leaves_serve_without_flow_control():
    """sweep.flow makes one cell per policy over the [flow] table; a cell routed by Ray Serve's
    router gets none (Serve has no flow control: the peer), and --simulate leaves it out."""
    from experiments.plan import plan_experiment

    plan = plan_experiment("workloads/experiments/flow-control.toml", seeds=[0])
    flows = {(c.routing, c.flow): plan.flow(c) for c in plan.cells}
    assert set(flows) == {("least_loaded", p) for p in ("fcfs", "priority", "vtc")} | {("serve_power_of_two", "")}
    assert flows["serve_power_of_two", ""] is None
    assert flows["least_loaded", "vtc"].policy == "vtc" and flows["least_loaded", "vtc"].max_held == 1000
    assert {c.routing for c in plan_experiment("workloads/experiments/flow-control.toml", simulate=True).cells} == {
        "least_loaded"
    }


def test_a_bad_flow_table_names_the_file_line_and_key(tmp_path):
    """A bad value in an experiment's [flow] table is an ExperimentError at its file, line and key."""
    from experiments.plan import plan_experiment
    from workloads.experiment import ExperimentError

    text = open("workloads/experiments/flow-control.toml").read().replace("max_held = 1000", 'max_held = "many"')
    (tmp_path / "cost_model.json").write_text(open("workloads/experiments/cost_model.json").read())
    path = tmp_path / "flow.toml"
    path.write_text(text)
    line = text.splitlines().index('max_held = "many"') + 1
    with pytest.raises(ExperimentError, match=rf"flow\.toml:{line}: flow\.max_held: "):
        plan_experiment(path, simulate=True)


def test_the_store_keeps_each_request_class(runs, tmp_path):
    """A simulated run written to the store reads back with each request's priority and tenant."""
    from metrics.store import MetricsStore
    from sim.simulator import record_simulation

    _, results = runs
    store = MetricsStore(tmp_path / "s.db")
    run_id = record_simulation(store, results["vtc"])
    stored = {t.request_id: (t.priority, t.tenant) for t in store.traces(run_id)}
    assert stored == {t.request_id: (t.priority, t.tenant) for t in results["vtc"].traces}
    assert set(stored.values()) == {(0, "interactive"), (2, "batch"), (2, "flood")}
    store.close()
