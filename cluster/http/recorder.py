"""The run that an HTTP ingress records its traffic under: opened when the ingress starts,
closed when it stops, so `slotserve report` reads live HTTP traffic like a driver's run.

Each request's trace becomes a row through `metrics.recording.request_row`, the path the
driver's rows take; rows go to the store actor in batches, at most `FLUSH_SECONDS` after the
request ended, so a report taken while the server runs sees what has finished. The replicas and
the router are told the run id, so their step samples and routing decisions land in it too."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import ray

from metrics.definitions import RequestTrace
from metrics.recording import request_row

FLUSH_ROWS = 64  # request rows per store write
FLUSH_SECONDS = 1.0  # the longest a finished request waits before its row is sent

logger = logging.getLogger(__name__)


class RunRecorder:
    def __init__(self, store, actors: list, run_id: int):
        self.store, self.actors, self.run_id = store, actors, run_id
        self._rows: list[dict] = []
        self._timer: asyncio.Task | None = None
        self.recorded = 0

    @classmethod
    def open(
        cls, store, router, replicas: list, name: str, config: dict, batching: str, routing: str, seed: int
    ) -> RunRecorder:
        """Begin a run in the store and tag the router's and replicas' records with it."""
        run_id = ray.get(store.begin_run.remote(name, config, batching, routing, seed, None), timeout=60)
        actors = [router, *replicas]
        ray.get([a.set_run.remote(run_id) for a in actors], timeout=60)
        return cls(store, actors, run_id)

    def record(self, trace: RequestTrace) -> None:
        """Buffer one ended request's row (no await: this runs in a cancelled stream's cleanup)."""
        self._rows.append(request_row(trace))
        self.recorded += 1
        if len(self._rows) >= FLUSH_ROWS:
            self._send()

    def _send(self) -> None:
        rows, self._rows = self._rows, []
        if rows:
            self.store.add_requests.remote(self.run_id, rows)

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            self._send()

    def start(self) -> None:
        """Start the periodic flush on the running event loop."""
        self._timer = asyncio.get_running_loop().create_task(self._flush_periodically())

    async def flush(self) -> None:
        """Stop the periodic flush and write what is buffered."""
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        rows, self._rows = self._rows, []
        if rows:
            await self.store.add_requests.remote(self.run_id, rows)

    async def close(self, status: str = "complete") -> None:
        """Write what is buffered, have the replicas and router flush theirs, end the run."""
        try:
            await self.flush()
            await asyncio.gather(*[a.flush.remote() for a in self.actors])
        except ray.exceptions.RayError as err:  # a replica already gone: the run still ends
            logger.warning("run %s: flushing at close failed: %s", self.run_id, err)
            status = "failed"
        await self.store.end_run.remote(self.run_id, status)
