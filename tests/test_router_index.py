"""The router's index of routable replicas (`router.load.RoutableIndex`): a policy that chooses
from it makes every decision the same as one that scores every replica's view, through
dispatches, completions, reports, replicas marked down and up, bounds reached, and replicas
added and removed. Pure: a fake clock, no Ray."""

from __future__ import annotations

import random

import pytest

from protocol.clock import FakeClock
from protocol.errors import OverloadedError
from router import LoadReport, Router, RouteRequest
from router.load import ReplicaView

INDEXED = ("least_loaded", "power_of_two")


class EveryView(Router):
    """A router whose policy scores every routable replica's view (`Router._choose` overridden,
    as a two-pool router overrides it), the path every policy took before the index."""

    def _choose(self, request, now):
        views = self.load.routable_views(now)
        return self.policy, views, *self.policy.choose(request, views)


def reference_routable(router: Router, now: float) -> list[ReplicaView]:
    """The routable views as the router filtered them before the index: every view in order of
    addition, less those down, less those at the per-replica bound."""
    up = [v for v in router.load.views(now) if v.replica_id not in router.down]
    return [v for v in up if v.in_flight < router.max_in_flight_per_replica]


def random_report(replica_id: str, rng: random.Random, t: float) -> LoadReport:
    free = rng.randint(0, 4)  # ties between equal scores are common: the tie-break is exercised
    return LoadReport(
        replica_id,
        queue_depth=rng.randint(0, 3) if free == 0 else 0,
        running=4 - free,
        free_slots=free,
        num_slots=4,
        free_kv_tokens=256 * free,
        time=t,
    )


def drive(routers: list[Router], clock: FakeClock, seed: int, steps: int = 3000) -> int:
    """Apply one random sequence of events to every router, asserting after each route that
    they all chose the same replica with the same figures. Returns the decisions made."""
    rng = random.Random(seed)
    first = routers[0]
    in_flight: list[str] = []
    next_replica = len(first.replica_ids)
    decisions = 0
    for step in range(steps):
        clock.sleep(rng.random() * 0.01)
        now = clock.now()
        ids = first.replica_ids
        event = rng.random()
        if event < 0.5:
            request = RouteRequest(f"q{step}", 16, 32)
            outcomes = []
            for router in routers:
                try:
                    outcomes.append(router.route(request))
                except OverloadedError as err:
                    outcomes.append(str(err))
            assert all(o == outcomes[0] for o in outcomes[1:]), (step, outcomes)
            if not isinstance(outcomes[0], str):
                in_flight.append(request.request_id)
                decisions += 1
        elif event < 0.75 and in_flight:
            request_id = in_flight.pop(rng.randrange(len(in_flight)))
            assert len({router.complete(request_id, output_len=8) for router in routers}) == 1
        elif event < 0.9:
            report = random_report(rng.choice(ids), rng, now - rng.random() * 0.05)
            assert len({router.report(report) for router in routers}) == 1
        elif event < 0.95:
            replica_id = rng.choice(ids)
            if replica_id in first.down:
                assert len({router.mark_up(replica_id) for router in routers}) == 1
            else:
                assert len({tuple(router.mark_down(replica_id, "lost")) for router in routers}) == 1
        elif event < 0.98 or len(ids) == 1:
            for router in routers:
                router.add_replica(f"r{next_replica}")
            next_replica += 1
        else:
            replica_id = rng.choice(ids)
            for router in routers:
                router.remove_replica(replica_id)
        for router in routers:
            assert router.load.routable_views(now) == reference_routable(router, now)
            up = [v.in_flight for v in router.load.views(now) if v.replica_id not in router.down]
            assert (router.load.up_count, router.load.up_in_flight) == (len(up), sum(up))
    return decisions


@pytest.mark.parametrize("policy", INDEXED)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_indexed_choices_are_those_of_scoring_every_view(policy, seed):
    """Decisions, with every replica's scores and in-flight counts, are equal whether the policy
    chooses from the index or scores every view; the per-replica bound is small, so replicas
    leave and rejoin the routable set as their requests come and go."""
    clock = FakeClock()
    kwargs = {"policy": policy, "clock": clock, "seed": seed, "max_in_flight_per_replica": 3}
    ids = [f"r{i}" for i in range(6)]
    indexed, reference = Router(ids, **kwargs), EveryView(ids, **kwargs)
    assert drive([indexed, reference], clock, seed) > 500
    assert indexed.rejected == reference.rejected > 0


@pytest.mark.parametrize("policy", (*INDEXED, "round_robin", "least_work"))
def test_without_decision_figures_a_decision_holds_the_chosen_replica_only(policy):
    """`decision_figures=False` keeps the choices (indexed or not) and records only the chosen
    replica's score, in-flight count and report age."""
    clock = FakeClock()
    ids = [f"r{i}" for i in range(5)]
    full = Router(ids, policy, clock, seed=3, max_in_flight_per_replica=4)
    light = Router(ids, policy, clock, seed=3, max_in_flight_per_replica=4, decision_figures=False)
    rng = random.Random(3)
    for i in range(400):
        clock.sleep(0.01)
        if i % 3 == 0:
            report = random_report(ids[i % 5], rng, clock.now() - 0.02)
            full.report(report)
            light.report(report)
        request = RouteRequest(f"q{i}", 16, 32)
        try:
            a = full.route(request)
        except OverloadedError:
            with pytest.raises(OverloadedError):
                light.route(request)
            continue
        b = light.route(request)
        chosen = a.replica_id
        assert b.replica_id == chosen and b.scores == {chosen: a.scores[chosen]}
        assert b.in_flight == {chosen: a.in_flight[chosen]}
        view = light.load.view(chosen, clock.now())
        assert b.signal_age == (view.report_age if full.policy.uses_load else None)
        if i % 2:
            full.complete(f"q{i - 1}")
            light.complete(f"q{i - 1}")


def test_the_least_loaded_tie_break_takes_turns_from_the_cursor():
    """Equal replicas take turns in order of addition, skipping one marked down, and the first
    comes again once the last has had its turn, as `RoutingPolicy._pick` does over every score."""
    clock = FakeClock()
    router = Router(["a", "b", "c", "d"], "least_loaded", clock, decision_figures=False)
    for replica_id in "abcd":
        router.report(LoadReport(replica_id, 0, 0, 4, 4, 1024, 0.0))
    router.mark_down("b", "draining")
    chosen = [router.route(RouteRequest(f"q{i}", 8, 8)).replica_id for i in range(3)]
    assert chosen == ["a", "c", "d"]
    for i in range(3):
        router.complete(f"q{i}")
    router.mark_up("b")
    router.report(LoadReport("b", 0, 0, 4, 4, 1024, 0.0))  # marking it down dropped its last report
    assert [router.route(RouteRequest(f"p{i}", 8, 8)).replica_id for i in range(2)] == ["a", "b"]
