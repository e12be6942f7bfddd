"""The router without Ray: a routing policy over the router's load view, and a log of every
decision with the scores and signal ages it was made from. The Ray actor is a thin shell
around it (router/actor.py); tests and the simulator use it directly with a virtual clock.

It also keeps the cluster's front door bounded: a replica marked down (lost, unhealthy or
draining) gets nothing until it is marked up again, and past `max_in_flight_per_replica` on
every replica that is up, or `max_in_flight` in all, a request is refused at once with an
OverloadedError whose retry-after is the time the recent completion rate needs to free a place.

A decision costs O(log n) in the replicas when the policy chooses from the load view's index of
routable replicas (`RoutingPolicy.indexed`: `least_loaded`, `power_of_two`) and the router keeps
no per-replica figures (`decision_figures=False`, what a simulated day on hundreds of replicas
asks for); otherwise building every replica's view and figures makes it O(n).

With a flow-control config (`Router(flow=)`, `protocol.flow`) callers place requests with
`submit`, not `route`: it admits the request (its priority band, its tenant's limits) and routes
it at once unless every replica is saturated, when it holds it (`router.flow_control`). Whenever
the view changes (a report, a completion, a replica up) and on `tick` (deadlines) the router
releases what it can; `take_released` hands over what left the queues since. Without a config,
and with policy "fcfs", nothing is ever held."""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import asdict

from protocol import defaults
from protocol.clock import Clock, WallClock
from protocol.errors import OverloadedError
from protocol.flow import FlowConfig
from protocol.messages import LoadReport
from protocol.rates import CompletionRate
from protocol.records import Decision
from protocol.routing import Released, RouteRequest
from router.block_index import BlockIndex
from router.errors import RoutingError
from router.flow_control import FlowController, make_flow_controller, replica_saturated
from router.load import LoadView, ReplicaView
from router.policies import DEFAULT_POLICY, RoutingPolicy, make_routing_policy


