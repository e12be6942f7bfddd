"""Flow control between admission and dispatch: while every replica is saturated the router
holds requests here, in one queue per priority band and tenant, and releases them as the
replicas free up (llm-d's flow controller). Pure, on an injected clock; the `Router` asks it.

- Admission (`admit`): the request's band must be one of the config's, and its tenant within its
  token buckets (requests/s and tokens/s, each holding `burst` seconds of its rate; a request's
  tokens are its prompt plus its `max_tokens`, all it may cost). A tenant over a limit is refused
  at once, its retry-after when the bucket will hold the request.
- Dispatch order (`pop_next`): strict priority between bands (a lower band number first); within
  a band the policy's one decision, `_next_tenant`: the tenant whose oldest held request came
  first (`priority`), or the one with the smallest virtual token counter (`vtc`). FIFO within a
  tenant. `fcfs` overrides `holds` instead: it never holds, so it is the router without flow
  control.
- VTC's counters (kept under every policy, so a report can read each tenant's service): at
  dispatch a tenant is charged `prompt_weight x prompt_len + output_weight x max_tokens`, over
  its weight; when the router hears the request ended with its output length it is refunded the
  output it did not make. Charging the bound at dispatch, not the tokens as they come, is what
  the router can do: it hears of a request's output once, at its end, and a tenant whose long
  outputs are still running would otherwise look owed service and get more dispatched meanwhile.
  A tenant that becomes backlogged in a band again has its counter lifted to the smallest
  counter of the tenants backlogged there (none: to the last served one's), so time idle is
  never banked as credit.
- Refusals: a held request past its `deadline` or its band's `max_wait` is refused, never
  dispatched late; past `max_held` the newest request of the least urgent band is shed. Both
  with a retry-after from the queues' recent drain rate (`protocol.rates.CompletionRate` over
  the dispatches out of them) times the requests held ahead of it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocol.clock import Clock
from protocol.errors import OverloadedError, SlotServeError
from protocol.flow import FlowConfig, SaturationConfig
from protocol.rates import CompletionRate
from protocol.registry import Registry
from protocol.routing import Released, RouteRequest
from router.errors import RoutingError
from router.load import ReplicaView


class FlowInvariantViolation(SlotServeError, RuntimeError):
    """Flow control's bookkeeping broke a rule that must always hold (a bug, never user error)."""


@dataclass(slots=True)
class Waiting:
    request: RouteRequest
    since: float
    seq: int  # arrival order among held requests
    expires: float  # its deadline or its band's max_wait, whichever is first (inf: none)


class TokenBucket:
    """`rate` units a second, holding at most `capacity`. A request costing more than the
    capacity passes when the bucket is full and leaves it in debt, so no request is refused
    forever."""

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity, self.level, self._at = rate, capacity, capacity, now

    def wait(self, cost: float, now: float) -> float:
        """Seconds until the bucket holds `cost` (0: it does now)."""
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now
        return max(0.0, (min(cost, self.capacity) - self.level) / self.rate)

    def take(self, cost: float) -> None:
        self.level -= cost


def replica_saturated(view: ReplicaView, config: SaturationConfig) -> bool:
    """See `protocol.flow.SaturationConfig`. Before its first report a replica's queue is all
    the router has in flight there."""
    if view.est_queue >= config.queue_depth:
        return True
    report = view.report
    return (
        report is not None
        and report.kv_capacity_tokens > 0
        and (report.free_kv_tokens < config.min_free_kv * report.kv_capacity_tokens)
    )


