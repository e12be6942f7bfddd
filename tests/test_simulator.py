# Over 400 lines: simulator, cost model fit and calibration tests share their fixtures.
"""The discrete-event simulator (cluster/simulator.py), the cost models it runs on
(replica/model/fake.py) and the calibration pipeline (cluster/calibrate.py). Everything runs on
virtual time except the side-by-side calibration test, which times a tiny real model."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from dataclasses import astuple

import pytest

from cli.calibrate import add_parser as add_calibrate_command
from metrics.definitions import RequestTrace
from metrics.goodput_report import analyze, format_report
from metrics.recording import step_row
from metrics.store import StoreError, open_store
from protocol.clock import FakeClock
from replica import POLICIES, Engine, EngineConfig
from replica.errors import ConfigError, InvariantViolation
from replica.model.fake import FlatCostModel, ScriptedFakeRunner
from replica.scheduling.request import Request, SamplingParams
from replica.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from router.router import Router
from sim.calibration import ProbeCell, calibrate, grid, measure
from sim.cost_model import FittedCostModel, StepFeatures, step_overhead
from sim.replay import replay
from sim.simulator import SimulationConfig, Simulator, record_simulation, simulate
from workloads.standard import bursty_mix, long_prompts, saturated
from workloads.workload import ClosedLoop, Workload, WorkloadRequest


def engine_config(policy: str, **over) -> EngineConfig:
    # A K/V budget below 4 full slots, so long prompts force preemptions.
    return EngineConfig(
        **{"policy": policy, "num_slots": 4, "max_seq_len": 640, "token_budget": 64, "kv_budget_tokens": 1200, **over}
    )


def bursty(n: int = 64, rate: float = 12.0, seed: int = 1) -> Workload:
    return bursty_mix(n, rate=rate, burst_factor=4.0, period=1.0, seed=seed)


def key(trace: RequestTrace) -> tuple:
    """A trace without its replica (replay knows of none)."""
    return (
        trace.request_id,
        trace.arrival,
        trace.token_times,
        trace.finish_time,
        trace.finish_reason,
        trace.prompt_len,
        trace.num_preemptions,
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    "workload",
    [bursty(), saturated(32), long_prompts(48, rate=20.0, seed=2)],
    ids=["bursty", "saturated", "long-prompts"],
)
def test_one_replica_is_exactly_the_fake_clock_replay(policy, workload):
    """With one replica the simulator is the in-process replay on a FakeClock: the same token
    times, finishes and preemptions, and the same step records, for every batching policy
    (long prompts with a tight K/V budget preempt)."""
    config, cost = engine_config(policy), FlatCostModel(0.03)
    clock = FakeClock()
    expected = replay(Engine(config, ScriptedFakeRunner(clock, cost), clock), workload, seed=3)
    result = simulate(workload, SimulationConfig(num_replicas=1, engine=config, seed=3), cost, check_invariants=True)
    assert [key(t) for t in result.traces] == [key(t) for t in expected.traces]
    assert result.steps["r0"] == expected.steps
    assert {t.replica for t in result.traces} == {"r0"}


def closed_loop(n: int = 30, users: int = 5, think: float = 0.1) -> Workload:
    w = saturated(n, seed=2)
    return Workload("closed", 2, w.requests, closed_loop=ClosedLoop(users, think))


def test_closed_loop_follows_the_schedule():
    """A closed loop's next request comes `think_time` after its user's previous one ended,
    in the simulator as in the replay; with 3 replicas too, never more than `users` at once."""
    config, cost = engine_config("chunked"), FlatCostModel(0.03)
    clock = FakeClock()
    expected = replay(Engine(config, ScriptedFakeRunner(clock, cost), clock), closed_loop(), seed=1)
    result = simulate(closed_loop(), SimulationConfig(num_replicas=1, engine=config, seed=1), cost)
    assert [key(t) for t in result.traces] == [key(t) for t in expected.traces]
    result = simulate(closed_loop(), SimulationConfig(num_replicas=3, engine=config), cost)
    traces = sorted(result.traces, key=lambda t: result.arrivals[t.request_id].index)
    for previous, following in zip(traces, traces[5:]):  # request i + users is user i's next one
        assert following.arrival == pytest.approx(previous.finish_time + 0.1)
    events = sorted([(t.arrival, 1) for t in traces] + [(t.finish_time, -1) for t in traces])
    assert max(itertools.accumulate(n for _, n in events)) <= 5


def test_routing_is_the_real_router_and_policies_decide_differently():
    """The simulator routes with router.router.Router itself; on a bursty workload over 4
    replicas, round robin and least loaded pick different replicas, least loaded's scores are
    the load the replicas reported (so its signals have an age) and round robin's are not."""
    workload = bursty(80, rate=30.0)
    runs = {}
    for policy in ("round_robin", "least_loaded"):
        sim = Simulator(
            workload,
            SimulationConfig(num_replicas=4, routing_policy=policy, engine=engine_config("continuous")),
            FlatCostModel(0.05),
        )
        assert type(sim.router) is Router
        runs[policy] = sim.run()
    rr, ll = runs["round_robin"], runs["least_loaded"]
    assert [d.replica_id for d in rr.decisions] == [f"r{i % 4}" for i in range(80)]
    assert [d.replica_id for d in ll.decisions] != [d.replica_id for d in rr.decisions]
    assert all(d.signal_age is None for d in rr.decisions)
    assert all(d.signal_age is not None and d.signal_age >= 0 for d in ll.decisions)
    # Least loaded sends a request where the score is lowest, and the score counts reported load.
    assert all(d.scores[d.replica_id] == min(d.scores.values()) for d in ll.decisions)
    assert any(len(set(d.scores.values())) > 1 for d in ll.decisions)
    assert [d.request_id for d in ll.decisions] == [t.request_id for t in ll.traces]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_ends_exactly_once(policy):
    """Three replicas, every batching policy, invariants checked after every step: each request
    has one trace with all its tokens, on the replica the router picked, and the router has
    heard every completion (nothing left in flight)."""
    workload = long_prompts(60, rate=25.0, seed=4)
    sim = Simulator(
        workload,
        SimulationConfig(num_replicas=3, engine=engine_config(policy), seed=4),
        FlatCostModel(0.02),
        check_invariants=True,
    )
    result = sim.run()
    ids = [t.request_id for t in result.traces]
    assert len(ids) == len(set(ids)) == len(workload.requests)
    for trace, spec in zip(result.traces, workload.requests):
        assert trace.finish_reason == "length" and trace.num_output_tokens == spec.output_len
    chosen = {d.request_id: d.replica_id for d in result.decisions}
    assert all(t.replica == chosen[t.request_id] for t in result.traces)
    assert all(v.in_flight == 0 for v in sim.router.load.views(sim.clock.now()))
    assert sum(len(s) for s in result.steps.values()) > 0


