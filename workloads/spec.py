"""Workload specs: every workload is a named, seeded, serialisable value. A built workload
carries its spec's JSON dump (`Workload.spec`), a run stores it, and `parse_spec(dump).build()`
gives back exactly the same requests.

Three sources: `WorkloadSpec` (an arrival process and length distributions, drawn from seeded
RNGs), `TraceSpec` (a real trace through the readers of `workloads.traces`) and `TenantsSpec`
(several tenants, each its own class, rate, window and lengths: flow control's traffic)."""

from __future__ import annotations

import dataclasses
import random
from typing import Annotated, Literal, Self

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, TypeAdapter, field_validator, model_validator

from protocol import defaults
from workloads.arrivals import AllAtOnce, ArrivalProcess, ClosedLoopArrivals
from workloads.capacity import Capacity
from workloads.lengths import LengthDist
from workloads.prefixes import SharedPrefix
from workloads.traces import AZURE_CONV, read_trace
from workloads.workload import ClosedLoop, SpecModel, Workload, WorkloadRequest


class _Spec(SpecModel):
    def build(self) -> Workload:
        raise NotImplementedError

    def with_mean_rate(self, rate: float) -> Self:
        raise NotImplementedError

    @property
    def has_rate(self) -> bool:
        return True

    def at_load(self, load: float, capacity: Capacity | float) -> Self:
        """This spec with arrivals at `load` x a measured capacity (`workloads.capacity`): mean
        request rate = load / mean work per request, the work (prefill and decode at the
        cluster's rates) read off the built lengths (they do not depend on the rate). A bare
        number is a decode-only capacity (output tokens/s, prefill free). A spec with no rate
        (all at once, closed loop) comes back as it is: its size or its users set its load."""
        capacity = Capacity.of(capacity)
        if load <= 0:
            raise ValueError(f"load must be > 0, got {load}")
        if not self.has_rate:
            return self
        requests = self.build().requests
        return self.with_mean_rate(capacity.rate_for(load, ((r.prompt_len, r.output_len) for r in requests)))


class WorkloadSpec(_Spec):
    """A synthetic workload. Request i gets session `s{i % sessions}` when `sessions` is set.

    RNG layout: "split" (the default) draws arrivals from the stream "{seed}-arrivals" and
    lengths from "{seed}-lengths" (per request: output, then a long-prompt coin, then the
    prompt unless the coin came up long), so a rate or load sweep changes only when requests
    arrive. "single" is the older layout of `saturated`, one stream `Random(seed)` drawing
    prompt then output, kept so `saturated` and `sigma-sweep` make the requests they always
    have; it only goes with all-at-once arrivals and no long prompts."""

    source: Literal["synthetic"] = "synthetic"
    name: str = Field(min_length=1)
    seed: int = 0
    num_requests: PositiveInt
    arrivals: ArrivalProcess
    prompt_len: LengthDist
    output_len: LengthDist
    long_prompt_share: float = Field(0.0, ge=0.0, le=1.0)
    long_prompt_len: PositiveInt = 480
    sessions: PositiveInt | None = None
    shared_prefix: SharedPrefix | None = None  # prompts as shared-prefix sessions (workloads.prefixes)
    rng_layout: Literal["split", "single"] = "split"

    @model_validator(mode="after")
    def _single_layout_is_saturated_only(self) -> WorkloadSpec:
        if self.rng_layout == "single" and (not isinstance(self.arrivals, AllAtOnce) or self.long_prompt_share > 0):
            raise ValueError(
                "rng_layout 'single' needs all_at_once arrivals and long_prompt_share 0 "
                "(use 'split', so lengths do not depend on the arrivals)"
            )
        if self.shared_prefix is not None and (self.sessions is not None or self.long_prompt_share > 0):
            raise ValueError(
                "shared_prefix makes its own sessions and prompts: leave sessions and long_prompt_share unset"
            )
        return self

    @property
    def has_rate(self) -> bool:
        return self.arrivals.mean_rate is not None

    def with_mean_rate(self, rate: float) -> WorkloadSpec:
        """The same spec with arrivals at a long-run mean of `rate` requests/s."""
        return self.replace(arrivals=self.arrivals.with_mean_rate(rate))

    def build(self) -> Workload:
        n = self.num_requests
        if self.rng_layout == "single":
            rng = random.Random(self.seed)
            times = self.arrivals.times(n, rng)
            lengths = [(self.prompt_len.sample(rng), self.output_len.sample(rng)) for _ in range(n)]
        else:
            times = self.arrivals.times(n, random.Random(f"{self.seed}-arrivals"))
            rng = random.Random(f"{self.seed}-lengths")
            lengths = []
            for _ in range(n):
                output = self.output_len.sample(rng)
                prompt = self.long_prompt_len if rng.random() < self.long_prompt_share else self.prompt_len.sample(rng)
                lengths.append((prompt, output))
        if self.shared_prefix is not None:
            requests = self.shared_prefix.requests(times, lengths, self.seed)
        else:
            requests = [
                WorkloadRequest(t, prompt, output, None if self.sessions is None else f"s{i % self.sessions}")
                for i, (t, (prompt, output)) in enumerate(zip(times, lengths))
            ]
        params = {
            "num_requests": n,
            **self.arrivals.model_dump(),
            "long_prompt_share": self.long_prompt_share,
            "long_prompt_len": self.long_prompt_len,
        }
        if self.arrivals.mean_rate is not None:
            params["mean_rate_requests_per_s"] = self.arrivals.mean_rate
        closed = self.arrivals
        closed_loop = ClosedLoop(closed.users, closed.think_time) if isinstance(closed, ClosedLoopArrivals) else None
        return Workload(self.name, self.seed, requests, params, self.model_dump(mode="json"), closed_loop)


