"""Experiment files that compare autoscaling policies with static provisioning: `sweep.autoscale`
entries checked and labelled by the plan, an autoscaled cell simulated from its `min` replicas
by the same policy objects the cluster runs, a static one sized from its workload, and the
report's replica-seconds, read from the store the same way for the simulator and Ray, agreeing
with the simulator's own account of every replica's life."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from autoscaling.policies import AutoscaleConfig
from benchmarks.experiment_fidelity import KEY as FIDELITY_KEY
from benchmarks.experiment_fidelity import cells as fidelity_cells
from benchmarks.experiment_fidelity import scaled as fidelity_errors
from experiments.experiment_report import summarize_runs, write_report
from experiments.plan import StaticSize, plan_experiment
from experiments.run import run_experiment
from experiments.scaling_report import against_static, replica_timeline, state_timeline, windows
from metrics.store import MetricsStore
from sim.autoscaling import AutoscalingSimulator, offered_load, static_replica_seconds
from sim.simulator import SimulationConfig, simulate
from workloads.diurnal import DiurnalArrivals, DiurnalDay
from workloads.experiment import ExperimentError
from workloads.lengths import LognormalLength, UniformLength
from workloads.spec import WorkloadSpec

COST_MODEL = Path(__file__).resolve().parent.parent / "workloads" / "experiments" / "cost_model.json"

EXPERIMENT = """\
name = "autoscaling-test"

[workload.spec]
source = "synthetic"
name = "diurnal"
num_requests = 700
arrivals = {{ process = "diurnal", rate = 8, day_s = 80, peak_to_trough = 4, bursts = 1, burst_s = 8 }}
prompt_len = {{ kind = "uniform", low = 16, high = 64 }}
output_len = {{ kind = "lognormal", median = 12, sigma = 0.8, low = 2, high = 48 }}

[cluster]
replicas = 2
slots = 8
max_seq_len = 256
model = "fake"
cost_model = "{cost_model}"
cost_scale = 0.4
autoscale = {{ min = 1, max = 8, cooldown = 5, period = 1, cold_start = 3 }}

[sweep]
batching = ["chunked"]
routing = ["least_loaded"]
seeds = [0]
autoscale = [
{entries}
]

