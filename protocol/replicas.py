"""What a replica answers about itself (`ReplicaActor.info`), what a health check gets when no
answer came, the tokens a request carries to the replica it is moved to, and one request as a
client submits it among others (`ReplicaActor.submit_many`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.messages import HealthReport, LoadReport
from protocol.records import JsonObject


@dataclass(frozen=True)
class Resume:
    """A request moved off another replica continues after the `token_ids` (delivered to its
    caller as `text`) it already made there: they are prefilled with the prompt."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class Unreachable:
    """A health check that got no `HealthReport`: the replica is dead, or did not answer in time
    (`reason` says which), as of `time`."""

    replica_id: str
    reason: str
    time: float


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica's identity, limits and counters. `block_size` is the K/V block size its
    prompt-block hashes are taken at (`protocol.blocks`); `max_request_tokens` its context limit
    (prompt + max_tokens); `fake`: it serves the fake model (token ids only, no tokenizer).
    `config` is its `ReplicaConfig` as JSON (what a redeploy compares), `telemetry` its live
    counters (`ReplicaTelemetry.snapshot`). `steps_*` count its step records on the way to the
    metrics store: waiting, dropped past the backlog's bound, lost in refused writes."""

    replica_id: str
    node_id: str
    pid: int
    policy: str
    model: str
    num_slots: int
    block_size: int
    vocab_size: int
    max_request_tokens: int
    fake: bool
    fake_step_seconds: float | None
    config: JsonObject
    load: LoadReport
    health: HealthReport
    peak_queued: int
    peak_rss_mb: float
    rejected: int
    steps_waiting: int
    steps_dropped: int
    steps_failed: int
    telemetry: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class Submission:
    """One request for `ReplicaActor.submit_many`, with `ReplicaActor.submit`'s arguments:
    `params` a `replica.scheduling.request.SamplingParams` (or its fields), `handover_from` the
    actor handle of the replica that holds its K/V. A client sends the requests it places on one
    replica in one event-loop turn together: one Ray call for a burst, not one per request."""

    prompt: str | list[int]
    params: Any
    request_id: str
    arrival_time: float | None = None
    resume: Resume | None = None
    handover_from: Any = None
