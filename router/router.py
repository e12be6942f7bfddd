"""The router without Ray: a routing policy over the router's load view, and a log of every
decision with the scores and signal ages it was made from. The Ray actor is a thin shell
around it (router/actor.py); tests and the simulator use it directly with a virtual clock."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

from protocol.clock import Clock, WallClock
from protocol.messages import LoadReport
from router.errors import RoutingError
from router.load import LoadView, RouteRequest
from router.policies import DEFAULT_POLICY, make_routing_policy


@dataclass(frozen=True)
class Decision:
    """One routing decision. `scores` and `in_flight` are what the policy saw, before this
    request was counted; `signal_age` is the age of the oldest load report that went into a
    score (None when the policy used none, or no replica has reported yet)."""

    request_id: str
    replica_id: str
    time: float
    policy: str
    scores: dict[str, float]
    signal_age: float | None
    in_flight: dict[str, int]


class Router:
    def __init__(
        self,
        replica_ids: list[str],
        policy: str = DEFAULT_POLICY,
        clock: Clock | None = None,
        seed: int = 0,
        max_decisions: int = 10_000,
    ):
        """`max_decisions` bounds the undrained decision log; past it the oldest are dropped
        and counted in `decisions_dropped`."""
        if not replica_ids:
            raise RoutingError("a router needs at least one replica; got none")
        self.seed = seed
        self.policy = make_routing_policy(policy, seed)
        self.clock = clock or WallClock()
        self.load = LoadView(replica_ids)
        self._decisions: deque[Decision] = deque(maxlen=max_decisions)
        self.decisions_dropped = 0
        self.routed = 0

    @property
    def replica_ids(self) -> list[str]:
        return self.load.replica_ids

    def route(self, request: RouteRequest) -> Decision:
        """Choose a replica, count the request in flight there, and log the decision."""
        owner = self.load.owner(request.request_id)
        if owner is not None:
            raise RoutingError(f"request {request.request_id!r} is already in flight on {owner!r}")
        now = self.clock.now()
        views = self.load.views(now)
        index, scores = self.policy.choose(request, views)
        ages = [v.report_age for v, s in zip(views, scores) if v.report_age is not None and not math.isinf(s)]
        decision = Decision(
            request_id=request.request_id,
            replica_id=views[index].replica_id,
            time=now,
            policy=self.policy.name,
            scores={v.replica_id: s for v, s in zip(views, scores)},
            signal_age=max(ages) if ages and self.policy.uses_load else None,
            in_flight={v.replica_id: v.in_flight for v in views},
        )
        self.load.dispatched(decision.replica_id, request.request_id)
        if len(self._decisions) == self._decisions.maxlen:
            self.decisions_dropped += 1
        self._decisions.append(decision)
        self.routed += 1
        return decision

    def set_policy(self, policy: str) -> None:
        """Route with another policy from now on (a fresh one, seeded as at construction);
        requests in flight and load reports carry over, so consecutive runs compare policies
        on the same view."""
        self.policy = make_routing_policy(policy, self.seed)

    def complete(self, request_id: str) -> bool:
        """The request ended on its replica. Idempotent; returns whether it was in flight."""
        return self.load.completed(request_id)

    def report(self, load: LoadReport) -> bool:
        """A replica's load report; returns whether it was kept (not stale, replica known)."""
        if not isinstance(load, LoadReport):
            raise RoutingError(f"a load report must be a LoadReport, got {type(load).__name__}")
        return self.load.update(load)

    def drain_decisions(self) -> list[Decision]:
        drained = list(self._decisions)
        self._decisions.clear()
        return drained

    def add_replica(self, replica_id: str) -> None:
        self.load.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        if self.load.replica_ids == [replica_id]:
            raise RoutingError(f"cannot remove {replica_id!r}: it is the last replica")
        self.load.remove_replica(replica_id)

    def status(self) -> dict:
        views = self.load.views(self.clock.now())
        return {
            "policy": self.policy.name,
            "routed": self.routed,
            "decisions_dropped": self.decisions_dropped,
            "unknown_completions": self.load.unknown_completions,
            "stale_reports": self.load.stale_reports,
            "unknown_reports": self.load.unknown_reports,
            "replicas": {
                v.replica_id: {
                    "in_flight": v.in_flight,
                    "report": None if v.report is None else asdict(v.report),
                    "report_age": v.report_age,
                }
                for v in views
            },
        }