def test_a_refused_request_ends_rejected_and_the_rest_are_served():
    """A request longer than a replica can hold is refused at submission, as the cluster
    driver records it: 'rejected', no replica, its completion told to the router."""
    workload = Workload(
        "w", 0, [WorkloadRequest(0.0, 16, 8), WorkloadRequest(0.1, 600, 100), WorkloadRequest(0.2, 16, 8)]
    )
    sim = Simulator(workload, SimulationConfig(num_replicas=2, engine=engine_config("mixed")))
    result = sim.run()
    assert [t.finish_reason for t in result.traces] == ["length", "rejected", "length"]
    assert result.traces[1].replica is None and "max_seq_len" in result.errors["w-1"]
    assert all(v.in_flight == 0 for v in sim.router.load.views(sim.clock.now()))


def test_a_policy_that_can_never_run_is_an_error():
    """Requests that can never be scheduled stop the simulation with an error naming the
    replica, never a silent loss: a static batch closed to arrivals that never close."""
    workload = Workload("w", 0, [WorkloadRequest(0.0, 8, 4)])
    sim = Simulator(workload, SimulationConfig(num_replicas=1, engine=engine_config("static")))
    sim._arrivals_done = True  # pretend the replicas were already told, so they never are
    with pytest.raises(InvariantViolation, match="r0"):
        sim.run()


