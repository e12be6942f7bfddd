"""One way to write a run into the metrics store, whatever produced it: the cluster (the driver,
the replicas and the router push rows as they go, each through the row function here), the
simulator and an in-process replay (`record_run`, all at once from plain traces). The rows are
the store's schema (docs/ARCHITECTURE.md); a step record and a routing decision (both
`protocol.records`) become rows field for field, under their fields' names."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from typing import Any

from metrics.definitions import RequestTrace
from protocol.records import Decision, StepRecord


def request_row(trace: RequestTrace) -> dict:
    """A finished request as a row of the store's `requests` table (its token times go to the
    `tokens` table). Times may be virtual and start at 0, so a missing one is None, never 0."""
    planned = trace.arrival if trace.planned_arrival is None else trace.planned_arrival
    return {
        "request_id": trace.request_id,
        "replica_id": trace.replica,
        "session_id": trace.session_id,
        "planned_arrival": planned,
        "arrival": trace.arrival,
        "submit_lateness": trace.submit_lateness,
        "first_token": trace.token_times[0] if trace.token_times else None,
        "completion": trace.finish_time,
        "prompt_len": trace.prompt_len,
        "output_len": trace.num_output_tokens,
        "max_tokens": trace.max_tokens,
        "finish_reason": trace.finish_reason,
        "error": trace.error,
        "token_times": trace.token_times,
        "num_preemptions": trace.num_preemptions,
        "cached_tokens": trace.cached_tokens,
        "priority": trace.priority,
        "tenant": trace.tenant,
    }


def _fields(record: StepRecord | Decision) -> dict[str, Any]:
    """A record's fields by name, not copied (`dataclasses.asdict` would deep-copy its dicts)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def step_row(replica_id: str, record: StepRecord, num_slots: int) -> dict:
    """An engine step as a row of the store's `steps` table."""
    return {"replica_id": replica_id, "num_slots": num_slots, **_fields(record)}


def decision_row(decision: Decision) -> dict:
    """A routing decision as a row of the store's `decisions` table: dicts as JSON strings, an
    infinite score (a replica power_of_two did not sample) as null."""
    scores = {k: v if math.isfinite(v) else None for k, v in decision.scores.items()}
    return {**_fields(decision), "scores": json.dumps(scores), "in_flight": json.dumps(decision.in_flight)}


def record_run(
    store,
    *,
    name: str,
    config: dict[str, Any],
    batching_policy: str,
    routing_policy: str,
    seed: int,
    traces: Iterable[RequestTrace],
    steps: Iterable[tuple[str, int, StepRecord]] = (),
    decisions: Iterable[Decision] = (),
    slo: dict | None = None,
    simulated: bool = False,
) -> int:
    """Write a whole run (config, requests with their token times, steps as (replica id, slots,
    record), decisions) into `store` and mark it complete; returns its run id."""
    run_id = store.begin_run(name, config, batching_policy, routing_policy, seed, slo, simulated=simulated)
    store.add_requests(run_id, [request_row(t) for t in traces])
    store.add_steps(run_id, [step_row(replica_id, record, num_slots) for replica_id, num_slots, record in steps])
    store.add_decisions(run_id, [decision_row(d) for d in decisions])
    store.end_run(run_id, "complete")
    return run_id
