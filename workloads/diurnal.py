"""A synthetic day, time-compressed: the traffic an autoscaler is for.

Arrivals are Poisson with a rate that follows a cosine from its trough (the day's start and end)
to its peak (midday), `peak_to_trough` times higher, with `bursts` bursts a day placed at random
(each `burst_s` long at `burst_factor` times the rate there). Drawn by thinning: candidates at
the highest rate the day reaches, each kept with probability rate(t) / that rate, so the
arrivals are exactly an inhomogeneous Poisson process of rate(t). The process is
`workloads.arrivals.DiurnalArrivals` (process "diurnal"), so a `WorkloadSpec` (an experiment
file's) can draw its first `num_requests` arrivals too.

`DiurnalDay` is the whole workload (the arrivals over `days` days and the length
distributions), seeded like `workloads.spec.WorkloadSpec`'s split layout: arrivals from the
stream "{seed}-arrivals", lengths from "{seed}-lengths", so two seeds differ in both."""

from __future__ import annotations

import random

import numpy as np
from pydantic import Field, PositiveFloat

from workloads.arrivals import DiurnalArrivals
from workloads.lengths import LengthDist, LognormalLength, UniformLength
from workloads.workload import SpecModel, Workload, WorkloadColumns, WorkloadRequest


class DiurnalDay(SpecModel):
    """`days` compressed days of diurnal traffic with lengths drawn from `prompt_len` and
    `output_len`."""

    name: str = Field("diurnal", min_length=1)
    seed: int = 0
    arrivals: DiurnalArrivals
    days: PositiveFloat = 1.0
    prompt_len: LengthDist = UniformLength(low=16, high=96)
    output_len: LengthDist = LognormalLength(median=12, sigma=0.8, low=2, high=64)

    def build(self) -> Workload:
        end = self.days * self.arrivals.day_s
        times = []
        for t in self.arrivals.arrivals(random.Random(f"{self.seed}-arrivals")):
            if t >= end:
                break
            times.append(t)
        rng = random.Random(f"{self.seed}-lengths")
        requests = []
        for t in times:
            output = self.output_len.sample(rng)
            requests.append(WorkloadRequest(t, self.prompt_len.sample(rng), output))
        params = {**self.model_dump(mode="json"), "mean_rate_requests_per_s": self.arrivals.mean_rate}
        return Workload(self.name, self.seed, requests, params)

    def columns(self) -> WorkloadColumns:
        """The same traffic drawn at once as arrays (the same distributions, not `build`'s
        draws): a day of millions of requests for `sim.slot_queue`, seeded by `seed` alone."""
        rng = np.random.default_rng([self.seed, 1])
        times = self.arrivals.times_array(self.days * self.arrivals.day_s, rng)
        n = times.size
        return WorkloadColumns(times, self.prompt_len.sample_array(n, rng), self.output_len.sample_array(n, rng))