def test_same_seed_same_simulation():
    """Deterministic: the same seed gives the same traces and decisions, even with a random
    routing policy; another seed changes the random policy's choices."""

    def run(seed: int):
        config = SimulationConfig(
            num_replicas=4, routing_policy="power_of_two", seed=seed, engine=engine_config("chunked")
        )
        return simulate(bursty(60, rate=20.0), config, FlatCostModel(0.03))

    a, b, c = run(5), run(5), run(6)
    assert [key(t) + (t.replica,) for t in a.traces] == [key(t) + (t.replica,) for t in b.traces]
    assert a.decisions == b.decisions and a.steps == b.steps
    assert [d.replica_id for d in a.decisions] != [d.replica_id for d in c.decisions]


def test_steps_cost_what_the_cost_model_says():
    """Each simulated step lasts the fitted model's prediction for that step's work, and its
    record carries the context the model priced."""
    cost = FittedCostModel(c0=0.01, c_decode=0.002, c_prefill=0.0005, c_ctx=1e-6, c_held=0.003)
    result = simulate(saturated(16), SimulationConfig(num_replicas=2, engine=engine_config("static")), cost)
    records = [r for steps in result.steps.values() for r in steps]
    assert any(r.computed_rows > r.useful_rows for r in records)  # static padding rows are priced
    assert all(r.context_tokens >= r.num_decode_tokens + r.num_prefill_tokens for r in records)
    for r in records:
        expected = (
            0.01
            + 0.002 * r.num_decode_tokens
            + 0.0005 * r.num_prefill_tokens
            + 1e-6 * r.context_tokens
            + 0.003 * (r.computed_rows - r.useful_rows)
        )
        assert r.duration == pytest.approx(expected)


def test_serving_loop_overhead_is_paid_per_step_and_measured_back():
    """With `step_overhead` each busy replica starts its next step that long after the last one
    ended, unscaled by its cost scale, so a run takes longer by it on every step; and
    `step_overhead`, read off the recorded steps against the cost model, recovers it (the idle
    waits between arrivals left out)."""
    cost = FittedCostModel(c0=0.01, c_decode=0.002, c_prefill=0.0005, c_ctx=1e-6, c_held=0.0)
    workload = bursty_mix(24, rate=40.0)
    makespans = {}
    for overhead in (0.0, 0.003):
        config = SimulationConfig(
            num_replicas=2, engine=engine_config("chunked"), cost_scales=[1.0, 2.0], step_overhead=overhead
        )
        result = simulate(workload, config, cost)
        makespans[overhead] = max(t.finish_time for t in result.traces)
        for index, (replica, records) in enumerate(sorted(result.steps.items())):
            priced = cost.scaled([1.0, 2.0][index])
            rows = [step_row(replica, r, 4) for r in records]
            assert step_overhead(rows, priced) == pytest.approx(overhead, abs=1e-9)
            for step, after in zip(records, records[1:]):
                assert after.start >= step.start + step.duration + overhead - 1e-9
    assert makespans[0.003] > makespans[0.0]


def test_dispatch_delay_routes_late_and_counts_in_the_ttft():
    """With `dispatch_delay` each request is routed and queued that long after its planned
    arrival, and its TTFT, counted from that arrival, is longer by it on idle replicas."""
    workload = Workload("spread", 0, [WorkloadRequest(float(i), 16, 4) for i in range(4)])
    ttfts = {}
    for delay in (0.0, 0.015):
        config = SimulationConfig(num_replicas=2, engine=engine_config("chunked"), dispatch_delay=delay)
        result = simulate(workload, config, FlatCostModel(0.02))
        ttfts[delay] = [t.token_times[0] - t.arrival for t in result.traces]
        assert [d.time for d in result.decisions] == pytest.approx([i + delay for i in range(4)])
    assert ttfts[0.015] == pytest.approx([t + 0.015 for t in ttfts[0.0]])


