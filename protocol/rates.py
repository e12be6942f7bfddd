"""The recent completion rate, and the retry-after hint an overloaded queue derives from it:
the replica's waiting queue and the router's in-flight bound refuse with the same estimate."""

from __future__ import annotations

from collections import deque

MIN_RETRY_AFTER, MAX_RETRY_AFTER = 0.05, 60.0  # seconds: never "now", never "give up"


class CompletionRate:
    """Completions per second over the last `window` of them (times on the caller's clock)."""

    def __init__(self, window: int = 64):
        self._times: deque[float] = deque(maxlen=window)

    def add(self, now: float) -> None:
        self._times.append(now)

    def retry_after(self, ahead: int, default: float = 1.0) -> float:
        """Seconds until `ahead` more requests have completed at the recent rate, clamped to
        [MIN_RETRY_AFTER, MAX_RETRY_AFTER]; `default` before two completions give a rate."""
        t = self._times
        if len(t) < 2 or t[-1] <= t[0]:
            return default
        return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, ahead * (t[-1] - t[0]) / (len(t) - 1)))
