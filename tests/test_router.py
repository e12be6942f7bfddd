# Over 400 lines: the pure router, every policy and its actor, one behaviour per test.
"""The router: load estimation, every routing policy, the decision log, errors, and the Ray
actor shell. All but the last test are pure (a fake clock, no Ray)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
import time

import pytest
import ray

from protocol.clock import FakeClock
from protocol.messages import HealthReport
from protocol.registry import UnknownChoiceError
from router import (
    ROUTING_POLICIES,
    LoadReport,
    LoadView,
    ReplicaView,
    Router,
    RouteRequest,
    RoutingError,
    make_routing_policy,
)
from tests.waiting import wait_until


def load(
    replica_id: str, queue: int = 0, running: int = 0, free: int = 4, slots: int = 4, t: float = 0.0
) -> LoadReport:
    return LoadReport(
        replica_id,
        queue_depth=queue,
        running=running,
        free_slots=free,
        num_slots=slots,
        free_kv_tokens=1024 * free,
        time=t,
    )


def req(i: int | str, session: str | None = None) -> RouteRequest:
    return RouteRequest(f"req-{i}", prompt_len=16, max_tokens=32, session_id=session)


def make_router(policy: str, n: int = 3, clock: FakeClock | None = None, **kwargs) -> Router:
    return Router([f"r{i}" for i in range(n)], policy=policy, clock=clock or FakeClock(), **kwargs)


# --- load estimation ---------------------------------------------------------------------


def test_estimates_count_requests_the_report_has_not_seen():
    """Requests in flight beyond the reported running + queued take free slots first, then queue."""
    report = load("r0", queue=1, running=2, free=2)
    view = ReplicaView("r0", in_flight=5, report=report, report_age=0.0)
    assert (view.unseen, view.est_free_slots, view.est_queue, view.load_score) == (2, 0, 1, 1.0)
    view = ReplicaView("r0", in_flight=6, report=report, report_age=0.0)
    assert (view.unseen, view.est_free_slots, view.est_queue, view.load_score) == (3, 0, 2, 2.0)
    view = ReplicaView("r0", in_flight=4, report=report, report_age=0.0)
    assert (view.unseen, view.est_free_slots, view.est_queue, view.load_score) == (1, 1, 1, 0.0)


def test_before_any_report_everything_in_flight_is_queued():
    """With no report the router knows only its own count: no free slot, all of it queued."""
    view = ReplicaView("r0", in_flight=3, report=None, report_age=None)
    assert (view.est_free_slots, view.est_queue, view.load_score) == (0, 3, 3.0)


def test_completion_decrements_and_is_idempotent():
    """A completion frees the request's count once; repeats and unknown ids change nothing but are counted."""
    view = LoadView(["r0", "r1"])
    view.dispatched("r1", "a")
    view.dispatched("r1", "b")
    assert [v.in_flight for v in view.views(0.0)] == [0, 2]
    assert view.completed("a") is True
    assert view.completed("a") is False
    assert view.completed("never-routed") is False
    assert [v.in_flight for v in view.views(0.0)] == [0, 1]
    assert view.unknown_completions == 2


def test_stale_reports_are_ignored():
    """A report taken before the one held (reports can overtake each other) is dropped and counted."""
    view = LoadView(["r0"])
    assert view.update(load("r0", queue=0, t=2.0))
    assert not view.update(load("r0", queue=9, t=1.0))
    (current,) = view.views(5.0)
    assert current.report.queue_depth == 0 and current.report_age == 3.0
    assert view.stale_reports == 1


def test_reports_from_unknown_replicas_are_counted_not_kept():
    """A removed replica's late report does not bring it back."""
    view = LoadView(["r0", "r1"])
    view.remove_replica("r1")
    assert not view.update(load("r1"))
    assert view.unknown_reports == 1 and view.replica_ids == ["r0"]


# --- policies ----------------------------------------------------------------------------


def test_round_robin_cycles():
    """Round robin visits each replica in turn whatever the load; its score is the rotation position."""
    router = make_router("round_robin")
    router.report(load("r0", queue=50, free=0))
    chosen = [router.route(req(i)).replica_id for i in range(7)]
    assert chosen == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]
    assert router.drain_decisions()[1].scores == {"r0": 2.0, "r1": 0.0, "r2": 1.0}


