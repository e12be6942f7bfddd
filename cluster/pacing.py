"""Sending a workload's requests through a running cluster on their schedule, on the wall clock:
the one replay loop of slotserve's driver (`cluster.driver`) and of the Ray Serve peer
(`cluster.serve_baseline`), so both offer the same traffic the same way.

Each request is sent when the workload's `ArrivalSchedule` says, many in flight at once; each
end is reported back to the schedule (a closed loop's next request depends on it), and the
replicas are told whenever whether more requests may come before a running one ends changes
(`ArrivalSchedule.waiting_on_ends`: a static batch waits to be full only if one may)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from workloads.schedule import ArrivalSchedule
from workloads.workload import Workload, WorkloadRequest

Send = Callable[[int, WorkloadRequest, float], Awaitable[None]]


async def send_on_schedule(
    workload: Workload, send: Send, tell_arrivals_done: Callable[[bool], Awaitable[None]]
) -> None:
    """`send(index, request, planned)` for every request of `workload` at its planned time
    (`planned` is absolute, `time.time()`'s clock), and `tell_arrivals_done(done)` at each change;
    returns when every request has ended. A request ends for the schedule when its `send`
    returns or raises (an error is raised here once all have ended)."""
    schedule = ArrivalSchedule(workload)
    wake = asyncio.Event()  # set at every end: a closed loop may have released a request
    t0 = time.time()

    async def one(i: int, spec: WorkloadRequest, planned: float) -> None:
        try:
            await send(i, spec, planned)
        finally:
            schedule.finished(i, time.time() - t0)
            wake.set()

    tasks, told = [], False
    while True:
        wake.clear()  # before asking the schedule: an end from here on wakes the wait below
        tasks += [asyncio.create_task(one(i, spec, t0 + planned)) for i, spec, planned in schedule.due(time.time(), t0)]
        if schedule.waiting_on_ends != told:
            told = schedule.waiting_on_ends
            await tell_arrivals_done(told)
        if schedule.done:
            break
        next_time = schedule.next_time()
        timeout = None if next_time is None else max(0.0, t0 + next_time - time.time())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout)
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome
