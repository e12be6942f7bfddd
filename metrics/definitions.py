"""The metric definitions of docs/ARCHITECTURE.md, in one place (they match `vllm bench serve`).

For request i: arrival a, first token f, token times t1..tn, completion c.
TTFT = f - a; TPOT = (c - f) / (n - 1) for n >= 2; ITL = every gap t(k+1) - t(k), pooled;
E2E = c - a; throughput = output tokens / makespan (first arrival to last completion);
goodput = output tokens (and requests) of requests meeting every SLO, per second of makespan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from protocol import defaults
from protocol.finish import NATURAL_ENDINGS

# How a request may end and still count as served: its natural endings; anything else
# (rejected, failed, aborted) misses every SLO.
SERVED = NATURAL_ENDINGS


@dataclass
class RequestTrace:
    request_id: str
    arrival: float
    token_times: list[float]
    finish_time: float
    finish_reason: str
    prompt_len: int
    replica: str | None = None
    num_preemptions: int = 0
    # What the store keeps beside the metric inputs (None / 0 where the source has no such thing).
    session_id: str | None = None
    max_tokens: int | None = None
    error: str | None = None
    planned_arrival: float | None = None  # when the workload meant it to arrive (None: at `arrival`)
    submit_lateness: float = 0.0  # how late the driver submitted it against `planned_arrival`
    cached_tokens: int | None = None  # prompt tokens its replica's prefix cache held when it admitted it
    priority: int = defaults.PRIORITY  # its flow-control class (protocol.flow), so reports split by it
    tenant: str = defaults.TENANT

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n >= 2 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival


@dataclass(frozen=True)
class SLO:
    ttft: float = 2.0  # seconds
    tpot: float = defaults.TPOT_SLO  # seconds per output token after the first
    e2e: float | None = None

    def met_by(self, trace: RequestTrace) -> bool:
        if trace.finish_reason not in SERVED or trace.ttft is None or trace.ttft > self.ttft:
            return False
        if trace.tpot is not None and trace.tpot > self.tpot:
            return False
        return self.e2e is None or trace.e2e <= self.e2e


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(v.max())}


@dataclass
class Summary:
    num_requests: int
    num_served: int
    output_tokens: int
    makespan: float
    throughput: float  # output tokens / s
    goodput: float  # output tokens / s of requests meeting the SLO
    goodput_requests: float  # requests / s meeting the SLO
    slo_attainment: float
    slo: SLO
    ttft: dict = field(default_factory=dict)
    tpot: dict = field(default_factory=dict)
    itl: dict = field(default_factory=dict)
    e2e: dict = field(default_factory=dict)
    num_preemptions: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(traces: Sequence[RequestTrace], slo: SLO = SLO()) -> Summary:
    if not traces:
        raise ValueError("no requests to summarise")
    start = min(t.arrival for t in traces)
    end = max(t.finish_time for t in traces)
    makespan = max(end - start, 1e-9)
    good = [t for t in traces if slo.met_by(t)]
    tokens = sum(t.num_output_tokens for t in traces)
    return Summary(
        num_requests=len(traces),
        num_served=sum(t.finish_reason in SERVED for t in traces),
        output_tokens=tokens,
        makespan=makespan,
        throughput=tokens / makespan,
        goodput=sum(t.num_output_tokens for t in good) / makespan,
        goodput_requests=len(good) / makespan,
        slo_attainment=len(good) / len(traces),
        slo=slo,
        ttft=percentiles(t.ttft for t in traces if t.ttft is not None),
        tpot=percentiles(t.tpot for t in traces if t.tpot is not None),
        itl=percentiles(gap for t in traces for gap in t.itls),
        e2e=percentiles(t.e2e for t in traces),
        num_preemptions=sum(t.num_preemptions for t in traces),
    )


def slot_efficiency(useful_rows: Iterable[int], computed_rows: Iterable[int]) -> float:
    """Useful rows / computed rows over a run (a finished request still held in a static
    batch is a computed, useless row)."""
    computed = sum(computed_rows)
    return sum(useful_rows) / computed if computed else 1.0


def expected_static_slot_efficiency(output_lens: Sequence[int], batch_size: int) -> float:
    """From the workload alone: mean output length / mean over batches (in arrival order,
    `batch_size` each) of the longest output in the batch."""
    batches = [output_lens[i : i + batch_size] for i in range(0, len(output_lens), batch_size)]
    return float(np.mean(output_lens) / np.mean([max(b) for b in batches]))