def test_random_is_seeded_and_reaches_every_replica():
    """The same seed gives the same choices; over many requests every replica is used."""
    router = make_router("random", seed=7)
    chosen = [router.route(req(i)).replica_id for i in range(60)]
    again = make_router("random", seed=7)
    assert chosen == [again.route(req(i)).replica_id for i in range(60)]
    assert set(chosen) == {"r0", "r1", "r2"}


def test_least_queue_picks_the_shortest_queue():
    """least_queue goes where the estimated queue is shortest, in-flight requests included."""
    router = make_router("least_queue")
    for replica_id, queue in (("r0", 5), ("r1", 1), ("r2", 3)):
        router.report(load(replica_id, queue=queue, running=4, free=0))
    assert router.route(req(0)).replica_id == "r1"
    assert router.drain_decisions()[0].scores == {"r0": 5.0, "r1": 1.0, "r2": 3.0}
    router.report(load("r1", queue=9, running=4, free=0, t=1.0))
    assert router.route(req(1)).replica_id == "r2"


def test_most_free_slots_picks_the_most_free_slots():
    """most_free_slots goes where the most slots are estimated free."""
    router = make_router("most_free_slots")
    for replica_id, free in (("r0", 1), ("r1", 3), ("r2", 2)):
        router.report(load(replica_id, free=free))  # idle, slots limited by free KV
    # free 1/3/2 -> r1; then 1/2/2, a tie taken by the next in turn -> r2; then 1/2/1 -> r1
    assert [router.route(req(i)).replica_id for i in range(3)] == ["r1", "r2", "r1"]


@pytest.mark.parametrize("policy", ["least_loaded", "most_free_slots", "power_of_two", "session_affinity"])
def test_two_quick_requests_never_share_one_free_slot(policy):
    """Routed back to back before any new report, two requests go to different replicas when
    each has one free slot: the first one is counted against its replica's slot at once."""
    router = make_router(policy, n=2)
    router.report(load("r0", free=1, slots=1))
    router.report(load("r1", free=1, slots=1))
    first, second = router.route(req(0)), router.route(req(1))
    assert first.replica_id != second.replica_id
    assert second.scores[first.replica_id] > second.scores[second.replica_id]  # not a tie-break


def test_power_of_two_never_picks_the_more_loaded_of_its_two():
    """power_of_two scores exactly two sampled replicas, takes the less loaded of them, and
    (sampling) does not always find the global least loaded."""
    router = make_router("power_of_two", n=8, seed=3)
    for i in range(8):
        router.report(load(f"r{i}", queue=i, running=4, free=0))
    missed_global_best = 0
    for i in range(200):
        decision = router.route(req(i))
        router.complete(decision.request_id)
        sampled = {k: v for k, v in decision.scores.items() if math.isfinite(v)}
        assert len(sampled) == 2
        assert decision.scores[decision.replica_id] == min(sampled.values())
        missed_global_best += decision.replica_id != "r0"
    assert missed_global_best > 0


def test_session_affinity_sticks_then_moves_off_an_overloaded_replica():
    """A session's requests go to one replica until its load score exceeds the least loaded
    one's by more than the margin; the session then sticks to the new replica."""
    router = make_router("session_affinity")
    for i in range(3):
        router.report(load(f"r{i}", t=0.0))
    home = router.route(req(0, "s")).replica_id
    for i in range(1, 4):  # up to 4 requests on `home` at once: within the margin of 4
        assert router.route(req(i, "s")).replica_id == home
    assert router.route(req("other", "t")).replica_id != home  # a new session goes least loaded
    router.report(load(home, queue=6, running=4, free=0, t=1.0))
    moved = router.route(req(4, "s")).replica_id
    assert moved != home
    assert router.route(req(5, "s")).replica_id == moved


def test_session_affinity_without_session_is_least_loaded():
    """Requests without a session id are placed as least_loaded would place them."""
    affinity, least = make_router("session_affinity"), make_router("least_loaded")
    for router in (affinity, least):
        router.report(load("r0", queue=2, running=4, free=0))
        router.report(load("r2", running=3, free=1))
    assert [affinity.route(req(i)).replica_id for i in range(6)] == [least.route(req(i)).replica_id for i in range(6)]


