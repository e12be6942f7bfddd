"""Replay a workload through one engine in this process, keeping its schedule: each request
is submitted when the engine's clock passes its arrival time (stamped with the planned time,
so waiting for a running step counts in its TTFT), and every step is recorded. On a
FakeClock this is exact and instant; on the wall clock it measures the real engine."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tqdm import tqdm

from cluster.metrics import RequestTrace
from replica.engine import Engine, StepRecord
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
    pending = deque(sorted(enumerate(workload.requests), key=lambda item: item[1].arrival))
    requests, steps, lateness = {}, [], []
    bar = tqdm(total=len(pending), desc=desc or workload.name, unit="req", disable=not progress, leave=False)
    engine.scheduler.arrivals_done = False
    while pending or engine.has_unfinished:
        now = clock.now()
        while pending and t0 + pending[0][1].arrival <= now:
            i, spec = pending.popleft()
            prompt = request_prompt(seed, i, spec, engine.runner.vocab_size)
            params = {"max_tokens": spec.output_len, "ignore_eos": True}
            rid = engine.add_request(prompt, params, request_id=f"{workload.name}-{i}", arrival_time=t0 + spec.arrival,
                                     oracle_output_len=spec.output_len)
            requests[rid] = engine.requests[rid]
            lateness.append(now - (t0 + spec.arrival))
        if not pending:
            engine.scheduler.close_arrivals()
        result = engine.step()
        bar.update(sum(o.finished for o in result.outputs))
        if result.record is not None:
            steps.append(result.record)
            continue
        engine.wait_idle(t0 + pending[0][1].arrival if pending else None)
    bar.close()
    traces = [
        RequestTrace(rid, r.arrival_time, r.token_times, r.token_times[-1] if r.token_times else clock.now(),
                     r.finish_reason.value, r.num_prompt_tokens, num_preemptions=r.num_preemptions)
        for rid, r in requests.items()
    ]
    return ReplayResult(traces, steps, lateness)
