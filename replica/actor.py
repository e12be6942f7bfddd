"""The Ray actor around one replica: a thin shell over `AsyncEngine`.

It streams tokens straight to each client (one Ray streaming generator per client, one
message per step), tells the router its load and each completion through the handle it is
given, and pushes step samples to the metrics store in bounded batches. It knows the router
and the store only as handles: `replica` imports neither package.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import ray

from protocol.errors import SlotServeError
from protocol.messages import LoadReport, StreamEvent
from replica.engine import RequestOutput, StepRecord
from replica.serving import AsyncEngine, ReplicaConfig, build_engine, report_due

STEP_BATCH = 64  # step samples per store write


@ray.remote
class ReplicaActor:
    def __init__(self, replica_id: str, config: dict[str, Any]):
        self.replica_id = replica_id
        self.config = ReplicaConfig.model_validate(config)
        self.serving = AsyncEngine(
            build_engine(self.config), self._on_step, self._on_finish, self._on_load, replica_id=replica_id
        )
        self.router = None
        self.store = None
        self.run_id: int | None = None
        self._steps: list[StepRecord] = []
        self._pending: dict[str, list[StreamEvent]] = {}  # this step's events, per subscriber
        self._outboxes: dict[str, asyncio.Queue] = {}
        self._last_report = 0.0

    def attach(self, router=None, store=None) -> None:
        """Given after creation, since the router is made from the replicas' handles. The
        first load report goes out now, so the router knows this replica's free slots."""
        self.router, self.store = router, store
        self._last_report = 0.0
        self._on_load(self.serving.load())

    def info(self) -> dict:
        engine = self.serving.engine
        return {
            "replica_id": self.replica_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "policy": engine.config.policy,
            "model": engine.config.model,
            "num_slots": engine.config.num_slots,
            "vocab_size": engine.runner.vocab_size,
            "fake_step_seconds": self.config.fake_step_seconds,
            "load": self.serving.load(),
        }

    async def submit(
        self,
        subscriber: str,
        prompt: str | list[int],
        params: dict | None,
        request_id: str,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request whose events go to `subscriber`'s stream (see `events`). A refused
        request raises its InvalidRequestError here, and the router is told it is done."""
        try:
            await self.serving.submit(prompt, params, request_id, arrival_time, partial(self._collect, subscriber))
        except SlotServeError:
            if self.router is not None:
                self.router.complete.remote(request_id)
            raise

    async def events(self, subscriber: str) -> AsyncIterator[list[StreamEvent]]:
        """The subscriber's event stream: one message per step, holding every token that step
        made for any of the subscriber's requests. Batching per step, not per token, keeps the
        cost of streaming through Ray flat as batches grow (like vLLM's per-step outputs)."""
        outbox = self._outboxes.setdefault(subscriber, asyncio.Queue())
        while (batch := await outbox.get()) is not None:
            yield batch
        del self._outboxes[subscriber]

    def close_events(self, subscriber: str) -> None:
        """End the subscriber's stream (the client is going away)."""
        self._outboxes.setdefault(subscriber, asyncio.Queue()).put_nowait(None)

    def _collect(self, subscriber: str, out: RequestOutput) -> None:
        self._pending.setdefault(subscriber, []).append(
            StreamEvent(
                out.request_id,
                self.replica_id,
                out.new_token_ids,
                out.new_text,
                out.time,
                out.finished,
                out.finish_reason.value if out.finish_reason else None,
                out.error,
            )
        )
        if len(self._pending) == 1 and len(self._pending[subscriber]) == 1:
            # The step's other outputs are delivered in this same loop iteration: send them together.
            asyncio.get_running_loop().call_soon(self._send_pending)

    def _send_pending(self) -> None:
        for subscriber, batch in self._pending.items():
            self._outboxes.setdefault(subscriber, asyncio.Queue()).put_nowait(batch)
        self._pending = {}

    def abort(self, request_id: str) -> None:
        self.serving.abort(request_id)

    async def set_run(self, run_id: int | None) -> None:
        """Tag step samples from now on with this run (flushing the previous run's); its
        requests are still to come."""
        await self.flush()
        self.run_id = run_id
        self.serving.set_arrivals_done(False)

    def set_arrivals_done(self, done: bool) -> None:
        """The driver says whether more requests may come before a running one ends."""
        self.serving.set_arrivals_done(done)

    async def flush(self) -> int:
        """Push buffered step samples to the store and wait until they are written."""
        records, self._steps = self._steps, []
        if records and self.store is not None and self.run_id is not None:
            await self.store.add_step_records.remote(self.run_id, self.replica_id, self._num_slots, records)
        return len(records)

    # ---- callbacks from the serving loop --------------------------------------------------
    def _on_step(self, record: StepRecord) -> None:
        if self.run_id is None:
            return
        self._steps.append(record)
        if len(self._steps) >= STEP_BATCH and self.store is not None:
            records, self._steps = self._steps, []
            # fire and forget: never stall the loop
            self.store.add_step_records.remote(self.run_id, self.replica_id, self._num_slots, records)

    def _on_finish(self, output: RequestOutput) -> None:
        if self.router is not None:
            self.router.complete.remote(output.request_id)

    @property
    def _num_slots(self) -> int:
        return self.serving.engine.config.num_slots

    def _on_load(self, load: LoadReport) -> None:
        now = time.monotonic()
        if self.router is None or not report_due(load, now - self._last_report):
            return
        self._last_report = now
        self.router.report.remote(load)