def test_least_loaded_beats_round_robin_on_skewed_load():
    """With two replicas backed up and one idle, least_loaded sends new work to the idle one;
    round robin sends two of every three requests into the queues."""
    routers = {name: make_router(name) for name in ("least_loaded", "round_robin")}
    for router in routers.values():
        router.report(load("r0", queue=8, running=4, free=0))
        router.report(load("r1", queue=8, running=4, free=0))
        router.report(load("r2", free=4))
    chosen = {name: [r.route(req(i)).replica_id for i in range(6)] for name, r in routers.items()}
    assert chosen["least_loaded"] == ["r2"] * 6
    assert chosen["round_robin"].count("r2") == 2


@pytest.mark.parametrize("policy", sorted(ROUTING_POLICIES))
def test_every_policy_keeps_the_books_straight(policy):
    """Under random reports and completions, every policy returns a valid choice with one score
    per replica, and in-flight counts always equal requests routed and not completed."""
    rng = random.Random(0)
    clock = FakeClock()
    router = make_router(policy, n=4, clock=clock)
    open_requests: list[str] = []
    for i in range(300):
        clock.advance(0.01)
        if rng.random() < 0.3:
            free = rng.randint(0, 4)
            router.report(
                load(f"r{rng.randrange(4)}", queue=rng.randint(0, 5), running=4 - free, free=free, t=clock.now())
            )
        decision = router.route(req(i, session=f"s{rng.randrange(5)}"))
        assert set(decision.scores) == {"r0", "r1", "r2", "r3"} and decision.policy == policy
        open_requests.append(decision.request_id)
        if rng.random() < 0.5:
            router.complete(open_requests.pop(rng.randrange(len(open_requests))))
    in_flight = {rid: s["in_flight"] for rid, s in router.status()["replicas"].items()}
    assert sum(in_flight.values()) == len(open_requests)


# --- decisions and status ----------------------------------------------------------------


def test_decisions_carry_all_scores_in_flight_and_signal_age():
    """A decision logs every replica's score, the in-flight counts the policy saw, and the age of
    the oldest report it used (None before any report, or for a policy that ignores load)."""
    clock = FakeClock(10.0)
    router = make_router("least_loaded", n=2, clock=clock)
    assert router.route(req(0)).signal_age is None
    router.report(load("r0", running=1, free=3, t=7.0))
    router.report(load("r1", free=4, t=9.0))
    decision = router.route(req(1))
    assert decision.replica_id == "r1" and decision.time == 10.0
    assert decision.scores == {"r0": -3.0, "r1": -4.0}
    assert decision.in_flight == {"r0": 1, "r1": 0}
    assert decision.signal_age == 3.0
    assert [d.request_id for d in router.drain_decisions()] == ["req-0", "req-1"]
    assert router.drain_decisions() == []
    blind = make_router("round_robin", n=2, clock=clock)
    blind.report(load("r0", t=7.0))
    assert blind.route(req(0)).signal_age is None


def test_power_of_two_signal_age_counts_only_sampled_replicas():
    """Reports of replicas power_of_two did not sample did not go into the decision."""
    clock = FakeClock(100.0)
    router = make_router("power_of_two", n=3, clock=clock, seed=1)
    for i, t in enumerate((90.0, 95.0, 99.0)):
        router.report(load(f"r{i}", t=t))
    for i in range(20):
        d = router.route(req(i))
        ages = [100.0 - (90.0, 95.0, 99.0)[int(k[1])] for k, v in d.scores.items() if math.isfinite(v)]
        assert d.signal_age == max(ages)


def test_decision_log_is_bounded_and_counts_drops():
    """Past `max_decisions` undrained decisions the oldest are dropped and counted."""
    router = make_router("round_robin", max_decisions=3)
    for i in range(5):
        router.route(req(i))
    assert [d.request_id for d in router.drain_decisions()] == ["req-2", "req-3", "req-4"]
    assert router.status()["decisions_dropped"] == 2


def test_status_shows_policy_in_flight_and_report_age():
    """status() reports the policy, each replica's in-flight count, last report and its age."""
    clock = FakeClock(5.0)
    router = make_router("least_loaded", n=2, clock=clock)
    router.report(load("r0", t=4.5))
    router.route(req(0))
    status = router.status()
    assert status["policy"] == "least_loaded" and status["routed"] == 1
    assert status["replicas"]["r0"] == {"in_flight": 1, "report": load("r0", t=4.5).__dict__, "report_age": 0.5}
    assert status["replicas"]["r1"] == {"in_flight": 0, "report": None, "report_age": None}


