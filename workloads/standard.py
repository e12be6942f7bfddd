"""The standard workloads of DESIGN.md, by name, seeded."""

from __future__ import annotations

import math
import random
from typing import Callable

from workloads.workload import Workload, WorkloadRequest


def lognormal_len(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def saturated(num_requests: int = 48, sigma: float = 0.8, median: float = 48, seed: int = 0) -> Workload:
    """Everything arrives at t=0: prompts 16-64 tokens, outputs lognormal (median 48, clipped to [4, 256])."""
    rng = random.Random(seed)
    reqs = [WorkloadRequest(0.0, rng.randint(16, 64), lognormal_len(rng, median, sigma, 4, 256)) for _ in range(num_requests)]
    return Workload("saturated", seed, reqs, {"num_requests": num_requests, "sigma": sigma, "median": median})


SIGMAS = (0.0, 0.4, 0.8, 1.2)


def sigma_sweep(sigma: float, num_requests: int = 48, seed: int = 0) -> Workload:
    """One cell of the sigma sweep (run it with 8 slots): saturated, output-length spread `sigma`."""
    w = saturated(num_requests, sigma=sigma, seed=seed)
    return Workload(f"sigma-sweep[{sigma}]", seed, w.requests, w.params)


def _bursty_arrivals(rng: random.Random, n: int, rate: float, burst_factor: float, period: float) -> list[float]:
    """Poisson arrivals whose rate alternates between rate*f (hot) and rate/f (cold) windows
    of `period` seconds. Exponential gaps are memoryless, so at each window edge the draw
    restarts with the new rate."""
    times, t = [], 0.0
    while len(times) < n:
        window = int(t // period)
        r = rate * burst_factor if window % 2 == 0 else rate / burst_factor
        gap = rng.expovariate(r)
        edge = (window + 1) * period
        if t + gap >= edge:
            t = edge
            continue
        t += gap
        times.append(t)
    return times


def bursty_mix(num_requests: int = 64, rate: float = 4.0, burst_factor: float = 3.0, period: float = 2.0,
               long_prompt_share: float = 0.0, long_prompt_len: int = 480, seed: int = 0) -> Workload:
    """Bursty Poisson arrivals (rate in requests/s); 70% short outputs (4-32), 30% long (48-128);
    prompts 8-64 tokens, or `long_prompt_len` for a `long_prompt_share` of requests."""
    # Separate streams: the lengths stay the same whatever the rate, so a load sweep
    # changes only when requests arrive.
    arrivals = _bursty_arrivals(random.Random(f"{seed}-arrivals"), num_requests, rate, burst_factor, period)
    rng = random.Random(f"{seed}-lengths")
    reqs = []
    for i, t in enumerate(arrivals):
        out = rng.randint(4, 32) if rng.random() < 0.7 else rng.randint(48, 128)
        prompt = long_prompt_len if rng.random() < long_prompt_share else rng.randint(8, 64)
        reqs.append(WorkloadRequest(t, prompt, out, session_id=f"s{i % 8}"))
    params = {"num_requests": num_requests, "rate": rate, "burst_factor": burst_factor, "period": period,
              "long_prompt_share": long_prompt_share, "long_prompt_len": long_prompt_len}
    return Workload("bursty-mix" if long_prompt_share == 0 else "long-prompts", seed, reqs, params)


def long_prompts(num_requests: int = 64, rate: float = 4.0, burst_factor: float = 3.0, period: float = 2.0,
                 seed: int = 0) -> Workload:
    """bursty-mix with 15% prompts of 480 tokens: the prefill-stall case."""
    return bursty_mix(num_requests, rate, burst_factor, period, long_prompt_share=0.15, seed=seed)


STANDARD_WORKLOADS: dict[str, Callable[..., Workload]] = {
    "saturated": saturated,
    "bursty-mix": bursty_mix,
    "long-prompts": long_prompts,
}


def mean_rate_factor(burst_factor: float) -> float:
    """Long-run mean rate over base rate of a bursty process: hot windows run at rate*f and
    cold ones at rate/f for equal times, so the mean is rate * (f + 1/f) / 2."""
    return (burst_factor + 1 / burst_factor) / 2


def at_load(name: str, num_requests: int, load: float, capacity_tokens_per_s: float, seed: int = 0,
            **shape) -> Workload:
    """The named workload with arrivals at `load` x a measured capacity (output tokens/s):
    mean request rate = load * capacity / mean output length. Lengths do not depend on the
    rate, so they are read off the same workload made at any rate. `saturated` has no rate."""
    maker = STANDARD_WORKLOADS[name]
    if name == "saturated":
        return maker(num_requests=num_requests, seed=seed)
    mean_output = sum(maker(num_requests=num_requests, rate=1.0, seed=seed, **shape).output_lens) / num_requests
    mean_rate = load * capacity_tokens_per_s / mean_output
    base_rate = mean_rate / mean_rate_factor(shape.get("burst_factor", 3.0))
    workload = maker(num_requests=num_requests, rate=base_rate, seed=seed, **shape)
    workload.params.update({"load": load, "capacity_tokens_per_s": capacity_tokens_per_s,
                            "mean_rate_requests_per_s": mean_rate})
    return workload
