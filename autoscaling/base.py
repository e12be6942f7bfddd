"""The bounds every autoscaling policy shares, applied in one place after the policy's own rule,
so two policies differ in the number they want and nothing else.

A policy's `desire` says how many replicas it wants and why; `AutoscalingPolicy.decide` then
holds the number inside the bounds, in this order, and names the bound that moved it:

1. `min_replicas` <= desired <= `max_replicas`;
2. never drain below what holds the requests already in the cluster: with `ongoing` requests
   (running and waiting) and `S` slots a replica, at least ceil(ongoing / S) replicas stay, so
   a scale-down never leaves requests waiting that the replicas kept could have run;
3. the cooldown: no scale-down within `cooldown_s` of the last change (a replica just started
   is not drained before it has taken the load it was started for, and one just drained is not
   followed at once by another on a lull). Scale-ups are never held back: a burst must be met,
   and `current` counts starting replicas, so a policy does not ask twice for the same load.

Pure: no Ray, time from the injected clock. The caller (the simulator, a controller actor)
asks `decide` once a decision period and starts or drains `decision.change` replicas."""

from __future__ import annotations

import math
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, model_validator

from protocol.clock import Clock
from protocol.scaling import ScalingDecision, ScalingObservation
from workloads.capacity import Capacity


class ScalingBounds(BaseModel):
    """The bounds of every policy (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: PositiveInt = Field(1, description="never fewer replicas (serving + starting)")
    max_replicas: PositiveInt = Field(8, description="never more replicas (serving + starting)")
    cooldown_s: NonNegativeFloat = Field(30.0, description="no scale-down within this long of the last change")

    @model_validator(mode="after")
    def _ordered(self) -> ScalingBounds:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        return self

    def clamp(self, replicas: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, replicas))


class AutoscalingPolicy:
    """One named rule for the replica count. Subclasses set `name`, their parameters' model
    `Params` (pydantic, unknown keys refused) and `desire`; a policy that prices work reads one
    replica's `capacity` (measured by the caller: the cost model lives above this package)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]]
    needs_capacity: ClassVar[bool] = False

    def __init__(self, bounds: ScalingBounds, params: BaseModel, clock: Clock, capacity: Capacity | None = None):
        if self.needs_capacity and capacity is None:
            raise ValueError(f"autoscaling policy {self.name!r} needs one replica's capacity (tokens/s); got none")
        self.bounds = bounds
        self.params = params
        self.clock = clock
        self.capacity = capacity
        self.last_change: float | None = None  # when a decision last changed the count

    def desire(self, obs: ScalingObservation, now: float) -> tuple[int, str, dict[str, float]]:
        """The replicas this policy's own rule wants now, why, and the figures it used."""
        raise NotImplementedError

    def decide(self, obs: ScalingObservation) -> ScalingDecision:
        now = self.clock.now()
        wanted, reason, inputs = self.desire(obs, now)
        desired, reason = self._bound(obs, wanted, reason, now)
        if desired != obs.current:
            self.last_change = now
        inputs = {
            **inputs,
            "wanted": float(wanted),
            "serving": float(obs.serving),
            "starting": float(obs.starting),
            "draining": float(obs.draining),
            "ongoing": float(obs.ongoing),
            "queued": float(obs.queued),
        }
        return ScalingDecision(now, self.name, obs.current, desired, reason, inputs)

    def _bound(self, obs: ScalingObservation, wanted: int, reason: str, now: float) -> tuple[int, str]:
        desired = self.bounds.clamp(wanted)
        if desired != wanted:
            reason = f"{reason}; held at {'max' if wanted > desired else 'min'}_replicas {desired}"
        if desired >= obs.current:
            return desired, reason
        slots = obs.slots_per_replica
        hold = math.ceil(obs.ongoing / slots) if slots else obs.current
        if hold > desired:
            desired = min(obs.current, hold)
            reason = f"{reason}; kept {desired}: {obs.ongoing} requests need {hold} replicas' slots"
            if desired >= obs.current:
                return obs.current, reason
        if self.last_change is not None and now - self.last_change < self.bounds.cooldown_s:
            return obs.current, f"{reason}; cooldown: {now - self.last_change:.1f} s since the last change"
        return desired, reason
