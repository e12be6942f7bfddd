"""Rows on their way to the metrics store from a replica or the router, so that a store that
cannot keep up (a slow disk, a stalled store actor) slows no engine step and no routing
decision, and memory stays bounded.

At most one write is in flight; rows made meanwhile wait here and go out together as the next
write once it has finished. At most `limit` rows wait: past it the oldest are dropped and
counted (`dropped`), never silently. A write the store refuses is counted in `failed`. Writes
are `concurrent.futures.Future`s (a Ray `ObjectRef.future()`), so this module needs no Ray."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_LIMIT = 100_000  # rows: a step record or a decision is a few hundred bytes, so tens of MB at most


class StoreBacklog(Generic[T]):
    def __init__(self, send: Callable[[list[T]], Future], batch: int, limit: int = DEFAULT_LIMIT):
        """`send(rows)` starts one store write and returns its future; a write goes out once
        `batch` rows wait (or on `flush`)."""
        self._send = send
        self.batch = batch
        self.limit = limit
        self._rows: list[T] = []
        self._in_flight: tuple[Future, int] | None = None
        self.dropped = 0
        self.failed = 0

    @property
    def waiting(self) -> int:
        """Rows not yet sent."""
        return len(self._rows)

    def add(self, rows: Iterable[T]) -> None:
        """Queue rows; never waits on the store."""
        self._rows.extend(rows)
        overflow = len(self._rows) - self.limit
        if overflow > 0:
            del self._rows[:overflow]
            self.dropped += overflow
        self.pump()

    def pump(self, force: bool = False) -> Future | None:
        """Start the next write if the last one has finished and a batch waits (any rows with
        `force`); returns the write in flight, if any."""
        self._reap()
        if self._in_flight is None and self._rows and (force or len(self._rows) >= self.batch):
            rows, self._rows = self._rows, []
            self._in_flight = (self._send(rows), len(rows))
        return None if self._in_flight is None else self._in_flight[0]

    def flush(self, timeout: float | None = None) -> None:
        """Send every waiting row and wait until the store has them (for callers that may block:
        between runs, at shutdown)."""
        while (write := self.pump(force=True)) is not None:
            if not wait_futures([write], timeout).done:
                return  # the store is stalled: the rows stay queued for the next flush
            self._reap()

    def _reap(self) -> None:
        if self._in_flight is not None and self._in_flight[0].done():
            write, num_rows = self._in_flight
            self._in_flight = None
            if write.exception() is not None:
                self.failed += num_rows
