"""The Ray actor around one replica: a thin shell over `AsyncEngine`.

It streams each request's tokens straight to the caller (a Ray streaming generator), tells
the router its load and each completion through the handle it is given, and pushes step
samples to the metrics store in bounded batches. It knows the router and the store only as
handles: `replica` imports neither package.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, AsyncIterator

import ray

from replica.engine import RequestOutput, StepRecord
from replica.errors import SlotServeError
from replica.serving import AsyncEngine, LoadSnapshot, ReplicaConfig, build_engine

STEP_BATCH = 64  # step samples per store write
REPORT_INTERVAL = 0.02  # seconds between load reports while busy


@ray.remote
class ReplicaActor:
    def __init__(self, replica_id: str, config: dict[str, Any]):
        self.replica_id = replica_id
        self.config = ReplicaConfig.model_validate(config)
        self.serving = AsyncEngine(build_engine(self.config), self._on_step, self._on_finish, self._on_load)
        self.router = None
        self.store = None
        self.run_id: int | None = None
        self._steps: list[dict] = []
        self._last_report = 0.0

    def attach(self, router=None, store=None) -> None:
        """Given after creation, since the router is made from the replicas' handles. The
        first load report goes out now, so the router knows this replica's free slots."""
        self.router, self.store = router, store
        self._last_report = 0.0
        self._on_load(self.serving.load())

    def info(self) -> dict:
        engine = self.serving.engine
        return {"replica_id": self.replica_id, "node_id": ray.get_runtime_context().get_node_id(),
                "policy": engine.config.policy, "model": engine.config.model, "num_slots": engine.config.num_slots,
                "vocab_size": engine.runner.vocab_size,
                "fake_step_seconds": self.config.fake_step_seconds, "load": asdict(self.serving.load())}

    async def generate(self, prompt: str | list[int], params: dict | None, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[dict]:
        """Stream events {token_ids, text, finished, finish_reason, error, time, replica_id}.
        A rejected request raises its InvalidRequestError to the caller, and the router is
        told it is done."""
        try:
            async for out in self.serving.generate(prompt, params, request_id, arrival_time):
                yield {"token_ids": out.new_token_ids, "text": out.new_text, "finished": out.finished,
                       "finish_reason": out.finish_reason.value if out.finish_reason else None,
                       "error": out.error, "time": out.time, "replica_id": self.replica_id}
        except SlotServeError:
            if self.router is not None:
                self.router.complete.remote(request_id)
            raise

    def abort(self, request_id: str) -> None:
        self.serving.abort(request_id)

    def load(self) -> dict:
        return asdict(self.serving.load())

    async def set_run(self, run_id: int | None) -> None:
        """Tag step samples from now on with this run (flushing the previous run's)."""
        await self.flush()
        self.run_id = run_id

    async def flush(self) -> int:
        """Push buffered step samples to the store and wait until they are written."""
        rows, self._steps = self._steps, []
        if rows and self.store is not None and self.run_id is not None:
            await self.store.add_steps.remote(self.run_id, rows)
        return len(rows)

    # ---- callbacks from the serving loop --------------------------------------------------
    def _on_step(self, record: StepRecord) -> None:
        if self.run_id is None:
            return
        self._steps.append({
            "replica_id": self.replica_id, "step": record.step, "time": record.start, "duration": record.duration,
            "live_slots": record.live_slots, "num_slots": self.serving.engine.config.num_slots,
            "queue_depth": record.queue_depth, "decode_tokens": record.num_decode_tokens,
            "prefill_tokens": record.num_prefill_tokens, "useful_rows": record.useful_rows,
            "computed_rows": record.computed_rows, "preemptions": record.num_preemptions,
        })
        if len(self._steps) >= STEP_BATCH and self.store is not None:
            rows, self._steps = self._steps, []
            self.store.add_steps.remote(self.run_id, rows)  # fire and forget: never stall the loop

    def _on_finish(self, output: RequestOutput) -> None:
        if self.router is not None:
            self.router.complete.remote(output.request_id)

    def _on_load(self, load: LoadSnapshot) -> None:
        now = time.monotonic()
        if self.router is None or (load.running and now - self._last_report < REPORT_INTERVAL):
            return
        self._last_report = now
        self.router.report.remote({"replica_id": self.replica_id, **asdict(load)})
