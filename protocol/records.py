"""The records every run leaves, in the one shape each has: an engine step (`StepRecord`, made
by the engine, one row of the metrics store's `steps` table), a routing decision (`Decision`, made
by the router, one row of `decisions`). The store derives its columns from these fields
(`metrics.store`), so a field added here is a column there, under the same name.

`JsonObject` marks a dict that is a JSON document, not a message: a run's config, a store row,
a status read-out for people. `tests/test_protocol.py` accepts a dict on an actor's method only
when it is one of these, or a mapping keyed by ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

JSON = "a JSON object"  # the marker `JsonObject` carries (typing.Annotated metadata)
JsonObject = Annotated[dict[str, Any], JSON]


@dataclass(frozen=True)
class StepRecord:
    """One engine step of a replica, on the replica's clock."""

    step: int
    start: float
    duration: float
    num_decode_tokens: int
    num_prefill_tokens: int
    context_tokens: int  # keys attended, summed over rows (SchedulerOutput.context_tokens)
    live_slots: int
    useful_rows: int  # rows of unfinished requests
    computed_rows: int  # useful rows + padding rows of finished requests still in a static batch
    num_preemptions: int
    queue_depth: int


@dataclass(frozen=True)
class Decision:
    """One routing decision. `scores` and `in_flight` are what the policy saw, before this
    request was counted; `signal_age` is the age of the oldest load report that went into a
    score (None when the policy used none, or no replica has reported yet). `predicted_ttft`:
    the TTFT the policy predicted on the chosen replica, in seconds (None: it predicts none),
    counted from the client's send (`RouteRequest.sent_at`, where the router is told it) as the
    measured one is, which reports compare it with."""

    request_id: str
    replica_id: str
    time: float
    policy: str
    scores: dict[str, float]
    signal_age: float | None
    in_flight: dict[str, int]
    predicted_ttft: float | None = None
    # Prompt tokens the policy believed the chosen replica's prefix cache held (None: it does not
    # look at caches); the replica's count at admission (the request's `cached_tokens`) says how
    # stale that belief was.
    believed_cached: int | None = None