def test_set_policy_keeps_the_load_view():
    """Switching policy between runs changes the scoring and keeps in-flight counts and reports."""
    router = make_router("least_loaded", n=2)
    router.report(load("r0", queue=3, running=4, free=0))
    assert router.route(req(0)).replica_id == "r1"
    router.set_policy("round_robin")
    assert [router.route(req(i)).replica_id for i in (1, 2)] == ["r0", "r1"]
    assert router.status()["policy"] == "round_robin"
    assert router.status()["replicas"]["r1"]["in_flight"] == 2
    with pytest.raises(UnknownChoiceError, match="unknown routing policy"):
        router.set_policy("nope")


def test_replicas_can_be_added_and_removed():
    """An added replica is routed to; removing one forgets its requests; the last cannot go."""
    router = make_router("round_robin", n=1)
    router.add_replica("r1")
    assert [router.route(req(i)).replica_id for i in range(2)] == ["r0", "r1"]
    router.remove_replica("r1")
    assert router.complete("req-1") is False
    assert router.route(req(2)).replica_id == "r0"
    with pytest.raises(RoutingError, match="last replica"):
        router.remove_replica("r0")
    with pytest.raises(RoutingError, match="already routed"):
        router.add_replica("r0")


# --- errors ------------------------------------------------------------------------------


def test_unknown_policy_names_the_choices():
    """An unknown policy name is an UnknownChoiceError (a ValueError) listing every policy."""
    with pytest.raises(UnknownChoiceError, match="unknown routing policy 'fastest'; choose one of round_robin") as info:
        Router(["r0"], policy="fastest")
    assert isinstance(info.value, ValueError)
    assert all(name in str(info.value) for name in ROUTING_POLICIES)
    assert {name: make_routing_policy(name).name for name in ROUTING_POLICIES} == {n: n for n in ROUTING_POLICIES}


def test_zero_replicas_is_an_error():
    """A router over no replicas fails at construction, not at the first request."""
    with pytest.raises(RoutingError, match="at least one replica"):
        Router([])


def test_duplicate_request_id_in_flight_is_an_error():
    """Routing an id already in flight would corrupt the counts, so it is refused."""
    router = make_router("least_loaded")
    router.route(req(0))
    with pytest.raises(RoutingError, match="already in flight"):
        router.route(req(0))
    assert router.status()["routed"] == 1


def test_a_report_that_is_not_a_load_report_is_refused_by_name():
    """A report must be a protocol.messages.LoadReport; a dict (an old sender, a stray Ray
    caller) is refused with the type it was, and the view is left as it was."""
    router = make_router("least_loaded")
    with pytest.raises(RoutingError, match="load report must be a LoadReport, got dict"):
        router.report(load("r0").__dict__)
    assert router.report(load("r0"))


def test_router_package_imports_neither_ray_nor_its_siblings():
    """`import router` pulls in no Ray (the actor module is separate) and none of replica,
    cluster or workloads: dependencies point one way."""
    code = "import sys, router; print(sorted({'ray', 'replica', 'cluster', 'workloads'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_decision_rows_are_strict_json():
    """Store rows carry scores and in-flight counts as JSON; power_of_two's unsampled +inf
    scores become null rather than the non-standard `Infinity`."""
    from metrics.recording import decision_row

    router = make_router("power_of_two", n=4)
    row = decision_row(router.route(req(0)))
    scores = json.loads(row["scores"], parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert sorted(v is None for v in scores.values()) == [False, False, True, True]
    assert json.loads(row["in_flight"]) == {"r0": 0, "r1": 0, "r2": 0, "r3": 0}


# --- the Ray actor -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dummy_actors(ray_local):
    """A replica that answers ping, and stores that record decision batches or refuse them."""

    @ray.remote(num_cpus=0)
    class DummyReplica:
        def ping(self) -> str:
            return "pong"

    @ray.remote(num_cpus=0)
    class DummyStore:
        def __init__(self, fail: bool = False):
            self.fail = fail
            self.batches: list[tuple[str | None, list[dict]]] = []

        def add_decision_records(self, run_id, decisions):
            from metrics.recording import decision_row

            if self.fail:
                raise RuntimeError("store is down")
            self.batches.append((run_id, [decision_row(d) for d in decisions]))

        def get(self):
            return self.batches

    return DummyReplica, DummyStore


def get(ref):
    return ray.get(ref, timeout=60)


@pytest.fixture(scope="module")
def gated_actors(ray_local):
    """A gate a test opens, and a stand-in replica actor built only once its gate opens (as a
    replica is once its model is loaded), that answers health checks until muted."""

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self):
            self.opened = asyncio.Event()

        async def wait(self) -> None:
            await self.opened.wait()

        def open(self) -> None:
            self.opened.set()

    @ray.remote(num_cpus=0)
    class GatedReplica:
        def __init__(self, replica_id: str, gate=None):
            if gate is not None:
                ray.get(gate.wait.remote())
            self.replica_id, self.router = replica_id, None
            self.speaking = asyncio.Event()
            self.speaking.set()

        async def health(self) -> HealthReport:
            await self.speaking.wait()
            attached = self.router is not None
            return HealthReport(self.replica_id, True, None, 0.0, None, 0, 0, 0, False, attached, time.time())

        def attach(self, router=None, store=None, run_id=None) -> None:
            self.router = router

        def set_arrivals_done(self, done: bool) -> None:
            pass

        def mute(self) -> None:
            self.speaking.clear()

    return Gate, GatedReplica


