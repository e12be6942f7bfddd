"""Clocks injected into schedulers, engines and the serving loop, so the same code runs on
wall time (the real cluster) and on virtual time (tests, the simulator). `sleep` blocks the
caller; `asleep` is the serving loop's timer, awaited on its event loop."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    async def asleep(self, seconds: float) -> None: ...


class WallClock:
    """Seconds since the epoch: comparable across processes on one machine, so a client's
    and a replica's stamps can be put on one timeline."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """Virtual time that moves only when told to: `sleep` and `asleep` advance it instantly (a
    timer awaited on it fires at once, at its time)."""

    def __init__(self, start: float = 0.0):
        self._now = start

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time ({seconds})")
        self._now += seconds

    advance = sleep

    async def asleep(self, seconds: float) -> None:
        self.sleep(max(0.0, seconds))
        await asyncio.sleep(0)  # still a turn of the event loop, as a real timer is
