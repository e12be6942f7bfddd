"""Online output-length estimates for routing on work: learned from the lengths of finished
requests, never from `max_tokens` (a replayed workload forces max_tokens to the true length,
so reading it would be an oracle no real router has).

`MeanLength` is the running mean of every finished request (what `least_work` uses).
`BucketedLength` (what `predicted_length` uses, after Jain et al. 2024 in its simplest form):
a session's last output length when the session has finished a turn, else the median of the
last outputs of requests with a prompt of similar length (power-of-two buckets), else the
running mean. Both start from `prior` tokens before anything has finished. `OutputResiduals`
(what `predicted_latency` uses) gives running requests the output still to come, by what they made.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import OrderedDict, deque

from protocol.routing import RouteRequest


class MeanLength:
    name = "mean"

    def __init__(self, prior: float = 64.0):
        self.prior = prior
        self.count = 0
        self.total = 0

    def estimate(self, request: RouteRequest) -> float:
        return self.total / self.count if self.count else self.prior

    def observe(self, request: RouteRequest, output_len: int) -> None:
        self.count += 1
        self.total += output_len


class BucketedLength(MeanLength):
    name = "bucketed"

    def __init__(self, prior: float = 64.0, window: int = 64, min_samples: int = 5, max_sessions: int = 100_000):
        super().__init__(prior)
        self.window, self.min_samples, self.max_sessions = window, min_samples, max_sessions
        self._buckets: dict[int, deque[int]] = {}
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def estimate(self, request: RouteRequest) -> float:
        if request.session_id is not None and request.session_id in self._sessions:
            return float(self._sessions[request.session_id])
        recent = self._buckets.get(_bucket(request.prompt_len))
        if recent is not None and len(recent) >= self.min_samples:
            return float(statistics.median(recent))
        return super().estimate(request)

    def observe(self, request: RouteRequest, output_len: int) -> None:
        super().observe(request, output_len)
        self._buckets.setdefault(_bucket(request.prompt_len), deque(maxlen=self.window)).append(output_len)
        if request.session_id is not None:
            self._sessions[request.session_id] = output_len
            self._sessions.move_to_end(request.session_id)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)


def _bucket(prompt_len: int) -> int:
    return max(prompt_len, 1).bit_length()


OUTPUT_WINDOW = 256  # finished outputs the residuals are read from


class OutputResiduals:
    """The output still to come of the decoding rows of one replica, from the lengths of the last
    `window` finished requests. A row that has made `made` tokens has ahead of it one of the
    `length - made` of those longer than `made`; the rows are ranked by the median of theirs, and
    the row of rank j of k is given the (j + 1/2) / k quantile of its own, so the rows together
    spread as their lengths do: the first slot frees when the shortest of them ends, which is
    sooner than the median of any one (`made` again for a row longer than all: it has run as
    long as the longest seen). Before any has finished: the row's expected output less what it
    made, else `made`."""

    def __init__(self, window: int = OUTPUT_WINDOW):
        self._lengths: deque[int] = deque(maxlen=window)
        self._ordered: list[int] | None = None  # the lengths sorted, until the next observed

    def observe(self, output_len: int) -> None:
        self._lengths.append(output_len)
        self._ordered = None

    def remaining(self, rows: list[tuple[float, int]]) -> list[float]:
        """Per decoding row (expected output, tokens made), its output still to come. The
        lengths longer than a row's `made` are a tail of the sorted lengths, read by position
        (the sort is kept until the next length comes: every replica's rows read it)."""
        if not self._lengths:
            return [expected - made if made < expected else float(max(1, made)) for expected, made in rows]
        if self._ordered is None:
            self._ordered = sorted(self._lengths)
        ordered, total = self._ordered, len(self._lengths)
        starts = [bisect.bisect_right(ordered, made) for _, made in rows]  # the first longer than made
        keys = [
            ordered[b + (total - b) // 2] - made if b < total else math.inf for b, (_, made) in zip(starts, rows)
        ]  # the median of the output still to come
        rank = sorted(range(len(rows)), key=keys.__getitem__)
        out = [0.0] * len(rows)
        for j, i in enumerate(rank):
            b, made = starts[i], rows[i][1]
            longer = total - b
            out[i] = float(ordered[b + int((j + 0.5) / len(rows) * longer)] - made) if longer else float(max(1, made))
        return out