@pytest.mark.timeout(300)
def test_router_actor_holds_a_replica_starting_until_its_first_health_answer(gated_actors):
    """A replica still being built (its actor not answering yet) is `starting`: routed nothing,
    but not marked down for its silence past health_timeout nor killed, while requests go to the
    replica that is up; once built it is attached and routed to, and from then on silence past
    health_timeout marks it down."""
    from router.actor import RouterActor

    Gate, GatedReplica = gated_actors
    gate = Gate.remote()
    handles = {"slow": GatedReplica.remote("slow", gate), "quick": GatedReplica.remote("quick")}
    router = RouterActor.remote(handles, policy="round_robin", health_period=0.05, health_timeout=2.0)

    def status() -> dict:
        return get(router.status.remote())

    wait_until(lambda: get(router.is_up.remote("quick")), 60, "the built replica to be up")
    wait_until(lambda: "slow" in status()["health"], 60, "the watcher to find the slow replica silent")
    held = status()
    assert held["down"] == {"slow": "starting"} and held["starting"] == ["slow"] and held["restarts_asked"] == 0
    assert held["health"]["slow"].reason == "starting: no health answer yet"
    assert [get(router.route.remote(RouteRequest(f"q{i}", 8, 8))) for i in range(3)] == ["quick"] * 3

    get(gate.open.remote())
    wait_until(lambda: get(router.is_up.remote("slow")), 60, "the slow replica, built, to be up")
    assert status()["starting"] == [] and get(router.route.remote(RouteRequest("next", 8, 8))) in handles
    get(handles["slow"].mute.remote())
    wait_until(lambda: "slow" in status()["down"], 60, "the muted replica to be marked down")
    assert status()["down"] == {"slow": "no health answer within 2 s"}


@pytest.mark.timeout(300)
def test_a_restarted_router_actor_holds_replicas_starting_until_they_answer_it(gated_actors):
    """A router Ray restarts while a replica is still being built (as one may while
    `start_cluster` waits for the first health checks) cannot tell it from one that had answered
    the router it replaces: it holds both starting, routes again to the built one once it answers,
    and routes nothing to the other, nor marks it down for its silence, until it is built."""
    from router.actor import RouterActor

    Gate, GatedReplica = gated_actors
    gate = Gate.remote()
    names = {"slow": "restart-test-slow", "quick": "restart-test-quick"}
    replicas = [  # kept referenced: the router finds them by name
        GatedReplica.options(name=names["slow"]).remote("slow", gate),
        GatedReplica.options(name=names["quick"]).remote("quick"),
    ]
    router = RouterActor.options(max_restarts=-1).remote(
        names, policy="round_robin", health_period=0.05, health_timeout=1.0
    )

    def status() -> dict | None:
        try:
            return get(router.status.remote())
        except ray.exceptions.RayActorError:  # restarting
            return None

    wait_until(lambda: get(router.is_up.remote("quick")), 60, "the built replica to be up")
    get(router.set_run.remote(7))  # a mark the restarted router, created afresh, does not carry
    ray.kill(router, no_restart=False)
    wait_until(lambda: (s := status()) is not None and s["run_id"] is None, 120, "the router to restart")
    wait_until(lambda: "quick" not in status()["down"], 60, "the built replica to answer the restarted router")
    time.sleep(1.5)  # past health_timeout: the slow replica's silence is not held against it
    held = status()
    assert held["down"] == {"slow": "starting"} and held["starting"] == ["slow"]
    assert [get(router.route.remote(RouteRequest(f"q{i}", 8, 8))) for i in range(3)] == ["quick"] * 3

    get(gate.open.remote())
    wait_until(lambda: get(router.is_up.remote("slow")), 60, "the slow replica, built, to be up")
    assert status()["down"] == {} and len(replicas) == 2


