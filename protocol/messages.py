"""The messages that cross process boundaries: a replica's load report (replica -> router, and
in the simulator), a streamed token event (replica -> client), a health answer (replica ->
router) and a request's move (client -> store). Plain frozen dataclasses, so they travel
through Ray as they are and both ends read the same named fields. The router's messages are in
`protocol.routing`, a replica's answers about itself in `protocol.replicas`, the records a run
leaves in `protocol.records`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from protocol.cost import StepPricing
from protocol.finish import FinishReason


@dataclass(frozen=True)
class LoadReport:
    """What a replica says about its load at a step boundary; `time` is when it took the
    report (its clock). `queue_depth` counts submissions not yet in the engine's queue too.
    The work fields count the engine's requests (queued and running): `prefill_tokens_pending`
    prompt tokens not computed yet, `decode_tokens_made` output tokens made so far, and
    `tokens_made` the same per request id (a router that reserved an expected output length
    per request releases it by this)."""

    replica_id: str
    queue_depth: int
    running: int
    free_slots: int
    num_slots: int
    free_kv_tokens: int
    time: float
    prefill_tokens_pending: int = 0
    decode_tokens_made: int = 0
    tokens_made: dict[str, int] = field(default_factory=dict)
    kv_events: KvEvents | None = None  # a paged prefix cache's changes since the last report sent
    # Seconds from arrival to first token, per request it holds that has made one (a router
    # predicting TTFT learns each replica's error from them), and how its steps are priced when
    # it knows (a fake replica's cost model; a router predicting latency prices its queue by it).
    ttft: dict[str, float] = field(default_factory=dict)
    pricing: StepPricing | None = None
    # The most K/V tokens its requests may hold at once (its budget; 0: not said): with long
    # prompts it admits fewer requests than it has slots.
    kv_capacity_tokens: int = 0


@dataclass(frozen=True)
class KvEvents:
    """What entered and left a replica's prefix cache since its last batch, as chained block
    hashes (`protocol.blocks`): a router's precise block index is kept from them. Batches are
    numbered (`seq`, one more each batch) so a router that misses one sees the gap. `reset`: the
    router drops what it holds of this replica first, and `stored` is then the whole cache (a
    snapshot): sent by a replica that just started, one whose changes outgrew a report's bound,
    or one asked for a snapshot. `stored` and `removed` never share a hash."""

    seq: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False


@dataclass(frozen=True)
class Completion:
    """A request that ended on a replica (replica -> router), `output_len` its tokens on a
    natural end (None when cut short: a length estimate must not learn a length it never had).
    A replica sends those of one loop turn in one call (`RouterActor.complete_many`)."""

    request_id: str
    replica_id: str
    output_len: int | None = None


@dataclass(frozen=True)
class StreamEvent:
    """New tokens of one request from one engine step. `made` is when the replica made them
    (its clock); `received` is stamped by the client when the event reaches it. The last
    event of a request has finished=True and its finish reason (and error, if it failed).
    `handed_over`: on a `migrate` ending, the request's K/V wait on this replica for the next
    one to fetch (`ReplicaActor.take_handover`: prefill/decode disaggregation) instead of
    being computed again. `cached_tokens`, on the last event: the prompt tokens this replica's
    prefix cache held when it first admitted the request (None: never admitted, or no count),
    which the client's trace and the store keep (a prefix-aware router's index staleness)."""

    request_id: str
    replica_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    made: float = 0.0
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    received: float | None = None
    handed_over: bool = False
    cached_tokens: int | None = None

    @property
    def time(self) -> float:
        """When the client received the event (the client-side time every metric uses)."""
        return self.made if self.received is None else self.received

    def stamped(self, received: float) -> StreamEvent:
        return replace(self, received=received)


@dataclass(frozen=True)
class HealthReport:
    """A replica's answer to a health check. `healthy` is False when its step loop raised
    (`loop_error`) or has been inside one step, with work waiting, for longer than its stall
    limit (`last_step_age`): an actor that still answers calls is not enough. `attached` says
    whether it knows its router (a replica Ray restarted does not, until the router attaches it
    again); `draining` that it admits nothing new."""

    replica_id: str
    healthy: bool
    reason: str | None
    last_step_age: float
    loop_error: str | None
    running: int
    queued: int
    subscribers: int
    draining: bool
    attached: bool
    time: float


@dataclass(frozen=True)
class MigrationRecord:
    """One move of a request to another replica after the one serving it was lost or drained,
    or handed it over (a prefill replica, once the first token is out): the new replica
    prefills the prompt and the `tokens_carried` tokens already delivered, then continues, so
    the client's stream has no gap and no duplicate; or it takes their K/V from the old one,
    `kv_bytes` of them in `kv_seconds` (`kv_seconds` None: no fetch was tried; `kv_bytes` 0
    after one: it failed, and they were computed again). `to_replica` is None when no replica
    could take it (the request then ends with an error)."""

    request_id: str
    from_replica: str
    to_replica: str | None
    tokens_carried: int
    reason: str
    time: float
    kv_bytes: int = 0
    kv_seconds: float | None = None
