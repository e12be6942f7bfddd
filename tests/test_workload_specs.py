"""Workload specs: serialisable and replayed exactly, arrival processes and length
distributions with the statistics they claim, the standard workloads unchanged, bad specs
named, and the closed loop released by `ArrivalSchedule` in the in-process replay and the
cluster driver."""

from __future__ import annotations

import json
import statistics

import pytest
from pydantic import ValidationError

from protocol.clock import FakeClock
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.fake import FlatCostModel, ScriptedFakeRunner
from sim.replay import replay
from workloads import (
    AllAtOnce,
    ArrivalSchedule,
    BurstyArrivals,
    ClosedLoopArrivals,
    FixedLength,
    GammaArrivals,
    LognormalLength,
    MixtureLength,
    PoissonArrivals,
    TraceSpec,
    UniformLength,
    WorkloadSpec,
    burst_profile,
    bursty_mix,
    long_prompts,
    mean_rate_factor,
    parse_spec,
    read_azure_csv,
    saturated,
    sigma_sweep,
    standard_spec,
)
from workloads.traces import TraceError

SHORT = UniformLength(low=4, high=32)
LONG = UniformLength(low=48, high=128)


def spec(arrivals=None, n: int = 4000, **kw) -> WorkloadSpec:
    return WorkloadSpec(
        **{
            "name": "t",
            "seed": 7,
            "num_requests": n,
            "arrivals": arrivals or AllAtOnce(),
            "prompt_len": UniformLength(low=8, high=64),
            "output_len": MixtureLength(components=((0.7, SHORT), (0.3, LONG))),
            **kw,
        }
    )


def gaps(workload) -> list[float]:
    times = [0.0] + [r.arrival for r in workload.requests]
    return [b - a for a, b in zip(times, times[1:])]


def cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


# ---- the standard workloads make the requests they made before they were specs ---------------


def test_standard_workloads_are_unchanged():
    """Values read from the generators before the specs existed (tests and committed figures
    depend on them): same lengths, arrivals and sessions, draw for draw."""
    w = saturated()
    assert w.output_lens[:5] == [50, 21, 8, 56, 17] and [r.prompt_len for r in w.requests[:5]] == [40, 32, 48, 35, 46]
    assert (sum(w.output_lens), sum(r.prompt_len for r in w.requests)) == (3238, 1965)
    assert sum(saturated(seed=3).output_lens) == 2769
    assert sigma_sweep(1.2).output_lens[:5] == [51, 14, 4, 61, 10] and sum(sigma_sweep(1.2).output_lens) == 3884
    b = bursty_mix()
    assert [r.arrival for r in b.requests[:3]] == [0.14098794666961256, 0.14910392963543964, 0.17613709157052557]
    assert b.requests[-1].arrival == 9.753930578734547 and b.requests[-1].session_id == "s7"
    assert b.output_lens[:5] == [66, 83, 25, 56, 18]
    assert (sum(b.output_lens), sum(r.prompt_len for r in b.requests)) == (3218, 2424)
    lp = long_prompts()
    assert (sum(lp.output_lens), sum(r.prompt_len for r in lp.requests)) == (3044, 5548)
    a = standard_spec("bursty-mix", num_requests=200, seed=2, burst_factor=2.0, period=1.0).at_load(0.8, 400.0).build()
    assert a.params["rate"] == 6.393606393606394 and a.requests[3].arrival == 0.46110675438308457


# ---- specs are values: dump, validate, build the same requests ----------------------------

ROUND_TRIP = [
    spec(PoissonArrivals(rate=3.0), n=50, sessions=5),
    spec(GammaArrivals(rate=3.0, cv=2.5), n=50, long_prompt_share=0.2, long_prompt_len=300),
    spec(
        BurstyArrivals(rate=2.0, burst_factor=4.0, period=1.5),
        n=50,
        output_len=LognormalLength(median=30, sigma=1.0, low=2, high=90),
    ),
    spec(ClosedLoopArrivals(users=3, think_time=0.5), n=20, prompt_len=FixedLength(value=12)),
    standard_spec("saturated"),
]


@pytest.mark.parametrize("s", ROUND_TRIP, ids=lambda s: s.arrivals.process)
def test_spec_round_trip_builds_identical_requests(s):
    """The dump a workload carries survives JSON and builds exactly the same workload, through
    WorkloadSpec and through parse_spec."""
    w = s.build()
    stored = json.loads(json.dumps(w.spec))
    assert WorkloadSpec.model_validate(stored).build() == w
    assert parse_spec(stored) == s and parse_spec(stored).build() == w


