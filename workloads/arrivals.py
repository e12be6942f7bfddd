"""Arrival processes as serialisable specs (a `process` field tells them apart), and the
realised burst profile of a built workload.

An open-loop process plans every arrival time up front from the RNG it is given; a closed
loop plans none (its arrivals depend on when earlier requests finish, so `ArrivalSchedule`
releases them at run time)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from workloads.workload import SpecModel, Workload


class _Process(SpecModel):
    @property
    def mean_rate(self) -> float | None:
        """Long-run requests/s; None for a process with no rate (all at once, closed loop)."""
        return None

    def with_mean_rate(self, rate: float) -> _Process:
        raise ValueError(f"arrivals: a {self.process!r} process has no rate to set")

    def times(self, n: int, rng: random.Random) -> list[float]:
        """`n` planned arrival times, seconds after the run starts, in order."""
        return [0.0] * n


class AllAtOnce(_Process):
    """Everything arrives at t=0: the saturated case."""

    process: Literal["all_at_once"] = "all_at_once"


class PoissonArrivals(_Process):
    """Exponential gaps with mean 1/rate."""

    process: Literal["poisson"] = "poisson"
    rate: PositiveFloat

    @property
    def mean_rate(self) -> float:
        return self.rate

    def with_mean_rate(self, rate: float) -> PoissonArrivals:
        return self.replace(rate=rate)

    def times(self, n: int, rng: random.Random) -> list[float]:
        times, t = [], 0.0
        for _ in range(n):
            t += rng.expovariate(self.rate)
            times.append(t)
        return times


def mean_rate_factor(burst_factor: float) -> float:
    """Long-run mean rate over base rate of a bursty process: hot windows run at rate*f and
    cold ones at rate/f for equal times, so the mean is rate * (f + 1/f) / 2."""
    return (burst_factor + 1 / burst_factor) / 2


class BurstyArrivals(_Process):
    """Poisson arrivals whose rate alternates between rate*f (hot) and rate/f (cold) windows of
    `period` seconds, hot first. `rate` is the base rate; the mean is rate * mean_rate_factor(f)."""

    process: Literal["bursty"] = "bursty"
    rate: PositiveFloat
    burst_factor: float = Field(3.0, ge=1.0)
    period: PositiveFloat = 2.0

    @property
    def mean_rate(self) -> float:
        return self.rate * mean_rate_factor(self.burst_factor)

    def with_mean_rate(self, rate: float) -> BurstyArrivals:
        return self.replace(rate=rate / mean_rate_factor(self.burst_factor))

    def times(self, n: int, rng: random.Random) -> list[float]:
        # Exponential gaps are memoryless, so at each window edge the draw restarts with the new rate.
        times, t = [], 0.0
        while len(times) < n:
            window = int(t // self.period)
            r = self.rate * self.burst_factor if window % 2 == 0 else self.rate / self.burst_factor
            gap = rng.expovariate(r)
            edge = (window + 1) * self.period
            if t + gap >= edge:
                t = edge
                continue
            t += gap
            times.append(t)
        return times


class GammaArrivals(_Process):
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation `cv` (std/mean):
    cv 1 is Poisson, above 1 burstier, below 1 more regular."""

    process: Literal["gamma"] = "gamma"
    rate: PositiveFloat
    cv: PositiveFloat

    @property
    def mean_rate(self) -> float:
        return self.rate

    def with_mean_rate(self, rate: float) -> GammaArrivals:
        return self.replace(rate=rate)

    def times(self, n: int, rng: random.Random) -> list[float]:
        shape = 1.0 / self.cv**2  # a gamma's cv is 1/sqrt(shape); its mean is shape * scale
        scale = 1.0 / (self.rate * shape)
        times, t = [], 0.0
        for _ in range(n):
            t += rng.gammavariate(shape, scale)
            times.append(t)
        return times