def test_submit_interval_sends_a_burst_one_by_one_and_an_idle_replica_starts_on_the_first(tmp_path):
    """With `submit_interval` requests due together are routed that far apart, each stamped
    with its send (so `send_gaps` reads the interval back off the store): an idle replica
    starts its step on the first alone and the rest join its next step, as a capacity probe's
    requests do on a cluster. Without one the whole burst shares the first step."""
    from benchmarks.experiment_fidelity import send_gaps

    workload = Workload("burst", 0, [WorkloadRequest(0.0, 16, 4) for _ in range(4)])
    for interval in (0.0, 0.001):
        config = SimulationConfig(
            num_replicas=1, engine=engine_config("chunked"), dispatch_delay=0.01, submit_interval=interval
        )
        result = simulate(workload, config, FlatCostModel(0.02), check_invariants=True)
        assert [d.time for d in result.decisions] == pytest.approx([0.01 + interval * i for i in range(4)])
        assert [t.arrival for t in result.traces] == pytest.approx([interval * i for i in range(4)])
        first, second = result.steps["r0"][:2]
        assert first.num_prefill_tokens == (64 if interval == 0 else 16)
        assert second.num_prefill_tokens == (0 if interval == 0 else 48)
        store = open_store(tmp_path / f"{interval}.db")
        run_id = record_simulation(store, result)
        assert send_gaps(store.requests(run_id)) == pytest.approx([interval] * 3)
        store.close()


def test_the_fidelity_check_reads_back_the_loop_and_request_path_the_simulator_paid(tmp_path):
    """A simulated experiment given `step_overhead` and `dispatch_delay`, its runs read as a
    cluster's would be (`benchmarks.experiment_fidelity.overheads`): both come back, the first
    token's way back not counting again the loop's time the simulated replica already paid."""
    from benchmarks.experiment_fidelity import overheads
    from experiments.plan import plan_experiment
    from experiments.run import run_experiment

    (tmp_path / "cost.json").write_text(
        '{"c0": 0.004, "c_decode": 0.0005, "c_prefill": 0.00005, "c_ctx": 0.0, "c_held": 0.0}'
    )
    path = tmp_path / "paths.toml"
    path.write_text(
        'name = "paths"\n[workload]\nstandard = "bursty-mix"\nargs = { num_requests = 40 }\n'
        '[cluster]\nreplicas = 2\nslots = 4\nmax_seq_len = 256\nmodel = "fake"\ncost_model = "cost.json"\n'
        "step_overhead = 0.003\ndispatch_delay = 0.02\n"
        '[sweep]\nbatching = ["chunked"]\nrouting = ["least_loaded"]\nload = [0.3]\nseeds = [0]\n'
    )
    run_experiment(plan_experiment(path, simulate=True), simulate=True, store_path=tmp_path / "s.db", progress=False)
    found = overheads([tmp_path / "s.db"], "paths", path, simulated=True)
    assert overheads([tmp_path / "s.db"], "paths", path)["dispatch_delay"] is None  # no real run to read
    assert found["step_overhead (slotserve)"] == pytest.approx(0.003, abs=1e-9)
    assert found["dispatch_delay"] == pytest.approx(0.02, abs=1e-9)
    with pytest.raises(SystemExit, match="cost_scales"):
        path.write_text(path.read_text().replace("replicas = 2", "replicas = 2\ncost_scales = [1.0, 2.0]"))
        overheads([tmp_path / "s.db"], "paths", path, simulated=True)