[slo]
ttft = 1.0
tpot = 0.2
"""
ENTRIES = """\
  { policy = "predictive", window_s = 20, horizon_s = 5, headroom = 0.4 },
  { static = "peak" },
  { static = 1 },"""


def _file(tmp_path: Path, entries: str = ENTRIES) -> Path:
    path = tmp_path / "autoscaling.toml"
    path.write_text(EXPERIMENT.format(cost_model=COST_MODEL, entries=entries))
    return path


def test_sweep_autoscale_entries_become_cells_merged_over_the_cluster_table(tmp_path):
    plan = plan_experiment(_file(tmp_path), simulate=True, allow_outside_paths=True)
    assert [c.scaling for c in plan.cells] == ["predictive", "static peak", "static 1"]
    predictive = plan.scalings["predictive"]
    assert isinstance(predictive, AutoscaleConfig)
    assert (predictive.min_replicas, predictive.max_replicas, predictive.cooldown_s) == (1, 8, 5)
    assert predictive.params == {"window_s": 20, "horizon_s": 5, "headroom": 0.4}
    assert plan.scalings["static peak"] == StaticSize(static="peak")
    assert plan.cold_start_s == 3
    assert len({c.deployment for c in plan.cells}) == 3  # each its own cluster


def test_two_entries_of_one_policy_are_told_apart_by_their_parameters(tmp_path):
    entries = '  { policy = "target_ongoing", target_ongoing_requests = 2 },\n'
    entries += '  { policy = "target_ongoing", target_ongoing_requests = 4 },'
    plan = plan_experiment(_file(tmp_path, entries), simulate=True, allow_outside_paths=True)
    assert list(plan.scalings) == [
        "target_ongoing target_ongoing_requests=2",
        "target_ongoing target_ongoing_requests=4",
    ]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('{ policy = "grow_fast" }', "unknown autoscaling policy 'grow_fast'"),
        ('{ policy = "predictive", horizon = 5 }', "horizon"),
        ('{ static = "median" }', "Input should be 'peak' or 'mean'"),
        ('{ static = "peak", utilization = 1.5 }', "utilization"),
    ],
)
def test_a_bad_autoscale_entry_is_refused_at_its_line(tmp_path, entry, message):
    path = _file(tmp_path, f"  {entry},")
    with pytest.raises(ExperimentError, match=message) as err:
        plan_experiment(path, simulate=True, allow_outside_paths=True)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("autoscale = ["))
    assert str(err.value).startswith(f"{path}:{line}:")


def test_a_diurnal_spec_draws_the_days_arrivals_and_scales_with_load():
    arrivals = DiurnalArrivals(rate=5, day_s=100, peak_to_trough=4, bursts=2, burst_s=5, burst_factor=2)
    lengths = {
        "prompt_len": UniformLength(low=16, high=96),
        "output_len": LognormalLength(median=12, sigma=0.8, low=2, high=64),
    }
    day = DiurnalDay(arrivals=arrivals, seed=3, **lengths).build()
    spec = WorkloadSpec(name="diurnal", seed=3, num_requests=len(day.requests), arrivals=arrivals, **lengths)
    assert [r.arrival for r in spec.build().requests] == [r.arrival for r in day.requests]
    assert spec.with_mean_rate(2 * arrivals.mean_rate).arrivals.mean_rate == pytest.approx(2 * arrivals.mean_rate)


def test_a_simulated_autoscaling_experiment_starts_at_min_and_accounts_every_replica(tmp_path):
    plan = plan_experiment(_file(tmp_path), simulate=True, allow_outside_paths=True)
    store_path = tmp_path / "runs.db"
    result = run_experiment(plan, simulate=True, store_path=store_path, progress=False)
    capacity = result.capacities[8]
    one = plan.replica_capacity(capacity)
    runs = {cell.scaling: run_id for cell, run_id in result.runs}
    cells = {cell.scaling: cell for cell, _ in result.runs}
    workload = plan.workload(cells["predictive"], capacity)
    peak = math.ceil(offered_load(workload, one, 10.0) / 0.8 - 1e-9)
    store = MetricsStore(store_path)
    try:
        configs = {label: store.run(run_id)["config"] for label, run_id in runs.items()}
        assert [configs[x]["num_replicas"] for x in runs] == [1, peak, 1]
        assert configs["predictive"]["scaling"]["policy"] == "predictive"

        # the autoscaled cell: the same policy objects on the simulator, recorded decision by decision
        engine = plan.engine_config(cells["predictive"])
        scaled = AutoscalingSimulator(
            workload,
            SimulationConfig(num_replicas=1, engine=engine, slo=_slo(plan)),
            plan.scalings["predictive"],
            plan.cost,
            one,
            plan.cold_start_s,
        ).simulate()
        decisions = store.scaling(runs["predictive"])
        assert [(d["current"], d["desired"]) for d in decisions] == [(d.current, d.desired) for d in scaled.decisions]
        assert scaled.scale_events >= 2  # it grew for the day's peak and shrank after it
        assert len(store.cold_starts(runs["predictive"])) == sum(
            s.ready is not None and s.ready > s.requested for s in scaled.spans
        )
        timeline = replica_timeline(store, runs["predictive"])
        assert timeline.replica_seconds == pytest.approx(scaled.replica_seconds, rel=0.03)
        assert timeline.peak == scaled.peak_replicas

        # a static cell: its replicas over the whole run, exactly as the simulator counts them
        static = simulate(workload, SimulationConfig(num_replicas=peak, engine=engine, slo=_slo(plan)), plan.cost)
        assert replica_timeline(store, runs["static peak"]).replica_seconds == pytest.approx(
            static_replica_seconds(static)
        )
    finally:
        store.close()

    rows = summarize_runs(result)
    by_label = {r.cell.scaling: r for r in rows}
    assert by_label["predictive"].values["replica_seconds"] == [pytest.approx(timeline.replica_seconds)]
    assert by_label["static 1"].values["peak_replicas"] == [1.0]
    lines = against_static(result, rows)
    assert lines[0].startswith("reference static peak:")
    assert any(line.startswith("predictive:") for line in lines)
    report = write_report(result, rows, tmp_path / "report", "slotserve experiment autoscaling.toml --simulate")
    text = report.read_text()
    assert "## Autoscaling against static provisioning" in text
    assert "| replica-s | good tok/replica-s | scale events |" in text
    svg = (tmp_path / "report" / "scaling_timeline.svg").read_text()
    assert "![Scaling timeline](scaling_timeline.svg)" in text and svg.lstrip().startswith("<?xml")
    assert all(f"{label}: TTFT p90" in svg for label in runs)  # one row of panels per sizing

    # the timeline's figures: a point per change of the replicas by state, the offered load adding up to the work
    store = MetricsStore(store_path)
    try:
        states = state_timeline(store, runs["predictive"])
        assert (states.start, states.end) == (timeline.start, timeline.end)
        assert all(a[1:] != b[1:] for a, b in zip(states.points, states.points[1:]))  # a point per change
        assert len(states.points) < len(decisions) and any(starting for _, _, starting, _ in states.points)
        times, load, p90 = windows(store, runs["predictive"], one, window_s=5.0)
        work = sum(one.work_seconds(r.prompt_len, r.output_len) for r in workload.requests)
        assert sum(load) * 5.0 == pytest.approx(work) and len(p90) == len(times)
        assert max(v for v in p90 if v is not None) >= min(v for v in p90 if v is not None) > 0
    finally:
        store.close()

    # the fidelity check reads a sized cell's cost and attainment back as the report does, and judges them
    scaling = FIDELITY_KEY.index("scaling")
    figures = {key[scaling]: f for key, f in fidelity_cells(store_path, "autoscaling-test", simulated=True).items()}
    mine = figures["predictive"]
    assert mine["replica_seconds"] == pytest.approx(timeline.replica_seconds)
    assert mine["slo_attainment"] == pytest.approx(by_label["predictive"].values["slo_attainment"][0])
    off = {**mine, "replica_seconds": 1.15 * mine["replica_seconds"], "slo_attainment": mine["slo_attainment"] - 2}
    errors = fidelity_errors(off, mine)
    assert errors["replica_seconds"] == (pytest.approx(0.15), False)
    assert errors["slo_attainment"] == (pytest.approx(-2.0), True)


def _slo(plan):
    from experiments.backends import experiment_slo

    return experiment_slo(plan)


def test_an_autoscaled_cluster_table_without_a_sweep_runs_every_cell_autoscaled(tmp_path):
    text = textwrap.dedent(
        """\
        name = "one-policy"
        [workload]
        standard = "bursty-mix"
        args = { num_requests = 40 }
        [cluster]
        replicas = 1
        model = "fake"
        fake_step_seconds = 0.01
        autoscale = { policy = "target_ongoing", min = 1, max = 3, target_ongoing_requests = 2 }
        """
    )
    path = tmp_path / "one.toml"
    path.write_text(text)
    plan = plan_experiment(path, simulate=True)
    assert [c.scaling for c in plan.cells] == [""]
    assert plan.autoscale is not None and plan.autoscale.policy == "target_ongoing"
    result = run_experiment(plan, simulate=True, store_path=tmp_path / "runs.db", progress=False)
    store = MetricsStore(tmp_path / "runs.db")
    try:
        assert store.scaling(result.runs[0][1])  # its decisions are recorded
    finally:
        store.close()


def test_ray_serves_cells_are_sized_by_serves_own_rule_or_left_out(tmp_path):
    """Routed by Ray Serve, a cell sized by `target_ongoing` (Serve's rule) runs on Serve's
    autoscaler with that policy's bounds, target, delays and look-back; one sized by another
    policy cannot run and is left out, counted; a static one keeps its size. Simulated, Serve's
    cells are left out and the target_ongoing cell stands for its autoscaler."""
    from cluster.serve_baseline import serve_autoscaling_config

    entries = '  { policy = "target_ongoing", target_ongoing_requests = 3, upscale_delay_s = 2 },\n'
    entries += '  { policy = "predictive" },\n  { static = "peak" },'
    path = _file(tmp_path, entries)
    path.write_text(
        path.read_text().replace('routing = ["least_loaded"]', 'routing = ["least_loaded", "serve_power_of_two"]')
    )
    plan = plan_experiment(path, allow_outside_paths=True)
    serve = [c.scaling for c in plan.cells if c.routing == "serve_power_of_two"]
    assert serve == ["target_ongoing", "static peak"] and plan.serve_unscalable == 1
    assert len(plan.cells) == 5
    config = serve_autoscaling_config(plan.scalings["target_ongoing"])
    assert config == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 8,
        "target_ongoing_requests": 3,
        "upscale_delay_s": 2,
        "downscale_delay_s": 600.0,  # Serve's default, which target_ongoing's shares
        "look_back_period_s": 30.0,
        "metrics_interval_s": 1.0,
    }
    with pytest.raises(ValueError, match="target_ongoing"):
        serve_autoscaling_config(plan.scalings["predictive"])
    simulated = plan_experiment(path, simulate=True, allow_outside_paths=True)
    assert simulated.skipped == 2 and {c.routing for c in simulated.cells} == {"least_loaded"}
