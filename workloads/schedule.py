"""What to submit when: the one object every replayer (in-process replay, cluster driver,
simulator) asks, so open and closed loops are replayed the same way everywhere.

Times are seconds relative to the start of the run. An open-loop workload's arrivals are
planned up front. A closed loop (`Workload.closed_loop`) releases the first `users` requests
at t=0 (request i belongs to user i % users, in order) and each user's next request
`think_time` after the replayer reports its previous one `finished`."""

from __future__ import annotations

import heapq

from workloads.workload import Workload, WorkloadRequest


class ArrivalSchedule:
    def __init__(self, workload: Workload):
        self.workload = workload
        requests = workload.requests
        closed = workload.closed_loop
        first = range(len(requests)) if closed is None else range(min(closed.users, len(requests)))
        # (planned time, index): ties go in request order.
        self._planned = [(0.0 if closed is not None else requests[i].arrival, i) for i in first]
        heapq.heapify(self._planned)
        self._sent: set[int] = set()
        self._finished: set[int] = set()

    def due(self, now: float, start: float = 0.0) -> list[tuple[int, WorkloadRequest, float]]:
        """(index, request, planned time) of every request due at `now` and not yet handed out,
        in planned order; each is handed out once. A replayer on an absolute clock passes its
        run's `start` and its absolute `now`: the test `start + planned <= now` is the same sum
        it sleeps to (`start + next_time()`), so float rounding never leaves a request behind
        its own wake-up."""
        out = []
        while self._planned and start + self._planned[0][0] <= now:
            planned, i = heapq.heappop(self._planned)
            self._sent.add(i)
            out.append((i, self.workload.requests[i], planned))
        return out

    def next_time(self) -> float | None:
        """The next planned arrival; None when every request was handed out, or when the rest
        wait on requests still running (closed loop)."""
        return self._planned[0][0] if self._planned else None

    def finished(self, index: int, now: float) -> None:
        """Request `index` ended at `now` (any way: finished, rejected, failed). In a closed
        loop its user's next request becomes due at now + think time."""
        if index not in self._sent:
            raise ValueError(f"request {index} finished but was never handed out by due()")
        if index in self._finished:
            raise ValueError(f"request {index} finished twice")
        self._finished.add(index)
        closed = self.workload.closed_loop
        if closed is not None and index + closed.users < len(self.workload.requests):
            heapq.heappush(self._planned, (now + closed.think_time, index + closed.users))

    @property
    def waiting_on_ends(self) -> bool:
        """No request can arrive before a running one ends: all were handed out, or a closed
        loop's users all wait. Replayers pass this to their engines as `arrivals_done`, so a
        static batch does not wait to fill with requests that cannot come."""
        return not self._planned

    @property
    def done(self) -> bool:
        """Every request was handed out."""
        return len(self._sent) == len(self.workload.requests)