def test_recorded_simulation_reads_like_a_cluster_run(tmp_path):
    """record_simulation writes the same row shapes the cluster writes; the run is marked
    simulated and the report's analysis reads it per replica."""
    workload = bursty(40, rate=15.0)
    config = SimulationConfig(num_replicas=3, routing_policy="least_loaded", engine=engine_config("chunked"))
    result = simulate(workload, config, FlatCostModel(0.03))
    store = open_store(tmp_path / "slotserve.db")
    run_id = record_simulation(store, result, slo={"ttft": 2.0})
    run = store.run(run_id)
    assert run["simulated"] and run["complete"] and run["config"]["simulated"] is True
    assert run["config"]["cost_model"] == {"kind": "FlatCostModel", "step_seconds": 0.03}
    assert (run["batching_policy"], run["routing_policy"]) == ("chunked", "least_loaded")
    assert [key(t) for t in store.traces(run_id)] == sorted(key(t) for t in result.traces)
    rows = {r["request_id"]: r for r in store.requests(run_id)}
    assert rows["bursty-mix-3"]["planned_arrival"] == workload.requests[3].arrival
    assert (
        rows["bursty-mix-3"]["submit_lateness"] == 0
        and rows["bursty-mix-3"]["max_tokens"] == workload.requests[3].output_len
    )
    assert len(store.steps(run_id)) == sum(len(s) for s in result.steps.values())
    assert len(store.decisions(run_id)) == 40
    analysis = analyze(store, run_id)
    assert analysis["simulated"] and analysis["cluster"]["num_requests"] == 40
    assert set(analysis["replicas"]) == {"r0", "r1", "r2"}
    assert sum(r["num_steps"] for r in analysis["replicas"].values()) == analysis["cluster"]["num_steps"]
    assert ", simulated" in format_report([analysis])


# ---- cost models ----------------------------------------------------------------------------


def chunk(prompt_len: int, outputs: int, start: int, num: int, decode: bool) -> ScheduledChunk:
    request = Request("x", [1] * prompt_len, SamplingParams(), 0.0, output_token_ids=[2] * outputs)
    return ScheduledChunk(request, start, num, decode)


def test_step_features_count_attended_keys():
    """A decode at position p sees p + 1 keys; a chunk of n from s sees n*s + n(n+1)/2; a held
    row sees its computed tokens."""
    held = Request("h", [1] * 10, SamplingParams(), 0.0, num_computed_tokens=12)
    out = SchedulerOutput([chunk(20, 3, 22, 1, True), chunk(40, 0, 8, 4, False)], held_rows=[held])
    assert StepFeatures.of(out) == StepFeatures(1, 4, 23 + (4 * 8 + 10) + 12, 1)


def synthetic_samples(true: tuple[float, ...], n: int = 300, noise: float = 0.01, seed: int = 0):
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        f = StepFeatures(rng.randint(0, 16), rng.choice([0, 0, 16, 64, 256]), rng.randint(0, 60_000), rng.randint(0, 4))
        t = sum(c * x for c, x in zip(true, (1, *astuple(f))))
        samples.append((f, t * (1 + rng.gauss(0, noise))))
    return samples


def test_fit_recovers_known_coefficients():
    """Least squares on noisy synthetic steps gives back the coefficients they were made
    from, and says how well it fits on the steps it did not see."""
    true = (0.05, 0.004, 0.0025, 2e-7, 0.001)
    model = FittedCostModel.fit(synthetic_samples(true, noise=0.002), machine={"cpu": "test"})
    assert model.coefficients == pytest.approx(true, rel=0.05)
    assert model.quality.r2 > 0.99 and model.quality.median_rel_error < 0.02
    assert model.quality.num_fit + model.quality.num_heldout == 300


def test_fit_keeps_coefficients_non_negative():
    """A feature whose samples say "more work, less time" gets 0, not a negative price (plain
    least squares would give -0.001 here); the others are still fitted."""
    model = FittedCostModel.fit(synthetic_samples((0.05, 0.004, 0.0025, 0.0, -0.001), noise=0.002, seed=1))
    assert model.c_held == 0.0 and min(model.coefficients) >= 0
    assert model.c_decode == pytest.approx(0.004, rel=0.1) and model.c_prefill == pytest.approx(0.0025, rel=0.1)
    with pytest.raises(ConfigError, match="samples"):
        FittedCostModel.fit(synthetic_samples((0.05, 0.0, 0.0, 0.0, 0.0), n=5))


