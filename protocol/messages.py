"""The messages that cross process boundaries: a replica's load report (replica -> router, and
in the simulator) and a streamed token event (replica -> client). Plain frozen dataclasses, so
they travel through Ray as they are and both ends read the same named fields."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class LoadReport:
    """What a replica says about its load at a step boundary; `time` is when it took the
    report (its clock). `queue_depth` counts submissions not yet in the engine's queue too."""

    replica_id: str
    queue_depth: int
    running: int
    free_slots: int
    num_slots: int
    free_kv_tokens: int
    time: float


@dataclass(frozen=True)
class StreamEvent:
    """New tokens of one request from one engine step. `made` is when the replica made them
    (its clock); `received` is stamped by the client when the event reaches it. The last
    event of a request has finished=True and its finish reason (and error, if it failed)."""

    request_id: str
    replica_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    made: float = 0.0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    received: float | None = None

    @property
    def time(self) -> float:
        """When the client received the event (the client-side time every metric uses)."""
        return self.made if self.received is None else self.received

    def stamped(self, received: float) -> StreamEvent:
        return replace(self, received=received)
