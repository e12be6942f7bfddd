"""Replay a workload through one engine in this process, keeping its schedule: each request
is submitted when the engine's clock passes its planned arrival (stamped with the planned time,
so waiting for a running step counts in its TTFT), each finished one is reported back to the
schedule (a closed loop's next request depends on it), and every step is recorded. On a
FakeClock this is exact and instant; on the wall clock it measures the real engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from metrics.definitions import RequestTrace
from replica.engine import Engine, StepRecord
from replica.scheduling.request import Request
from workloads.schedule import ArrivalSchedule
from workloads.workload import Workload, request_prompt


@dataclass
class ReplayResult:
    traces: list[RequestTrace]
    steps: list[StepRecord]
    # How late each submission was against its planned arrival (seconds): a slow driver
    # must not pass for a slow engine.
    submit_lateness: list[float] = field(default_factory=list)


def replay(engine: Engine, workload: Workload, seed: int = 0, progress: bool = False, desc: str = "") -> ReplayResult:
    clock = engine.clock
    t0 = clock.now()
    schedule = ArrivalSchedule(workload)
    requests, index_of, steps, lateness = {}, {}, [], []
    bar = tqdm(total=len(workload.requests), desc=desc or workload.name, unit="req", disable=not progress, leave=False)
    while not schedule.done or engine.has_unfinished:
        now = clock.now()
        for i, spec, planned in schedule.due(now, t0):
            prompt = request_prompt(seed, i, spec, engine.runner.vocab_size)
            params = {"max_tokens": spec.output_len, "ignore_eos": True}
            rid = engine.add_request(
                prompt,
                params,
                request_id=f"{workload.name}-{i}",
                arrival_time=t0 + planned,
                oracle_output_len=spec.output_len,
            )
            requests[rid], index_of[rid] = engine.requests[rid], i
            lateness.append(now - (t0 + planned))
        engine.set_arrivals_done(schedule.waiting_on_ends)
        result = engine.step()
        for output in result.outputs:
            if output.finished:
                schedule.finished(index_of[output.request_id], output.time - t0)
                bar.update(1)
        if result.record is not None:
            steps.append(result.record)
            continue
        next_time = schedule.next_time()
        engine.wait_idle(None if next_time is None else t0 + next_time)
    bar.close()
    return ReplayResult([request_trace(r, clock.now()) for r in requests.values()], steps, lateness)


def request_trace(request: Request, end: float, replica: str | None = None) -> RequestTrace:
    """A finished request as its client saw it: completion at its last token (`end` when it
    made none)."""
    return RequestTrace(
        request.request_id,
        request.arrival_time,
        request.token_times,
        request.token_times[-1] if request.token_times else end,
        request.finish_reason.value,
        request.num_prompt_tokens,
        replica,
        request.num_preemptions,
        cached_tokens=request.num_cached_prompt_tokens,
    )