class Router:
    def __init__(
        self,
        replica_ids: list[str],
        policy: str = DEFAULT_POLICY,
        clock: Clock | None = None,
        seed: int = 0,
        max_decisions: int = 10_000,
        max_in_flight_per_replica: int = defaults.MAX_IN_FLIGHT_PER_REPLICA,
        max_in_flight: int | None = None,
        tpot_slo: float = defaults.TPOT_SLO,
        decision_figures: bool = True,
        flow: FlowConfig | None = None,
    ):
        """`max_decisions` bounds the undrained decision log; past it the oldest are dropped
        and counted in `decisions_dropped`. `max_in_flight` defaults to
        `max_in_flight_per_replica` times the replicas. `tpot_slo`: the TPOT limit of the SLO
        the run is judged by, which a policy that predicts TPOT routes within.
        `decision_figures=False`: a decision's `scores` and `in_flight` hold the chosen
        replica's figures alone, and its `signal_age` is that replica's report age (for a
        caller that keeps no decisions; the choices are the same). `flow`: flow control (see
        the module docstring; None: none)."""
        if not replica_ids:
            raise RoutingError("a router needs at least one replica; got none")
        if max_in_flight_per_replica < 1 or (max_in_flight is not None and max_in_flight < 1):
            raise RoutingError(
                "in-flight bounds must be at least 1; "
                f"got {max_in_flight_per_replica} per replica, {max_in_flight} in all"
            )
        _check_tpot_slo(tpot_slo)
        self.max_in_flight = max_in_flight or max_in_flight_per_replica * len(replica_ids)
        self.down: dict[str, str] = {}  # replica id -> why it gets no requests
        self.rejected = 0
        self._completions = CompletionRate()
        self.seed = seed
        self.tpot_slo = tpot_slo
        self.block_index = BlockIndex()  # what each replica's prefix cache holds, from its K/V events
        self.policy = make_routing_policy(policy, seed, tpot_slo)
        self.policy.attach_block_index(self.block_index)
        self.clock = clock or WallClock()
        self.load = LoadView(replica_ids, max_in_flight_per_replica)
        self.decision_figures = decision_figures
        self._decisions: deque[Decision] = deque(maxlen=max_decisions)
        self.decisions_dropped = 0
        self.routed = 0
        # whether the decision being made chose among `load.routable_views`, all of them
        # (`_choose`; a two-pool router's choose among a pool's)
        self._every_routable = False
        self.flow: FlowController | None = None if flow is None else make_flow_controller(flow, self.clock)
        self._band_of: dict[str, int] = {}  # request in flight -> its band
        self._bands_in_flight: Counter[int] = Counter()  # requests in flight per band (none at 0)
        self._released: list[Released] = []

    @property
    def replica_ids(self) -> list[str]:
        return self.load.replica_ids

    @property
    def max_in_flight_per_replica(self) -> int:
        return int(self.load.max_in_flight_per_replica)

    def route(self, request: RouteRequest) -> Decision:
        """Choose a replica that is up and under its bound, count the request in flight there,
        and log the decision. A request `moved_from` a replica (lost or draining) releases its
        place there first."""
        owner, moved_from = self.load.owner(request.request_id), request.moved_from
        if owner is not None and owner == moved_from:
            self.load.completed(request.request_id, moved_from)
        elif owner is not None:
            raise RoutingError(f"request {request.request_id!r} is already in flight on {owner!r}")
        now = self.clock.now()
        self._check_capacity()
        self._every_routable = False
        policy, views, index, scores = self._choose(request, now)
        if not self.decision_figures and len(views) > 1:
            views, scores, index = [views[index]], [scores[index]], 0
        chosen = views[index].replica_id
        signal_age = None
        if self._every_routable:  # the views are `routable_views`: their ids, counts and oldest age are kept
            ids, in_flight = self.load.routable.ordered_ids(), dict(self.load.routable_in_flight())
            if policy.uses_load:
                infinite = math.inf in scores or -math.inf in scores
                signal_age = _oldest_signal(views, scores) if infinite else self.load.oldest_age
        else:
            ids = [v.replica_id for v in views]
            in_flight = dict(zip(ids, [v.in_flight for v in views]))
            if policy.uses_load:
                signal_age = _oldest_signal(views, scores)
        decision = Decision(
            request_id=request.request_id,
            replica_id=chosen,
            time=now,
            policy=policy.name,
            scores=dict(zip(ids, scores)),
            signal_age=signal_age,
            in_flight=in_flight,
            predicted_ttft=_from_send(policy.predicted_ttft(chosen), request.waited(now)),
            believed_cached=policy.believed_cached(request, chosen),
        )
        self.load.dispatched(decision.replica_id, request.request_id)
        if self.flow is not None:
            self._placed(request.request_id, request.priority)
        policy.dispatched(request, decision.replica_id, now)
        if len(self._decisions) == self._decisions.maxlen:
            self.decisions_dropped += 1
        self._decisions.append(decision)
        self.routed += 1
        return decision

    def submit(self, request: RouteRequest) -> Decision | None:
        """Place a request under flow control: its decision, or None once it is held (its
        decision or refusal comes later, from `take_released`; a refusal at once when holding it
        went past `max_held` and it was the one shed). Raises UnknownPriorityError for
        a band not configured, and OverloadedError for a tenant over a limit or, as `route`
        does, where no replica can take it; without flow control it is `route`."""
        flow = self.flow
        if flow is None:
            return self.route(request)
        flow.admit(request)
        if not flow.holds(request.priority, lambda: self._saturated(request.priority)):
            return self._dispatch(request)
        self._released += flow.hold(request)
        self._release()
        return None

    def take_released(self) -> list[Released]:
        """The held requests dispatched or refused since the last call, in that order."""
        released, self._released = self._released, []
        return released

    def tick(self) -> None:
        """Refuse held requests whose deadline has come, and release what the view allows."""
        if self.flow is not None and self.flow.num_held:
            self._release()

    def withdraw(self, request_id: str) -> bool:
        """Forget a held request whose caller left before it was dispatched."""
        return self.flow is not None and self.flow.withdraw(request_id)

    def next_tick(self) -> float | None:
        """When `tick` next has a deadline to refuse (None: none held has one)."""
        return None if self.flow is None else self.flow.next_expiry()

    def _dispatch(self, request: RouteRequest) -> Decision:
        decision = self.route(request)
        self.flow.dispatched(request)
        return decision

    def _release(self) -> None:
        """Refuse the expired, then dispatch held requests in the policy's order while some
        replica is not saturated."""
        flow = self.flow
        self._released += flow.expire()
        while (band := flow.next_band()) is not None and not self._saturated(band):
            request = flow.pop_next()
            self._released.append(Released(request.request_id, decision=self._dispatch(request)))

    def _saturated(self, priority: int) -> bool:
        """No replica can take a request of band `priority` now: every routable replica is
        saturated (`protocol.flow.SaturationConfig`) and none runs a request less urgent than it
        (a replica's scheduler lets a more urgent request take such a one's place, so holding
        it here would only make it wait), or none is routable, or the router's own bound on
        requests in flight is reached."""
        if not len(self.load.routable) or self.load.up_in_flight >= self.max_in_flight:
            return True
        if any(band > priority for band in self._bands_in_flight):
            return False
        config, now = self.flow.config.saturation, self.clock.now()
        return all(replica_saturated(view, config) for view in self.load.routable_views(now))

    def _placed(self, request_id: str, priority: int | None) -> None:
        """Keep the bands of the requests in flight (a placement, or `priority` None: its end)."""
        old = self._band_of.pop(request_id, None)
        if old is not None:
            self._bands_in_flight[old] -= 1
            if not self._bands_in_flight[old]:
                del self._bands_in_flight[old]
        if priority is not None:
            self._band_of[request_id] = priority
            self._bands_in_flight[priority] += 1

    def _choose(self, request: RouteRequest, now: float) -> tuple[RoutingPolicy, list[ReplicaView], int, list[float]]:
        """The policy that chose, the replicas it chose among, the index of its choice and its
        scores: here the one policy over every routable replica (a two-pool router picks a pool
        first, `router.pd_router`). A policy that chooses from the index of routable replicas
        (`RoutingPolicy.indexed`) builds every replica's view and score only for
        `decision_figures`, in rank order."""
        policy = self.policy
        if not policy.indexed:
            views = self.load.routable_views(now)
            self._every_routable = self.decision_figures
            return policy, views, *policy.choose(request, views)
        index, looked = policy.choose_indexed(request, self.load.routable)
        if not self.decision_figures:
            return policy, [self.load.view(self.load.routable.replica_at(index), now)], 0, [looked[index]]
        views = self.load.routable_views(now)
        self._every_routable = True
        return policy, views, index, policy.indexed_scores(views, looked, self.load.routable)

    def _check_capacity(self) -> None:
        """OverloadedError when no replica is up, `max_in_flight` is reached, or every replica
        up is at `max_in_flight_per_replica`."""
        if not self.load.up_count:
            down = ", ".join(f"{r}: {why}" for r, why in self.down.items())
            raise self._reject("router", 0, f"no replica is up ({down})", 1.0)
        total = self.load.up_in_flight
        if total >= self.max_in_flight:
            raise self._reject("router", self.max_in_flight, f"{total} requests in flight", None, total)
        if not len(self.load.routable):
            raise self._reject(
                "router", self.max_in_flight_per_replica, "requests in flight on every replica that is up", None, 1
            )

    def _reject(self, where: str, limit: int, detail: str, retry_after: float | None, ahead: int = 1):
        self.rejected += 1
        if retry_after is None:
            retry_after = self.retry_after(ahead - limit + 1 if ahead > limit else 1)
        return OverloadedError(where, limit, retry_after, detail)

    def retry_after(self, ahead: int) -> float:
        """Seconds until `ahead` more requests complete at the recent completion rate
        (`protocol.rates`, the replicas' estimate too)."""
        return self._completions.retry_after(ahead)

    def mark_down(self, replica_id: str, reason: str) -> list[str]:
        """Route nothing to the replica until `mark_up`; the requests in flight on it are
        forgotten (their clients move them) and returned."""
        self.load.set_down(replica_id, True)
        self.down[replica_id] = reason
        lost = self.load.forget_in_flight(replica_id)
        if self.flow is not None:
            for request_id in lost:  # charged as dispatched: what it made there was served
                self._placed(request_id, None)
                self.flow.completed(request_id, None)
        return lost

    def mark_up(self, replica_id: str) -> bool:
        """Route to the replica again (a health check passed); returns whether it was down."""
        self.load.set_down(replica_id, False)
        was_down = self.down.pop(replica_id, None) is not None
        self.tick()
        return was_down

    def set_policy(self, policy: str, tpot_slo: float | None = None) -> None:
        """Route with another policy from now on (a fresh one, seeded as at construction), within
        the next run's TPOT SLO `tpot_slo` (None: the one routed within so far); requests in
        flight and load reports carry over, so consecutive runs compare policies on the same view."""
        tpot_slo = self.tpot_slo if tpot_slo is None else tpot_slo
        _check_tpot_slo(tpot_slo)
        self.policy = make_routing_policy(policy, self.seed, tpot_slo)
        self.tpot_slo = tpot_slo
        self.policy.attach_block_index(self.block_index)

    def complete(self, request_id: str, replica_id: str | None = None, output_len: int | None = None) -> bool:
        """The request ended on its replica, having made `output_len` tokens (if known: policies
        that estimate output lengths learn from it). With `replica_id`, only its owner's word
        counts (a replica it was moved off may still report it). Idempotent; returns whether it
        was in flight."""
        if replica_id is not None and self.load.owner(request_id) not in (None, replica_id):
            return self.load.completed(request_id, replica_id)  # counted as unknown, changes nothing
        self.policy.completed(request_id, output_len)
        done = self.load.completed(request_id, replica_id)
        if done:
            self._completions.add(self.clock.now())
            if self.flow is not None:
                self._placed(request_id, None)
                self.flow.completed(request_id, output_len)
                self.tick()
        return done

    def report(self, load: LoadReport) -> bool:
        """A replica's load report; returns whether it was kept (not stale, replica known)."""
        if not isinstance(load, LoadReport):
            raise RoutingError(f"a load report must be a LoadReport, got {type(load).__name__}")
        if load.kv_events is not None and self.load.knows(load.replica_id):
            self.block_index.apply(load.replica_id, load.kv_events)  # in batch order, even from a stale report
        kept = self.load.update(load)
        if kept:
            self.policy.reported(load)
            self.tick()
        return kept

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
        self.block_index.forget(replica_id)
        self.down.pop(replica_id, None)

    def status(self) -> dict:
        views = self.load.views(self.clock.now())
        flow = {} if self.flow is None else {"flow": self.flow.status()}
        return {
            **flow,
            "policy": self.policy.name,
            "tpot_slo": self.tpot_slo,
            "routed": self.routed,
            "decisions_dropped": self.decisions_dropped,
            "unknown_completions": self.load.unknown_completions,
            "stale_reports": self.load.stale_reports,
            "unknown_reports": self.load.unknown_reports,
            "rejected": self.rejected,
            "down": dict(self.down),
            "max_in_flight": self.max_in_flight,
            "max_in_flight_per_replica": self.max_in_flight_per_replica,
            "kv_index": {  # the precise block index the replicas' K/V events keep
                "blocks": {r: self.block_index.num_blocks(r) for r in self.load.replica_ids},
                "gaps": self.block_index.gaps,
                "ignored": self.block_index.ignored,
                "snapshots_wanted": sorted(self.block_index.snapshots_wanted),
            },
            "replicas": {
                v.replica_id: {
                    "in_flight": v.in_flight,
                    "report": None if v.report is None else asdict(v.report),
                    "report_age": v.report_age,
                }
                for v in views
            },
        }


def _check_tpot_slo(tpot_slo: float) -> None:
    if not tpot_slo > 0:
        raise RoutingError(f"tpot_slo must be a positive number of seconds per output token; got {tpot_slo}")


def _oldest_signal(views: list[ReplicaView], scores: list[float]) -> float | None:
    """The oldest report age among the replicas a decision scored finitely (None: none had
    reported)."""
    oldest = None
    for view, score in zip(views, scores):
        age = view.report_age
        if age is not None and score != math.inf and score != -math.inf and (oldest is None or age > oldest):
            oldest = age
    return oldest


def _from_send(predicted: float | None, waited: float) -> float | None:
    """A policy's predicted TTFT (from its decision) plus what the request waited before the
    router saw it (`RouteRequest.waited`): the TTFT as the client measures it."""
    return None if predicted is None else predicted + waited