@pytest.mark.timeout(300)
def test_router_actor_routes_and_ships_decisions_to_the_store(dummy_actors):
    """Through Ray: route picks from reports, replicas() hands back working handles, complete
    and status keep the books, set_policy switches policy, and flush delivers the decisions
    made inside a run to the store, tagged with that run's id."""
    from router.actor import RouterActor

    DummyReplica, DummyStore = dummy_actors
    store = DummyStore.remote()
    handles = {"r0": DummyReplica.remote(), "r1": DummyReplica.remote()}
    router = RouterActor.remote(handles, policy="least_loaded", store=store)
    assert get(router.report.remote(load("r0", queue=5, running=4, free=0, t=0.0)))
    assert get(router.route.remote(RouteRequest("a", 16, 32))) == "r1"
    replicas = get(router.replicas.remote())
    assert get(replicas["r1"].ping.remote()) == "pong"
    get(router.set_run.remote(1))
    assert get(router.route.remote(RouteRequest("b", 16, 32, "sess"))) == "r1"
    assert get(router.complete.remote("a")) is True
    status = get(router.status.remote())
    assert status["run_id"] == 1 and status["replicas"]["r1"]["in_flight"] == 1
    assert status["replicas"]["r0"]["report"]["queue_depth"] == 5
    get(router.set_policy.remote("round_robin"))
    get(router.set_run.remote(2))
    assert get(router.route.remote(RouteRequest("c", 16, 32))) == "r0"  # round robin ignores r0's queue
    get(router.set_run.remote(None))
    get(router.route.remote(RouteRequest("d", 16, 32)))  # outside any run: not recorded
    get(router.flush.remote())
    rows = [(run, row) for run, batch in get(store.get.remote()) for row in batch]
    assert [(run, row["request_id"], row["policy"]) for run, row in rows] == [
        (1, "b", "least_loaded"),
        (2, "c", "round_robin"),
    ]
    row = rows[0][1]
    assert set(row) == {
        *("request_id", "time", "policy", "replica_id", "scores", "signal_age", "in_flight"),
        *("predicted_ttft", "believed_cached"),
    }
    assert row["replica_id"] == "r1" and row["policy"] == "least_loaded"
    assert json.loads(row["scores"]) == {"r0": 5.0, "r1": 1.0}
    assert json.loads(row["in_flight"]) == {"r0": 0, "r1": 1}
    assert row["signal_age"] >= 0.0


@pytest.mark.timeout(300)
def test_router_actor_batches_writes_and_survives_a_failing_store(dummy_actors):
    """Decisions go to the store in batches of at least `flush_every` (one write in flight; those
    made meanwhile join the next) and the rest on flush; a store that fails never fails routing,
    and the lost decisions are counted in status."""
    from router.actor import RouterActor

    DummyReplica, DummyStore = dummy_actors
    handles = {"r0": DummyReplica.remote()}
    store = DummyStore.remote()
    router = RouterActor.remote(handles, policy="round_robin", store=store, flush_every=3)
    get(router.set_run.remote(1))
    for i in range(7):
        assert get(router.route.remote(RouteRequest(f"q{i}", 8, 8))) == "r0"
    get(router.flush.remote())
    batches = [len(rows) for _, rows in get(store.get.remote())]
    assert sum(batches) == 7 and batches[0] == 3 and all(b >= 3 for b in batches[:-1]), batches

    broken = RouterActor.remote(handles, policy="round_robin", store=DummyStore.remote(fail=True), flush_every=3)
    get(broken.set_run.remote(1))
    for i in range(7):
        assert get(broken.route.remote(RouteRequest(f"q{i}", 8, 8))) == "r0"
    get(broken.flush.remote())
    status = get(broken.status.remote())
    assert (status["decisions_lost"], status["decisions_waiting"], status["routed"]) == (7, 0, 7)