class TraceSpec(_Spec):
    """A real trace, read by `workloads.traces` with its scaling and sampling (the readers name
    file and line of any bad row). `path` None is the shipped Azure conversation trace."""

    source: Literal["trace"] = "trace"
    format: Literal["azure", "mooncake"]
    path: str | None = None
    name: str | None = Field(None, min_length=1)  # None: the trace file's name without its suffix
    time_scale: PositiveFloat = 1.0
    length_scale: PositiveFloat = 1.0
    every: PositiveInt = 1
    limit: PositiveInt | None = None
    start_offset: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _mooncake_needs_a_path(self) -> TraceSpec:
        if self.format == "mooncake" and self.path is None:
            raise ValueError("path: a mooncake trace needs a path (only the Azure trace ships with slotserve)")
        return self

    def build(self) -> Workload:
        workload = read_trace(
            self.path or AZURE_CONV,
            self.format,
            time_scale=self.time_scale,
            length_scale=self.length_scale,
            every=self.every,
            limit=self.limit,
            start_offset=self.start_offset,
        )
        return dataclasses.replace(workload, name=self.name or workload.name, spec=self.model_dump(mode="json"))

    def with_mean_rate(self, rate: float) -> TraceSpec:
        """The same sample with its time scale set so that it offers `rate` requests/s on average."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        requests = self.build().requests
        span = requests[-1].arrival
        if len(requests) < 2 or span <= 0:
            raise ValueError(f"{self.path or AZURE_CONV}: the sample arrives all at once and has no rate to scale")
        return self.replace(time_scale=self.time_scale * (len(requests) - 1) / span / rate)


class TenantTraffic(SpecModel):
    """One tenant's requests: Poisson arrivals from `start` to `end` (shares of the spec's
    duration) at `rate` requests/s, of its own class and lengths. `load` is its offered load
    while it sends, as a multiple of the cluster's capacity, from which `TenantsSpec.at_load`
    sets `rate` (a flood is a tenant with a load above 1 for a stretch)."""

    name: str = Field(min_length=1)
    priority: int = defaults.PRIORITY
    load: PositiveFloat = 1.0
    rate: PositiveFloat | None = None
    start: float = Field(0.0, ge=0.0, lt=1.0)
    end: float = Field(1.0, gt=0.0, le=1.0)
    prompt_len: LengthDist
    output_len: LengthDist

    @model_validator(mode="after")
    def _window(self) -> TenantTraffic:
        if self.end <= self.start:
            raise ValueError(f"tenant {self.name!r}: end {self.end} must be after start {self.start}")
        return self

    def lengths(self, seed: int, n: int) -> list[tuple[int, int]]:
        """The first `n` (prompt, output) pairs of its length stream (the same whatever its rate)."""
        rng = random.Random(f"{seed}-{self.name}-lengths")
        return [(self.prompt_len.sample(rng), self.output_len.sample(rng)) for _ in range(n)]


class TenantsSpec(_Spec):
    """Several tenants over `duration` seconds, merged in arrival order. Each tenant draws its
    arrivals and lengths from streams of its own ("{seed}-{tenant}-arrivals", "-lengths"), so
    changing one tenant's rate moves no other tenant's requests."""

    source: Literal["tenants"] = "tenants"
    name: str = Field(min_length=1)
    seed: int = 0
    duration: PositiveFloat
    tenants: list[TenantTraffic] = Field(min_length=1)

    @field_validator("tenants")
    @classmethod
    def _unique_names(cls, tenants: list[TenantTraffic]) -> list[TenantTraffic]:
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"repeated tenant name in {names}")
        return tenants

    def at_load(self, load: float, capacity: Capacity | float) -> TenantsSpec:
        """Each tenant's rate set so it offers `load` x its own `load` x `capacity` while it sends."""
        capacity = Capacity.of(capacity)
        if load <= 0:
            raise ValueError(f"load must be > 0, got {load}")
        return self.replace(
            tenants=[
                t.replace(rate=capacity.rate_for(load * t.load, t.lengths(self.seed, 1000))).model_dump()
                for t in self.tenants
            ]
        )

    def with_mean_rate(self, rate: float) -> TenantsSpec:
        """Every tenant's rate scaled alike, so the whole offers `rate` requests/s over the duration."""
        own = [(t.rate or t.load) for t in self.tenants]
        mean = sum(r * (t.end - t.start) for r, t in zip(own, self.tenants))
        return self.replace(tenants=[t.replace(rate=r * rate / mean).model_dump() for r, t in zip(own, self.tenants)])

    def build(self) -> Workload:
        requests = []
        for order, tenant in enumerate(self.tenants):
            if tenant.rate is None:
                raise ValueError(f"tenant {tenant.name!r} has no rate: give one, or run the spec at a load")
            rng = random.Random(f"{self.seed}-{tenant.name}-arrivals")
            start, end = tenant.start * self.duration, tenant.end * self.duration
            times, t = [], start + rng.expovariate(tenant.rate)
            while t < end:
                times.append(t)
                t += rng.expovariate(tenant.rate)
            for t, (prompt, output) in zip(times, tenant.lengths(self.seed, len(times))):
                requests.append(
                    (t, order, WorkloadRequest(t, prompt, output, priority=tenant.priority, tenant=tenant.name))
                )
        requests.sort(key=lambda x: (x[0], x[1]))
        params = {"duration": self.duration, **{f"rate_{t.name}": t.rate for t in self.tenants}}
        return Workload(self.name, self.seed, [r for _, _, r in requests], params, self.model_dump(mode="json"))


AnyWorkloadSpec = Annotated[WorkloadSpec | TraceSpec | TenantsSpec, Field(discriminator="source")]
_ANY_SPEC = TypeAdapter(AnyWorkloadSpec)


def parse_spec(data: dict) -> WorkloadSpec | TraceSpec | TenantsSpec:
    """A stored spec (`Workload.spec`, any `model_dump`) back as a spec, synthetic or trace by
    its `source`; bad data raises pydantic's ValidationError naming the field."""
    return _ANY_SPEC.validate_python(data)