def test_trace_spec_builds_through_the_reader_and_round_trips(tmp_path):
    """A trace spec is the reader with its arguments, stored and rebuilt; a bad file still
    names file and line."""
    s = TraceSpec(format="azure", time_scale=2.0, length_scale=0.1, every=10, limit=50, start_offset=60.0)
    w = s.build()
    direct = read_azure_csv(time_scale=2.0, length_scale=0.1, every=10, limit=50, start_offset=60.0)
    assert w.requests == direct.requests
    assert w.name == "azure_llm_2023_conv" and parse_spec(json.loads(json.dumps(w.spec))).build() == w  # its file
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "input_length": 2}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: missing field 'output_length'"):
        TraceSpec(format="mooncake", path=str(bad)).build()


def test_trace_spec_at_load_scales_time():
    """A trace at a load offers that load: the time scale is set from the sample's own rate."""
    s = standard_spec("azure-conv", num_requests=300)
    w = s.at_load(0.5, capacity=200.0).build()
    mean_output = statistics.fmean(w.output_lens)
    rate = (len(w.requests) - 1) / w.requests[-1].arrival
    assert rate * mean_output == pytest.approx(0.5 * 200.0, rel=1e-9)
    assert w.output_lens == s.build().output_lens


# ---- arrival processes -------------------------------------------------------------------


def test_poisson_rate_and_cv():
    """~4000 exponential gaps: mean rate within 5%, cv near 1."""
    w = spec(PoissonArrivals(rate=5.0)).build()
    g = gaps(w)
    assert len(g) / w.requests[-1].arrival == pytest.approx(5.0, rel=0.05)
    assert cv(g) == pytest.approx(1.0, abs=0.07)


@pytest.mark.parametrize("target_cv", [0.5, 2.0])
def test_gamma_rate_and_cv(target_cv):
    """Gamma gaps keep the mean rate whatever the cv, and show the cv asked for."""
    w = spec(GammaArrivals(rate=5.0, cv=target_cv)).build()
    g = gaps(w)
    assert len(g) / w.requests[-1].arrival == pytest.approx(5.0, rel=0.08)
    assert cv(g) == pytest.approx(target_cv, rel=0.12)


def test_bursty_realised_profile():
    """The realised hot/cold rates give back the burst factor, and the mean rate is
    rate * (f + 1/f) / 2 as mean_rate_factor says; with_mean_rate sets that mean."""
    s = spec(BurstyArrivals(rate=4.0, burst_factor=3.0, period=2.0))
    profile = burst_profile(s.build())
    assert profile.factor == pytest.approx(3.0, rel=0.1)
    assert profile.hot_rate == pytest.approx(12.0, rel=0.1) and profile.cold_rate == pytest.approx(4 / 3, rel=0.15)
    assert profile.mean_rate == pytest.approx(4.0 * mean_rate_factor(3.0), rel=0.08)
    faster = burst_profile(s.with_mean_rate(20.0).build())
    assert faster.mean_rate == pytest.approx(20.0, rel=0.08) and faster.factor == pytest.approx(3.0, rel=0.1)
    with pytest.raises(ValueError, match="period"):
        burst_profile(spec(PoissonArrivals(rate=1.0), n=10).build())


def test_lengths_do_not_depend_on_the_rate():
    """A rate or load sweep moves arrivals only: separate RNG streams."""
    s = spec(GammaArrivals(rate=1.0, cv=1.5), n=300, long_prompt_share=0.1)
    other = s.with_mean_rate(40.0).build()
    assert [(r.prompt_len, r.output_len) for r in other.requests] == [
        (r.prompt_len, r.output_len) for r in s.build().requests
    ]
    assert [r.arrival for r in other.requests] != [r.arrival for r in s.build().requests]


def test_rate_free_processes():
    """All-at-once and closed loop have no rate: setting one is an error, at_load keeps them."""
    for s in (spec(AllAtOnce(), n=5), spec(ClosedLoopArrivals(users=2), n=5)):
        with pytest.raises(ValueError, match="no rate"):
            s.with_mean_rate(3.0)
        assert s.at_load(0.8, 100.0) == s


# ---- length distributions ----------------------------------------------------------------