def test_cost_model_save_load_round_trip(tmp_path):
    """JSON with the machine and the fit quality; a bad file is an error naming it."""
    model = FittedCostModel.fit(
        synthetic_samples((0.05, 0.004, 0.0025, 2e-7, 0.001)),
        machine={"cpu": "EPYC", "cores": 2, "torch": "2.13", "threads": 2, "model": "smollm2-135m", "dtype": "float32"},
    )
    path = tmp_path / "deep" / "cost.json"
    model.save(path)
    assert FittedCostModel.load(path) == model
    data = json.loads(path.read_text())
    assert data["machine"]["model"] == "smollm2-135m" and 0.99 < data["quality"]["r2"] <= 1
    path.write_text(json.dumps({**data, "c_decode": -1.0}))
    with pytest.raises(ConfigError, match="cost.json"):
        FittedCostModel.load(path)
    with pytest.raises(ConfigError, match="calibrate"):
        FittedCostModel.load(tmp_path / "missing.json")


def test_calibration_pipeline_recovers_a_known_runner():
    """measure() drives the engine through the grid and pairs each step's record with the
    features of the step that ran: with a runner whose steps cost a known model, the fit gives
    that model back (a record paired with another step's features would not fit)."""
    true = FittedCostModel(c0=0.09, c_decode=0.004, c_prefill=0.0028, c_ctx=3e-7, c_held=0.002)
    cells = grid(4, quick=True)
    assert cells[0].batch == 1 and {c.policy for c in cells} == {"mixed", "chunked", "static"}
    assert {c.batch for c in cells if c.policy == "mixed"} == {1, 2, 4}
    clock = FakeClock()
    samples = measure(
        ScriptedFakeRunner(clock, true, vocab_size=30_000),
        cells,
        max(c.prompt_len + c.max_tokens for c in cells),
        clock=clock,
    )
    assert {kind.split(" ")[0] for _, _, kind in samples} == {"decode", "prefill", "mixed", "padded"}
    fitted = FittedCostModel.fit([(f, t) for f, t, _ in samples])
    assert fitted.coefficients == pytest.approx(true.coefficients, rel=1e-3)
    assert fitted.quality.r2 == pytest.approx(1.0)


def test_calibrate_command_options():
    parser = argparse.ArgumentParser()
    add_calibrate_command(parser.add_subparsers())
    args = parser.parse_args(["calibrate", "--quick", "--slots", "4"])
    assert (args.quick, args.slots, args.threads, str(args.out), args.model) == (
        True,
        4,
        1,
        "results/cost_model.json",
        "smollm2-135m",
    )
    with pytest.raises(ConfigError, match="--threads"):
        args.func(parser.parse_args(["calibrate", "--threads", "0"]))
    assert ProbeCell("chunked", 4, 64, 3, token_budget=32).label == "chunked B=4 L=64 budget 32"


TRUE_COST = FittedCostModel(c0=0.09, c_decode=0.004, c_prefill=0.0028, c_ctx=3e-7, c_held=0.002)


def record_as_real(store, policy: str, steps_context: bool = True, experiment: bool = False) -> int:
    """A run recorded as real whose steps the engine timed on a fake clock at TRUE_COST: the
    rows a cluster's replicas write (`step_row`), of known durations; stored as `slotserve run`
    stores its config, or as an experiment cell does (`experiment`: its cluster section)."""
    config = engine_config(policy)
    result = simulate(long_prompts(24, rate=6.0, seed=3), SimulationConfig(num_replicas=2, engine=config), TRUE_COST)
    stored = {"replica": {"engine": config.model_dump()}, "num_replicas": 2, "num_cpus_per_replica": 1}
    if experiment:
        cluster = {"model": "smollm2-135m", "dtype": "auto", "slots": config.num_slots, "num_cpus": 1.0}
        stored = {"cluster": cluster, "num_replicas": 2}
    run_id = store.begin_run(
        f"real-{policy}",
        stored,
        policy,
        "least_loaded",
        0,
    )
    rows = [step_row(replica, r, config.num_slots) for replica, records in result.steps.items() for r in records]
    if not steps_context:  # as a store written before context tokens were recorded
        rows = [{k: v for k, v in row.items() if k != "context_tokens"} for row in rows]
    store.add_steps(run_id, rows)
    store.end_run(run_id)
    return run_id