class FlowController:
    """The `priority` policy: strict priority between bands, first come first served within one."""

    name = "priority"

    def __init__(self, config: FlowConfig, clock: Clock):
        self.config, self.clock = config, clock
        self._bands: dict[int, dict[str, deque[Waiting]]] = {band: {} for band in config.priorities}
        self._held: dict[str, Waiting] = {}
        self._expiries: list[tuple[float, int, str]] = []  # heap; entries of released requests left in
        self._seq = itertools.count()
        self.counters: dict[str, float] = {}  # tenant -> VTC counter: weighted tokens over its weight
        self._last_served: dict[int, str] = {}  # band -> tenant dispatched last from it
        self._charged: dict[str, tuple[str, int]] = {}  # request id -> tenant, output tokens charged
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._drain = CompletionRate()
        self.refused = {"limit": 0, "expired": 0, "shed": 0}

    # ---- the policy's one decision (and `fcfs`'s) -------------------------------------------
    def _next_tenant(self, queues: dict[str, deque[Waiting]]) -> str:
        """The tenant of the band whose held request goes next."""
        return min(queues, key=lambda tenant: queues[tenant][0].seq)

    def holds(self, priority: int, saturated: Callable[[], bool]) -> bool:
        """Whether a new request of band `priority` is held rather than routed now: while others
        as urgent or more are held already (it must not pass them), or the cluster is saturated
        for it (asked only then: it looks at every replica)."""
        return self.next_band() is not None and self.next_band() <= priority or saturated()

    def next_band(self) -> int | None:
        """The most urgent band that holds a request (None: none held)."""
        return next((band for band, queues in self._bands.items() if queues), None)

    # ---- admission and holding -------------------------------------------------------------
    def admit(self, request: RouteRequest) -> None:
        """UnknownPriorityError for a band not configured; OverloadedError for a tenant over a limit."""
        self.config.check_priority(request.priority)
        tenant, now = self.config.tenant(request.tenant), self.clock.now()
        costs = {"requests_per_s": 1.0, "tokens_per_s": float(request.prompt_len + request.max_tokens)}
        buckets = []
        for limit, cost in costs.items():
            rate = getattr(tenant, limit)
            if rate is None:
                continue
            bucket = self._buckets.get((request.tenant, limit))
            if bucket is None:
                bucket = self._buckets[request.tenant, limit] = TokenBucket(rate, rate * tenant.burst, now)
            wait = bucket.wait(cost, now)
            if wait > 0:
                self.refused["limit"] += 1
                detail = f"tenant {request.tenant!r} is over its {limit} limit of {rate:g}"
                raise OverloadedError(f"tenant {request.tenant}", math.ceil(bucket.capacity), wait, detail)
            buckets.append((bucket, cost))
        for bucket, cost in buckets:
            bucket.take(cost)

    def hold(self, request: RouteRequest) -> list[Released]:
        """Queue the request; returns what was shed to keep within `max_held` (this one, if it is
        the newest of the least urgent band)."""
        if request.request_id in self._held:
            raise RoutingError(f"request {request.request_id!r} is already held")
        now = self.clock.now()
        wait = self.config.max_wait.get(request.priority, math.inf)
        expires = min(now + wait, math.inf if request.deadline is None else request.deadline)
        held = Waiting(request, now, next(self._seq), expires)
        queues = self._bands[request.priority]
        if request.tenant not in queues:
            self._lift(request.tenant, request.priority)
            queues[request.tenant] = deque()
        queues[request.tenant].append(held)
        self._held[request.request_id] = held
        if expires < math.inf:
            heapq.heappush(self._expiries, (expires, held.seq, request.request_id))
        return self._shed() if len(self._held) > self.config.max_held else []

    def _lift(self, tenant: str, band: int) -> None:
        backlogged = [self.counters.get(t, 0.0) for t in self._bands[band]]
        last = self._last_served.get(band)
        floor = min(backlogged) if backlogged else self.counters.get(last, 0.0) if last is not None else 0.0
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _shed(self) -> list[Released]:
        """Refuse the newest held request of the least urgent band holding any."""
        band = max(b for b, queues in self._bands.items() if queues)
        newest = max((q[-1] for q in self._bands[band].values()), key=lambda h: h.seq)
        self._remove(newest, from_tail=True)
        self.refused["shed"] += 1
        detail = f"{self.config.max_held} requests held; priority {band} is shed first"
        return [self._refusal(newest, "router flow control", self.config.max_held, detail)]

    def expire(self) -> list[Released]:
        """Refuse every held request whose deadline or band's max_wait has come."""
        now, refused = self.clock.now(), []
        while self._expiries and self._expiries[0][0] <= now:
            held = self._held_entry(heapq.heappop(self._expiries))
            if held is None:
                continue
            self._remove(held)
            self.refused["expired"] += 1
            bound = (
                "its deadline"
                if held.request.deadline == held.expires
                else f"priority {held.request.priority} max_wait"
            )
            detail = f"held {now - held.since:.2f} s: refused rather than served late"
            refused.append(self._refusal(held, bound, math.ceil(held.expires - held.since), detail))
        return refused

    def _held_entry(self, entry: tuple[float, int, str]) -> Waiting | None:
        """The held request an expiry entry stands for; None once it left the queues (an entry
        is left in the heap then, and its request may since be held again, under a new seq)."""
        held = self._held.get(entry[2])
        return held if held is not None and held.seq == entry[1] else None

    def next_expiry(self) -> float | None:
        """When the next held request expires (None: none will), for a caller's timer."""
        while self._expiries and self._held_entry(self._expiries[0]) is None:
            heapq.heappop(self._expiries)
        return self._expiries[0][0] if self._expiries else None

    def _refusal(self, held: Waiting, where: str, limit: int, detail: str) -> Released:
        ahead = sum(
            len(q) for band, queues in self._bands.items() if band <= held.request.priority for q in queues.values()
        )
        error = OverloadedError(where, limit, self._drain.retry_after(ahead + 1), detail)
        return Released(held.request.request_id, refusal=error)

    def _remove(self, held: Waiting, from_tail: bool = False) -> None:
        request = held.request
        queues = self._bands[request.priority]
        queue = queues[request.tenant]
        if from_tail:
            queue.pop()
        else:
            queue.remove(held)
        if not queue:
            del queues[request.tenant]
        del self._held[request.request_id]

    def withdraw(self, request_id: str) -> bool:
        """Drop a held request whose caller has gone: it is never dispatched (False: not held)."""
        held = self._held.get(request_id)
        if held is None:
            return False
        self._remove(held)
        return True

    # ---- dispatch and service --------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._held)

    def pop_next(self) -> RouteRequest | None:
        """The held request to dispatch next (None: none held), out of its queue."""
        for band, queues in self._bands.items():  # bands in ascending order: most urgent first
            if queues:
                tenant = self._next_tenant(queues)
                held = queues[tenant].popleft()
                if not queues[tenant]:
                    del queues[tenant]
                del self._held[held.request.request_id]
                self._last_served[band] = tenant
                self._drain.add(self.clock.now())
                return held.request
        return None

    def dispatched(self, request: RouteRequest) -> None:
        """The request went to a replica: charge its tenant's counter its prompt and its output bound."""
        cost = self.config.prompt_weight * request.prompt_len + self.config.output_weight * request.max_tokens
        self._charge(request.tenant, cost)
        self._charged[request.request_id] = (request.tenant, request.max_tokens)

    def completed(self, request_id: str, output_len: int | None) -> None:
        """The request ended; with its output length known, refund the output it did not make."""
        charged = self._charged.pop(request_id, None)
        if charged is not None and output_len is not None:
            tenant, bound = charged
            self._charge(tenant, -self.config.output_weight * max(0, bound - output_len))

    def _charge(self, tenant: str, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.config.tenant(tenant).weight

    def held_by_band(self) -> dict[int, int]:
        return {band: sum(len(q) for q in queues.values()) for band, queues in self._bands.items()}

    def status(self) -> dict:
        return {
            "policy": self.name,
            "held": self.held_by_band(),
            "counters": dict(self.counters),
            "refused": dict(self.refused),
        }

    def check_invariants(self) -> None:
        """Every held request in exactly one queue (its band's, its tenant's), in arrival order;
        no empty queue kept; every counter at or above zero."""
        queued: list[str] = []
        for band, queues in self._bands.items():
            for tenant, queue in queues.items():
                if not queue:
                    raise FlowInvariantViolation(f"empty queue kept for tenant {tenant!r} in band {band}")
                seqs = [h.seq for h in queue]
                if seqs != sorted(seqs):
                    raise FlowInvariantViolation(f"tenant {tenant!r}'s queue in band {band} is out of order")
                for held in queue:
                    if (held.request.priority, held.request.tenant) != (band, tenant):
                        raise FlowInvariantViolation(f"{held.request.request_id!r} is queued in the wrong queue")
                    queued.append(held.request.request_id)
        if len(queued) != len(set(queued)) or set(queued) != set(self._held):
            raise FlowInvariantViolation(
                f"{len(queued)} queued entries ({len(set(queued))} distinct) for {len(self._held)} held requests"
            )
        negative = {t: c for t, c in self.counters.items() if c < -1e-9}
        if negative:
            raise FlowInvariantViolation(f"VTC counters below zero: {negative}")


class FcfsFlow(FlowController):
    """`fcfs`: every request is routed at once, as without flow control (admission still applies)."""

    name = "fcfs"

    def holds(self, priority: int, saturated: Callable[[], bool]) -> bool:
        return False


class VtcFlow(FlowController):
    """`vtc`: within a band, the backlogged tenant with the smallest virtual token counter goes next."""

    name = "vtc"

    def _next_tenant(self, queues: dict[str, deque[Waiting]]) -> str:
        return min(queues, key=lambda tenant: (self.counters.get(tenant, 0.0), queues[tenant][0].seq))


FLOW_CONTROLLERS: Registry[type[FlowController]] = Registry(
    "flow-control policy", {"fcfs": FcfsFlow, "priority": FlowController, "vtc": VtcFlow}
)


def make_flow_controller(config: FlowConfig, clock: Clock) -> FlowController:
    return FLOW_CONTROLLERS[config.policy](config, clock)
