"""What crosses to and from the router: a request to place (from a client, or a client's own
local router) and the view a client routing locally takes back from the router actor."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import defaults
from protocol.messages import KvEvents, LoadReport


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs to know about a request to place it. `block_hashes`: the chained
    hashes of the prompt's full blocks of `block_size` tokens (`protocol.blocks`), for
    prefix-aware policies; empty when the caller does not send them. `moved_from`: the replica
    the request is being moved off (lost or draining), whose place is released first.
    `sent_at`: when the client sent it, on the router's clock (wall time on a cluster; None: not
    told), where the TTFT a replica reports starts: what it waited before the router saw it is
    part of that TTFT and of no replica's queue."""

    request_id: str
    prompt_len: int
    max_tokens: int
    session_id: str | None = None
    block_hashes: tuple[int, ...] = ()
    block_size: int = defaults.BLOCK_SIZE
    moved_from: str | None = None
    sent_at: float | None = None

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
