"""The arrivals of the last `window_s` seconds, as the decisions' windows reported them, and
what the policies read off them: the mean work of a request and the offered load in replicas
(work seconds per second at one replica's capacity), now and extrapolated along its trend."""

from __future__ import annotations

from collections import deque

from protocol.scaling import ArrivalWindow
from workloads.capacity import Capacity


class ArrivalHistory:
    def __init__(self, window_s: float):
        if window_s <= 0:
            raise ValueError(f"an arrival window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self.windows: deque[ArrivalWindow] = deque()

    def add(self, window: ArrivalWindow) -> None:
        self.windows.append(window)
        while self.windows and self.windows[0].end <= window.end - self.window_s:
            self.windows.popleft()

    @property
    def seconds(self) -> float:
        return self.windows[-1].end - self.windows[0].start if self.windows else 0.0

    @property
    def requests(self) -> int:
        return sum(w.requests for w in self.windows)

    def _work(self, capacity: Capacity, window: ArrivalWindow) -> float:
        return capacity.work_seconds(window.prompt_tokens, window.output_tokens)

    def mean_work(self, capacity: Capacity) -> float | None:
        """Seconds of one replica's time (at saturation) a request of the window takes; None
        before any arrival."""
        n = self.requests
        return sum(self._work(capacity, w) for w in self.windows) / n if n else None

    def load(self, capacity: Capacity) -> float:
        """Offered load over the window, in replicas kept exactly busy."""
        seconds = self.seconds
        return sum(self._work(capacity, w) for w in self.windows) / seconds if seconds > 0 else 0.0

    def load_at(self, capacity: Capacity, when: float) -> float:
        """The offered load at `when` along the least-squares line through each window's load
        (at its midpoint): the trend a forecast extrapolates. The window's mean load with fewer
        than three windows to fit."""
        points = [((w.start + w.end) / 2, self._work(capacity, w) / w.seconds) for w in self.windows if w.seconds > 0]
        if len(points) < 3:
            return self.load(capacity)
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var = sum((t - mean_t) ** 2 for t, _ in points)
        slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / var if var > 0 else 0.0
        return max(0.0, mean_y + slope * (when - mean_t))
