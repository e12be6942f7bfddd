"""The metrics store as a Ray actor: the store's one writer, which replicas, router and driver
on any node push batches to. It delegates every call to a `MetricsStore`.

Start it on the node whose disk holds the file, with an absolute path (the actor's working
directory is Ray's, not the caller's); cluster/deploy.py does both. Replicas and the router send
their step records and decisions as they are; the rows are made here, by the same
`metrics.recording` functions the simulator records through."""

from __future__ import annotations

import dataclasses

import ray

from metrics.recording import decision_row, step_row
from metrics.store import open_store
from protocol.messages import MigrationRecord
from protocol.records import Decision, JsonObject, StepRecord
from protocol.scaling import ColdStart, ScalingDecision

STORE_ACTOR_NAME = "slotserve-store"


@ray.remote(num_cpus=0)
class StoreActor:
    def __init__(self, path: str):
        self.store = open_store(path)

    def path(self) -> str:
        """The store's file, on this actor's node: where a run through a running cluster is recorded."""
        return str(self.store.path)

    def begin_run(
        self,
        name: str,
        config: JsonObject,
        batching_policy: str,
        routing_policy: str,
        seed: int,
        slo: JsonObject | None = None,
        simulated: bool = False,
    ) -> int:
        return self.store.begin_run(name, config, batching_policy, routing_policy, seed, slo, simulated)

    def end_run(self, run_id: int, status: str = "complete") -> None:
        self.store.end_run(run_id, status)

    def add_requests(self, run_id: int, rows: list[JsonObject]) -> None:
        """Rows of the `requests` table (`metrics.recording.request_row`), token times included."""
        self.store.add_requests(run_id, rows)

    def add_step_records(self, run_id: int, replica_id: str, num_slots: int, records: list[StepRecord]) -> None:
        self.store.add_steps(run_id, [step_row(replica_id, r, num_slots) for r in records])

    def add_decision_records(self, run_id: int, decisions: list[Decision]) -> None:
        self.store.add_decisions(run_id, [decision_row(d) for d in decisions])

    def add_migrations(self, run_id: int, records: list[MigrationRecord]) -> None:
        """`MigrationRecord`s (protocol.messages) of the run's requests."""
        self.store.add_migrations(run_id, [dataclasses.asdict(r) for r in records])

    def add_scaling_records(self, run_id: int, decisions: list[ScalingDecision], cold_starts: list[ColdStart]) -> None:
        """The autoscaling controller's decisions and the cold starts of the replicas it started."""
        self.store.add_scaling(run_id, [dataclasses.asdict(d) for d in decisions])
        self.store.add_cold_starts(run_id, [dataclasses.asdict(c) for c in cold_starts])

    # Reads return the store's rows as stored (JSON objects keyed by column).
    def migrations(self, run_id: int) -> list[JsonObject]:
        return self.store.migrations(run_id)

    def runs(self) -> list[JsonObject]:
        return self.store.runs()

    def run(self, run_id: int) -> JsonObject:
        return self.store.run(run_id)

    def requests(self, run_id: int) -> list[JsonObject]:
        return self.store.requests(run_id)

    def steps(self, run_id: int) -> list[JsonObject]:
        return self.store.steps(run_id)

    def decisions(self, run_id: int) -> list[JsonObject]:
        return self.store.decisions(run_id)

    def scaling(self, run_id: int) -> list[JsonObject]:
        return self.store.scaling(run_id)

    def cold_starts(self, run_id: int) -> list[JsonObject]:
        return self.store.cold_starts(run_id)