class DiurnalArrivals(_Process):
    """A compressed day (`workloads.diurnal`): a cosine from the trough at the day's edges to a
    midday peak `peak_to_trough` times higher, plus `bursts` bursts a day; an inhomogeneous
    Poisson process drawn by thinning. As a spec's arrivals it gives the first `num_requests`
    of them: rate x day_s of them cover one day."""

    process: Literal["diurnal"] = "diurnal"
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

    def with_mean_rate(self, rate: float) -> DiurnalArrivals:
        """The same day at a long-run mean of `rate` (the curve and the bursts scaled together)."""
        return self.replace(rate=self.rate * rate / self.mean_rate)

    def curve(self, t: float | np.ndarray) -> float | np.ndarray:
        """The rate at `t` without bursts (an array of times gives an array of rates)."""
        peak = self.trough * self.peak_to_trough
        return self.trough + (peak - self.trough) * (1 - np.cos(2 * math.pi * t / self.day_s)) / 2

    @property
    def burst_window(self) -> float:
        """A burst begins uniformly within this many seconds of its day's start (it ends inside the day)."""
        return max(0.0, self.day_s - self.burst_s)

    def burst_starts(self, day: int, rng: random.Random) -> list[float]:
        """Where day `day`'s bursts begin, drawn from `rng` (called once per day, in order)."""
        return sorted(day * self.day_s + rng.uniform(0, self.burst_window) for _ in range(self.bursts))

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

    def times(self, n: int, rng: random.Random) -> list[float]:
        return list(itertools.islice(self.arrivals(rng), n))

    def times_array(self, end: float, rng: np.random.Generator) -> np.ndarray:
        """The arrivals in [0, `end`) drawn at once: the same process (candidates at the top
        rate, uniform given their Poisson count, thinned by rate(t) / top), not the same draws
        as `arrivals`. For days of millions of requests, which the one-at-a-time draw is too
        slow for."""
        top = self.trough * self.peak_to_trough * self.burst_factor
        t = np.sort(rng.uniform(0.0, end, rng.poisson(top * end)))
        rate = self.curve(t)
        for day in range(math.ceil(end / self.day_s)):
            for start in day * self.day_s + rng.uniform(0.0, self.burst_window, self.bursts):
                rate[(t >= start) & (t < start + self.burst_s)] *= self.burst_factor
        return t[rng.random(t.size) * top < rate]


class ClosedLoopArrivals(_Process):
    """`users` concurrent users; request i belongs to user i % users. Each user sends its first
    request at t=0 and each next one exactly `think_time` seconds after its previous one
    finished. The think time is fixed, not drawn: the only randomness left is the lengths, so
    two policies on one workload see the same users doing the same things."""

    process: Literal["closed_loop"] = "closed_loop"
    users: PositiveInt
    think_time: NonNegativeFloat = 0.0


ArrivalProcess = Annotated[
    AllAtOnce | PoissonArrivals | BurstyArrivals | GammaArrivals | DiurnalArrivals | ClosedLoopArrivals,
    Field(discriminator="process"),
]


@dataclass(frozen=True)
class BurstProfile:
    """What a bursty workload really offers, windows as in `BurstyArrivals` (hot first)."""

    hot_rate: float  # requests/s inside hot windows
    cold_rate: float  # requests/s inside cold windows
    mean_rate: float  # requests/s over the whole span
    factor: float  # sqrt(hot_rate / cold_rate): compare with burst_factor (inf with no cold arrival)


def burst_profile(workload: Workload, period: float | None = None) -> BurstProfile:
    """The realised burst profile of a built workload, over [0, last arrival]. `period` defaults
    to the period of the bursty spec the workload was built from."""
    if period is None:
        arrivals = (workload.spec or {}).get("arrivals") or {}
        if arrivals.get("process") != "bursty":
            raise ValueError(f"{workload.name}: not built from a bursty spec; give the window period")
        period = arrivals["period"]
    if period <= 0:
        raise ValueError(f"period must be > 0, got {period}")
    times = [r.arrival for r in workload.requests]
    span = max(times, default=0.0)
    if span <= 0:
        raise ValueError(f"{workload.name}: every request arrives at t=0, there is no burst to measure")
    full = int(span // period)
    rest = span - full * period
    hot_time = math.ceil(full / 2) * period + (rest if full % 2 == 0 else 0.0)
    cold_time = full // 2 * period + (rest if full % 2 == 1 else 0.0)
    hot = sum(int(t // period) % 2 == 0 for t in times)
    cold = len(times) - hot
    hot_rate = hot / hot_time
    cold_rate = cold / cold_time if cold_time > 0 else 0.0
    factor = math.sqrt(hot_rate / cold_rate) if cold_rate > 0 else math.inf
    return BurstProfile(hot_rate, cold_rate, len(times) / span, factor)
