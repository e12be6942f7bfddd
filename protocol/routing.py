"""What crosses to and from the router: a request to place (from a client, or a client's own
local router) and the view a client routing locally takes back from the router actor."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import defaults
from protocol.errors import OverloadedError
from protocol.messages import KvEvents, LoadReport
from protocol.records import Decision


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs to know about a request to place it. `block_hashes`: the chained
    hashes of the prompt's full blocks of `block_size` tokens (`protocol.blocks`), for
    prefix-aware policies; empty when the caller does not send them. `moved_from`: the replica
    the request is being moved off (lost or draining), whose place is released first.
    `sent_at`: when the client sent it, on the router's clock (wall time on a cluster; None: not
    told), where the TTFT a replica reports starts: what it waited before the router saw it is
    part of that TTFT and of no replica's queue. `priority` and `tenant` are its class for flow
    control (`protocol.flow`): a lower priority is served first, as vLLM's `priority` field is;
    `deadline`, on the router's clock, is when a request still held for dispatch is refused
    rather than served late (None: it waits as long as its band allows)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    session_id: str | None = None
    block_hashes: tuple[int, ...] = ()
    block_size: int = defaults.BLOCK_SIZE
    moved_from: str | None = None
    sent_at: float | None = None
    priority: int = defaults.PRIORITY
    tenant: str = defaults.TENANT
    deadline: float | None = None

    def waited(self, now: float) -> float:
        """Seconds from the client's send to `now` on the router's clock (0 when not told; never
        below 0, should the two clocks disagree)."""
        return 0.0 if self.sent_at is None else max(0.0, now - self.sent_at)


@dataclass(frozen=True)
class RouterView:
    """The router actor's answer to a client that routes locally (`RouterActor.sync`): every
    replica's last load report, the replicas marked down with why, and every replica it holds
    (an autoscaler adds and removes them)."""

    reports: dict[str, LoadReport] = field(default_factory=dict)
    down: dict[str, str] = field(default_factory=dict)
    replica_ids: tuple[str, ...] = ()
    # Per replica, the K/V event batches the client's block index has not seen, in order (a
    # snapshot first, `reset`, when it is too far behind): a precise prefix index in every client.
    kv_events: dict[str, list[KvEvents]] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    """The router actor's answer to a client placing a request (`RouterActor.admit_many`): the
    replica to send it to, or None while flow control holds it, whose `Released` comes later to
    the client that sent it (`RouterActor.released`)."""

    request_id: str
    replica_id: str | None

    @property
    def held(self) -> bool:
        return self.replica_id is None


@dataclass(frozen=True)
class Released:
    """A request flow control held (`Router.submit` answered None) that has since left the
    queue: dispatched, with its `decision`, or refused, with its `refusal` (its deadline or its
    band's `max_wait` passed, or it was shed past `max_held`; `retry_after` from the queue's
    drain rate). Exactly one of the two is set."""

    request_id: str
    decision: Decision | None = None
    refusal: OverloadedError | None = None

    def __post_init__(self) -> None:
        if (self.decision is None) == (self.refusal is None):
            raise ValueError(f"released request {self.request_id!r} needs exactly one of a decision and a refusal")
