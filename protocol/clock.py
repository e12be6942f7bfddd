"""Clocks injected into schedulers and engines, so the same policy code runs on wall time
(the real cluster) and on virtual time (tests, the simulator)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """Seconds since the epoch: comparable across processes on one machine, so a client's
    and a replica's stamps can be put on one timeline."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """Virtual time that moves only when told to: `sleep` advances it instantly."""

    def __init__(self, start: float = 0.0):
        self._now = start

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time ({seconds})")
        self._now += seconds

    advance = sleep