def test_lengths_stay_in_bounds_and_the_mixture_share_is_right():
    """Uniform and lognormal lengths stay within [low, high]; a 70/30 mixture gives ~70%
    short; long prompts take their share; sessions cycle s0..s{k-1}."""
    w = spec(
        output_len=LognormalLength(median=40, sigma=1.5, low=5, high=200),
        long_prompt_share=0.25,
        long_prompt_len=999,
        sessions=3,
    ).build()
    assert all(5 <= r.output_len <= 200 for r in w.requests)
    assert {min(w.output_lens), max(w.output_lens)} == {5, 200}  # sigma 1.5 reaches both clips
    assert all(8 <= r.prompt_len <= 64 or r.prompt_len == 999 for r in w.requests)
    assert sum(r.prompt_len == 999 for r in w.requests) / 4000 == pytest.approx(0.25, abs=0.02)
    assert [r.session_id for r in w.requests[:4]] == ["s0", "s1", "s2", "s0"]
    m = spec().build()
    assert all(4 <= o <= 32 or 48 <= o <= 128 for o in m.output_lens)
    assert sum(o <= 32 for o in m.output_lens) / 4000 == pytest.approx(0.7, abs=0.02)
    weights = MixtureLength(components=((1, SHORT), (3, LONG), (0, FixedLength(value=1000))))
    unnormalised = spec(output_len=weights).build()
    assert sum(o <= 32 for o in unnormalised.output_lens) / 4000 == pytest.approx(0.25, abs=0.02)
    assert set(spec(output_len=FixedLength(value=9), n=20).build().output_lens) == {9}


# ---- bad specs name the field ------------------------------------------------------------


@pytest.mark.parametrize(
    "data, field",
    [
        ({"arrivals": {"process": "weibull", "rate": 1.0}}, "weibull"),
        ({"arrivals": {"process": "poisson", "rate": 0}}, "rate"),
        ({"arrivals": {"process": "gamma", "rate": 1.0, "cv": -1}}, "cv"),
        ({"arrivals": {"process": "bursty", "rate": 1.0, "burst_factor": 0.5}}, "burst_factor"),
        ({"arrivals": {"process": "closed_loop", "users": 0}}, "users"),
        ({"arrivals": {"process": "closed_loop", "users": 2, "think_time": -1}}, "think_time"),
        ({"output_len": {"kind": "fixed", "value": 0}}, "value"),
        ({"output_len": {"kind": "uniform", "low": 50, "high": 10}}, "high"),
        ({"output_len": {"kind": "lognormal", "median": -3, "sigma": 1, "high": 10}}, "median"),
        ({"output_len": {"kind": "zipf"}}, "zipf"),
        ({"output_len": {"kind": "mixture", "components": [[0, {"kind": "fixed", "value": 3}]]}}, "weights"),
        ({"output_len": {"kind": "mixture", "components": [[-1, {"kind": "fixed", "value": 3}]]}}, "components"),
        ({"num_requests": 0}, "num_requests"),
        ({"long_prompt_share": 1.5}, "long_prompt_share"),
        ({"sessions": 0}, "sessions"),
        ({"rate": 3.0}, "rate"),  # extra="forbid": a misplaced field is an error, not ignored
        ({"rng_layout": "single", "arrivals": {"process": "poisson", "rate": 1.0}}, "rng_layout"),
    ],
)
def test_bad_specs_name_the_field(data, field):
    good = spec(n=10).model_dump(mode="json")
    with pytest.raises(ValidationError, match=field):
        parse_spec({**good, **data})


def test_bad_trace_and_standard_specs():
    with pytest.raises(ValidationError, match="path"):
        TraceSpec(format="mooncake")
    with pytest.raises(ValidationError, match="time_scale"):
        TraceSpec(format="azure", time_scale=0)
    with pytest.raises(ValueError, match="seed"):
        standard_spec("azure-conv", seed=3)
    with pytest.raises(ValueError, match="unknown standard workload 'bursty'"):
        standard_spec("bursty")
    with pytest.raises(ValidationError, match="rate"):
        spec(PoissonArrivals(rate=1.0)).with_mean_rate(-2.0)


# ---- the arrival schedule ----------------------------------------------------------------


def test_open_loop_schedule_releases_planned_arrivals_in_order():
    """Open loop: due() hands out everything planned up to now, ties in request order, once."""
    w = spec(PoissonArrivals(rate=2.0), n=6).build()
    s = ArrivalSchedule(w)
    assert s.next_time() == w.requests[0].arrival
    first = s.due(w.requests[2].arrival)
    assert [(i, planned) for i, _, planned in first] == [(i, w.requests[i].arrival) for i in range(3)]
    assert s.due(w.requests[2].arrival) == [] and not s.done
    assert not s.waiting_on_ends
    assert [i for i, _, _ in s.due(1e9)] == [3, 4, 5] and s.done and s.next_time() is None and s.waiting_on_ends
    with pytest.raises(ValueError, match="finished twice"):
        s.finished(0, 1.0)
        s.finished(0, 2.0)
    tied = ArrivalSchedule(spec(n=4).build())
    assert [i for i, _, _ in tied.due(0.0)] == [0, 1, 2, 3]


