"""A synthetic day, time-compressed: the traffic an autoscaler is for.

Arrivals are Poisson with a rate that follows a cosine from its trough (the day's start and end)
to its peak (midday), `peak_to_trough` times higher, with `bursts` bursts a day placed at random
(each `burst_s` long at `burst_factor` times the rate there). Drawn by thinning: candidates at
the highest rate the day reaches, each kept with probability rate(t) / that rate, so the
arrivals are exactly an inhomogeneous Poisson process of rate(t).

`DiurnalDay` is the whole workload (the arrivals over `days` days and the length
distributions), seeded like `workloads.spec.WorkloadSpec`'s split layout: arrivals from the
stream "{seed}-arrivals", lengths from "{seed}-lengths", so two seeds differ in both."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from pydantic import Field, NonNegativeInt, PositiveFloat

from workloads.lengths import LengthDist, LognormalLength, UniformLength
from workloads.workload import SpecModel, Workload, WorkloadRequest


class DiurnalArrivals(SpecModel):
    rate: PositiveFloat = Field(description="requests/s averaged over the day's curve, bursts left out")
    day_s: PositiveFloat = Field(600.0, description="seconds of one compressed day")
    peak_to_trough: float = Field(4.0, ge=1.0, description="the midday rate over the rate at the day's edges")
    bursts: NonNegativeInt = Field(4, description="bursts a day, each at a uniformly random time")
    burst_s: PositiveFloat = Field(10.0, description="seconds a burst lasts")
    burst_factor: float = Field(2.0, ge=1.0, description="the rate inside a burst over the curve's")

    @property
    def trough(self) -> float:
        return 2 * self.rate / (1 + self.peak_to_trough)

    @property
    def mean_rate(self) -> float:
        """The long-run mean rate: the curve's, plus what the bursts add in expectation (a burst
        at a uniform time meets the curve at its mean)."""
        return self.rate * (1 + self.bursts * self.burst_s * (self.burst_factor - 1) / self.day_s)

    def curve(self, t: float) -> float:
        """The rate at `t` without bursts."""
        peak = self.trough * self.peak_to_trough
        return self.trough + (peak - self.trough) * (1 - math.cos(2 * math.pi * t / self.day_s)) / 2

    def burst_starts(self, day: int, rng: random.Random) -> list[float]:
        """Where day `day`'s bursts begin, drawn from `rng` (called once per day, in order)."""
        span = max(0.0, self.day_s - self.burst_s)
        return sorted(day * self.day_s + rng.uniform(0, span) for _ in range(self.bursts))

    def arrivals(self, rng: random.Random) -> Iterator[float]:
        """Arrival times, in order, for ever."""
        top = self.trough * self.peak_to_trough * self.burst_factor
        t, day, starts = 0.0, -1, []
        while True:
            t += rng.expovariate(top)
            while int(t // self.day_s) != day:
                day += 1
                starts = self.burst_starts(day, rng)
            rate = self.curve(t) * (self.burst_factor if any(s <= t < s + self.burst_s for s in starts) else 1.0)
            if rng.random() * top < rate:
                yield t


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