def test_calibrate_from_store_fits_the_recorded_steps(tmp_path, capsys):
    """`slotserve calibrate --from-store DB --runs ...` fits to the steps runs recorded: the
    coefficients that timed them come back, so every feature (context included) is read off
    the rows right; the fit names the runs and how the cluster ran."""
    db = tmp_path / "slotserve.db"
    store = open_store(db)
    runs = [record_as_real(store, "static"), record_as_real(store, "chunked"), record_as_real(store, "chunked", True)]
    store.close()
    parser = argparse.ArgumentParser()
    add_calibrate_command(parser.add_subparsers())
    out = tmp_path / "fit.json"
    args = parser.parse_args(["calibrate", "--from-store", str(db), "--runs", *map(str, runs[:2]), "--out", str(out)])
    assert args.func(args) == 0
    fitted = FittedCostModel.load(out)
    assert fitted.coefficients == pytest.approx(TRUE_COST.coefficients, rel=1e-3)
    assert fitted.machine["fitted_to"] == f"{db} runs {runs[0]}, {runs[1]}"
    assert (fitted.machine["replicas"], fitted.machine["threads"], fitted.machine["num_slots"]) == (2, 1, 4)
    assert f"read {fitted.quality.num_fit + fitted.quality.num_heldout} steps" in capsys.readouterr().out
    # an experiment cell's runs: what ran is read off its cluster section
    args = parser.parse_args(["calibrate", "--from-store", str(db), "--runs", str(runs[2]), "--out", str(out)])
    assert args.func(args) == 0
    machine = FittedCostModel.load(out).machine
    ran = (machine["model"], machine["dtype"], machine["threads"], machine["num_slots"])
    assert ran == ("smollm2-135m", "auto", 1.0, 4)
    assert "cost model for smollm2-135m (auto," in capsys.readouterr().out


def test_calibrate_from_store_refuses_what_cannot_calibrate(tmp_path):
    """Simulated runs, runs recorded without context tokens, unknown runs, a missing store and
    --runs without --from-store are errors that name the problem."""
    db = tmp_path / "slotserve.db"
    store = open_store(db)
    simulated = record_simulation(
        store, simulate(saturated(8), SimulationConfig(engine=engine_config("chunked")), TRUE_COST)
    )
    old = record_as_real(store, "chunked", steps_context=False)
    store.close()
    parser = argparse.ArgumentParser()
    add_calibrate_command(parser.add_subparsers())

    def run(*argv: str) -> None:
        args = parser.parse_args(["calibrate", *argv, "--out", str(tmp_path / "fit.json")])
        args.func(args)

    with pytest.raises(ConfigError, match=f"run {simulated} .* is simulated"):
        run("--from-store", str(db), "--runs", str(simulated))
    with pytest.raises(ConfigError, match=f"run {old} .* no steps with context tokens"):
        run("--from-store", str(db), "--runs", str(old))
    with pytest.raises(StoreError, match="999"):
        run("--from-store", str(db), "--runs", "999")
    with pytest.raises(ConfigError, match="no metrics store"):
        run("--from-store", str(tmp_path / "missing.db"), "--runs", "1")
    with pytest.raises(ConfigError, match="--from-store"):
        run("--runs", str(old))
    with pytest.raises(ConfigError, match="--runs"):
        run("--from-store", str(db))
    assert not (tmp_path / "fit.json").exists()


def test_side_by_side_calibration_measures_every_replica(tiny_gpt2_dir):
    """calibrate(replicas=2) runs the grid in two processes at once: twice the steps of one,
    the same kinds, and the fit says how many replicas shared the machine."""
    one, one_samples = calibrate(tiny_gpt2_dir, num_slots=2, quick=True, progress=False)
    two, two_samples = calibrate(tiny_gpt2_dir, num_slots=2, quick=True, progress=False, replicas=2)
    assert len(two_samples) == 2 * len(one_samples)
    assert sorted(k for _, _, k in two_samples) == sorted(2 * [k for _, _, k in one_samples])
    assert (one.machine["replicas"], two.machine["replicas"]) == (1, 2)
    assert all(t > 0 for _, t, _ in two_samples)