def test_closed_loop_schedule_releases_on_finish():
    """Closed loop: the first `users` requests at 0, user i%users's next one think_time after
    its previous one finished, and nothing before that."""
    s = ArrivalSchedule(spec(ClosedLoopArrivals(users=2, think_time=0.5), n=5).build())
    assert [i for i, _, _ in s.due(0.0)] == [0, 1] and s.next_time() is None and not s.done
    assert s.waiting_on_ends  # both users wait on their running requests
    with pytest.raises(ValueError, match="never handed out"):
        s.finished(2, 0.0)
    s.finished(1, 3.0)
    assert s.next_time() == 3.5 and s.due(3.4) == [] and not s.waiting_on_ends
    assert [(i, planned) for i, _, planned in s.due(3.5)] == [(3, 3.5)]
    s.finished(0, 4.0)
    assert [(i, planned) for i, _, planned in s.due(10.0)] == [(2, 4.5)]
    s.finished(3, 5.0)  # user 1 has no request left
    assert s.next_time() is None
    s.finished(2, 6.0)
    assert [i for i, _, _ in s.due(6.5)] == [4] and s.done


@pytest.mark.parametrize("users, slots, think", [(3, 8, 0.25), (6, 4, 0.0)])
def test_closed_loop_replay_on_a_fake_clock(users, slots, think):
    """Through sim.replay with the fake runner: never more than `users` requests in
    flight, each user's next request arrives exactly think_time after its previous one
    finished, none is submitted later than the step running at its time, and all finish.
    With more users than slots, the extra ones queue."""
    clock = FakeClock()
    engine = Engine(
        EngineConfig(policy="continuous", num_slots=slots, max_seq_len=256),
        ScriptedFakeRunner(clock, FlatCostModel(0.01), vocab_size=1000),
        clock,
    )
    w = spec(ClosedLoopArrivals(users=users, think_time=think), n=30).build()
    result = replay(engine, w)
    by_index = {int(t.request_id.rsplit("-", 1)[1]): t for t in result.traces}
    assert sorted(by_index) == list(range(30)) and all(t.finish_reason == "length" for t in result.traces)
    assert all(by_index[i].arrival == 0.0 for i in range(users))
    for i in range(users, 30):
        assert by_index[i].arrival == pytest.approx(by_index[i - users].finish_time + think, abs=1e-12)
    events = sorted(
        [(t.arrival, 1) for t in result.traces] + [(t.finish_time, -1) for t in result.traces],
        key=lambda e: (e[0], e[1]),
    )  # at equal times an end frees its user first
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak == users
    assert 0 <= min(result.submit_lateness) and max(result.submit_lateness) <= 0.01 + 1e-9  # one step


# ---- the cluster driver follows the schedule ------------------------------------------------


def test_closed_loop_through_the_cluster_driver(tmp_path):
    """On a real local Ray cluster: the driver submits a closed loop's next request only after
    the user's previous one came back (plus think time), and stores the spec with the run."""
    import ray

    from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
    from cluster.driver import run_workload
    from metrics.store import MetricsStore
    from replica.serving.loop import ReplicaConfig

    think, users = 0.05, 2
    w = spec(ClosedLoopArrivals(users=users, think_time=think), n=10, output_len=UniformLength(low=2, high=6)).build()
    ray.init(address="local", num_cpus=2, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    try:
        replica = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=256), fake_step_seconds=0.005)
        deployment = start_cluster(ClusterSpec(num_replicas=1, replica=replica, store_path=str(tmp_path / "s.db")))
        run_id = run_workload(
            deployment,
            w,
            name="closed",
            config={},
            batching_policy="continuous",
            routing_policy="round_robin",
            progress=False,
        )
    finally:
        stop_cluster()
        ray.shutdown()
    store = MetricsStore(tmp_path / "s.db")
    rows = {int(r["request_id"].rsplit("-", 1)[1]): r for r in store.requests(run_id)}
    assert sorted(rows) == list(range(10)) and all(r["finish_reason"] == "length" for r in rows.values())
    t0 = rows[0]["planned_arrival"]
    assert rows[1]["planned_arrival"] == t0
    for i in range(users, 10):
        assert rows[i]["planned_arrival"] >= rows[i - users]["completion"] + think - 1e-6  # float epoch rounding
        assert rows[i]["arrival"] >= rows[i]["planned_arrival"]
    assert parse_spec(store.run(run_id)["config"]["workload_spec"]).build() == w
