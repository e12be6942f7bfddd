"""The router as a Ray actor: a thin shell around `Router` that holds the replica handles and
ships decisions to the metrics store in batches.

Clients ask it for a replica id, then talk to that replica's handle directly: the router sees
one call per request at dispatch and one at completion, never a token. It asks Ray for no CPU
(its own work is tens of microseconds per call). Its methods are synchronous and run one at a
time, so the `Router` inside needs no lock; and on the 2-core development machine a no-op
synchronous actor took 1.3-1.6x the calls per second of an async one
(benchmarks/router_throughput.py prints both next to this actor's figures).
"""

from __future__ import annotations

import logging

import ray
from ray.actor import ActorHandle

from protocol.messages import LoadReport
from router.load import RouteRequest
from router.policies import DEFAULT_POLICY
from router.router import Decision, Router

ROUTER_ACTOR_NAME = "slotserve-router"
FLUSH_EVERY = 100

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class RouterActor:
    def __init__(
        self,
        replica_handles: dict[str, ActorHandle],
        policy: str = DEFAULT_POLICY,
        seed: int = 0,
        store: ActorHandle | None = None,
        flush_every: int = FLUSH_EVERY,
    ):
        """`store`, if given, receives `add_decision_records.remote(run_id, decisions)` every `flush_every`
        decisions and on `flush()`. Decisions are recorded only inside a run (from
        `set_run(run_id)` to `set_run(None)`), like the replicas' step samples."""
        self._handles = dict(replica_handles)
        self._router = Router(list(replica_handles), policy, seed=seed)
        self._store = store
        self._flush_every = flush_every
        self._run_id: int | None = None
        self._rows: list[Decision] = []  # all belong to the current run
        self._write: tuple[ray.ObjectRef, int] | None = None  # newest store write and its row count
        self._store_errors = 0
        self._decisions_lost = 0

    def route(self, request_id: str, prompt_len: int, max_tokens: int, session_id: str | None = None) -> str:
        """The id of the replica to send the request to (its handle is in `replicas()`)."""
        decision = self._router.route(RouteRequest(request_id, prompt_len, max_tokens, session_id))
        self._take_decisions()
        if len(self._rows) >= self._flush_every:
            self._settle(self._start_write())
        return decision.replica_id

    def route_many(self, requests: list[tuple[str, int, int, str | None]]) -> list[str]:
        """`route` for several requests in one call: (request_id, prompt_len, max_tokens,
        session_id) each. A call through Ray costs far more than a decision, so a client
        routing a burst of arrivals sends them together."""
        return [self.route(*request) for request in requests]

    def replicas(self) -> dict[str, ActorHandle]:
        return dict(self._handles)

    def complete(self, request_id: str) -> bool:
        return self._router.complete(request_id)

    def set_policy(self, policy: str) -> None:
        """Switch routing policy between runs (see `Router.set_policy`)."""
        self._router.set_policy(policy)

    def report(self, load_report: LoadReport) -> bool:
        return self._router.report(load_report)

    def status(self) -> dict:
        return {
            **self._router.status(),
            "run_id": self._run_id,
            "decisions_buffered": len(self._rows),
            "store_errors": self._store_errors,
            "decisions_lost": self._decisions_lost,
        }

    def set_run(self, run_id: int | None) -> None:
        """Record decisions from now on under `run_id` (None: stop recording); those buffered
        so far go out under the previous run."""
        self._take_decisions()
        previous = self._start_write()
        self._run_id = run_id
        self._settle(previous)

    def flush(self) -> None:
        """Send every decision made so far and wait until the store has them."""
        self._take_decisions()
        previous = self._start_write()
        newest, self._write = self._write, None
        self._settle(previous)
        self._settle(newest)

    def _take_decisions(self) -> None:
        decisions = self._router.drain_decisions()
        if self._store is not None and self._run_id is not None:
            self._rows.extend(decisions)

    def _start_write(self) -> tuple[ray.ObjectRef, int] | None:
        """Send the buffered rows as one write and return the write it replaces as newest, for
        the caller to wait for: at most one write is left outstanding, so a slow store slows
        routing down a little instead of growing the actor's memory."""
        previous, self._write = self._write, None
        if self._rows:
            self._write = (self._store.add_decision_records.remote(self._run_id, self._rows), len(self._rows))
            self._rows = []
        return previous

    def _settle(self, write: tuple[ray.ObjectRef, int] | None) -> None:
        """Wait for a store write; a failure is logged and counted, never raised into routing."""
        if write is None:
            return
        ref, num_rows = write
        try:
            ray.get(ref)
        except Exception as exc:  # the store's failure must not fail a client's request
            self._store_errors += 1
            self._decisions_lost += num_rows
            logger.warning("metrics store dropped %d routing decisions: %s", num_rows, exc)
