"""The autoscaling policies compared by slotserve, each a rule for the replica count from the
serving replicas' load reports and the arrivals, under the shared bounds of `autoscaling.base`:

- `target_ongoing`: Ray Serve's rule. desired = ceil(ongoing requests / target_ongoing_requests),
  the ongoing count averaged over `look_back_s`; a change is acted on only once the wish to
  change in that direction has held for `upscale_delay_s` (up) or `downscale_delay_s` (down),
  and then with the latest wish, as Serve's controller does.
- `queue_slo`: up when the TTFT a request arriving now can expect (the waiting requests per
  serving replica times a request's mean work at one replica's capacity, plus its own prefill)
  reaches `up_at` of the SLO, to the replicas that bring it back there; down when every replica
  has had headroom (nothing waiting, at most `headroom` of its slots busy) for `down_after_s`,
  to the replicas that hold what runs at that share of their slots.
- `predictive`: the offered load forecast `horizon_s` ahead, or one measured cold start ahead
  if that is longer (a replica asked for now serves no sooner): the larger of the last
  `window_s` mean and its linear trend there (a rising load is met before it arrives, a
  falling one released only as the window forgets it), plus the waiting requests' work spread over the
  horizon, in replicas at one replica's capacity, times 1 + `headroom`.

`AUTOSCALING_POLICIES` is the registry of named choices; `make_autoscaling_policy` builds one
from an `AutoscaleConfig` (what an experiment file or the command line states)."""

from __future__ import annotations

import math
from collections import deque

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, field_validator, model_validator

from autoscaling.base import AutoscalingPolicy, ScalingBounds
from autoscaling.forecast import ArrivalHistory
from protocol.clock import Clock
from protocol.registry import Registry
from protocol.scaling import ScalingObservation
from workloads.capacity import Capacity


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetOngoingParams(_Params):
    target_ongoing_requests: PositiveFloat = Field(2.0, description="ongoing requests per replica to aim for")
    upscale_delay_s: NonNegativeFloat = Field(30.0, description="a wish to scale up must hold this long")
    downscale_delay_s: NonNegativeFloat = Field(600.0, description="a wish to scale down must hold this long")
    look_back_s: PositiveFloat = Field(30.0, description="the ongoing count is averaged over this long")


class TargetOngoing(AutoscalingPolicy):
    name = "target_ongoing"
    Params = TargetOngoingParams

    def __init__(
        self, bounds: ScalingBounds, params: TargetOngoingParams, clock: Clock, capacity: Capacity | None = None
    ):
        super().__init__(bounds, params, clock, capacity)
        self._samples: deque[tuple[float, int]] = deque()
        # the pending change: (direction, the count it would change, since when); a change of
        # the count (or of direction) starts a new one, as a change resets Serve's counter
        self._wish: tuple[int, int, float] | None = None

    def desire(self, obs: ScalingObservation, now: float) -> tuple[int, str, dict[str, float]]:
        p: TargetOngoingParams = self.params
        self._samples.append((now, obs.ongoing))
        while self._samples[0][0] < now - p.look_back_s:
            self._samples.popleft()
        ongoing = sum(n for _, n in self._samples) / len(self._samples)
        target = self.bounds.clamp(math.ceil(ongoing / p.target_ongoing_requests - 1e-9))
        inputs = {"ongoing_avg": ongoing, "target": float(target)}
        direction = (target > obs.current) - (target < obs.current)
        if direction == 0:
            self._wish = None
            return obs.current, f"{ongoing:.1f} ongoing requests: {obs.current} replicas on target", inputs
        if self._wish is None or self._wish[:2] != (direction, obs.current):
            self._wish = (direction, obs.current, now)
        delay = p.upscale_delay_s if direction > 0 else p.downscale_delay_s
        held = now - self._wish[2]
        inputs["wish_held_s"] = held
        rule = f"ceil({ongoing:.1f} ongoing / {p.target_ongoing_requests:g}) = {target}"
        if held < delay:
            return obs.current, f"{rule}, wished for {held:.1f} of {delay:g} s", inputs
        return target, f"{rule}, wished for {held:.1f} s", inputs


class QueueSloParams(_Params):
    ttft_slo_s: PositiveFloat = Field(2.0, description="the TTFT limit of the SLO")
    up_at: float = Field(0.5, gt=0, le=1, description="scale up when the predicted TTFT reaches this share of the SLO")
    headroom: float = Field(0.5, gt=0, le=1, description="a replica has headroom with at most this share of slots busy")
    down_after_s: NonNegativeFloat = Field(30.0, description="every replica has had headroom this long: scale down")
    work_window_s: PositiveFloat = Field(60.0, description="a request's mean work is read over this long")


class QueueSlo(AutoscalingPolicy):
    name = "queue_slo"
    Params = QueueSloParams
    needs_capacity = True

    def __init__(self, bounds: ScalingBounds, params: QueueSloParams, clock: Clock, capacity: Capacity | None = None):
        super().__init__(bounds, params, clock, capacity)
        self.history = ArrivalHistory(params.work_window_s)
        self._headroom_since: float | None = None

    def desire(self, obs: ScalingObservation, now: float) -> tuple[int, str, dict[str, float]]:
        p: QueueSloParams = self.params
        self.history.add(obs.arrivals)
        work = self.history.mean_work(self.capacity) or 0.0
        prefill = self._own_prefill()
        serving = max(obs.serving, 1)
        ttft = obs.queued / serving * work + prefill
        limit = p.up_at * p.ttft_slo_s
        inputs = {"predicted_ttft": ttft, "mean_work": work, "limit": limit}
        if ttft >= limit:
            self._headroom_since = None
            needed = max(serving + 1, math.ceil(serving * (ttft - prefill) / max(limit - prefill, 1e-9)))
            return (
                max(obs.current, needed),
                f"predicted TTFT {ttft:.2f} s >= {p.up_at:g} x SLO {p.ttft_slo_s:g} s: {needed} replicas",
                inputs,
            )
        slots = obs.slots_per_replica
        roomy = bool(obs.reports) and all(
            r.queue_depth == 0 and r.running <= p.headroom * r.num_slots for r in obs.reports
        )
        if not roomy or len(obs.reports) < obs.serving or obs.starting:
            self._headroom_since = None
            return obs.current, f"predicted TTFT {ttft:.2f} s under {limit:.2f} s", inputs
        if self._headroom_since is None:
            self._headroom_since = now
        held = now - self._headroom_since
        inputs["headroom_held_s"] = held
        if held < p.down_after_s:
            return obs.current, f"every replica has headroom, for {held:.1f} of {p.down_after_s:g} s", inputs
        fit = max(1, math.ceil(obs.running / (p.headroom * slots) - 1e-9))
        if fit >= obs.current:
            return obs.current, f"every replica has headroom, but {obs.running} running need {fit}", inputs
        self._headroom_since = None
        return fit, f"every replica had headroom for {held:.1f} s: {obs.running} running fit {fit}", inputs

    def _own_prefill(self) -> float:
        """A request's own prefill at one replica's prefill rate (its mean prompt)."""
        n = self.history.requests
        if not n:
            return 0.0
        prompts = sum(w.prompt_tokens for w in self.history.windows)
        return prompts / n / self.capacity.prefill_tokens_per_s


class PredictiveParams(_Params):
    window_s: PositiveFloat = Field(60.0, description="arrivals the forecast is read from")
    horizon_s: PositiveFloat = Field(
        10.0, description="how far ahead to forecast (at least the last measured cold start: none serves sooner)"
    )
    headroom: NonNegativeFloat = Field(0.25, description="capacity kept beyond the forecast load, as a share of it")


class Predictive(AutoscalingPolicy):
    name = "predictive"
    Params = PredictiveParams
    needs_capacity = True

    def __init__(self, bounds: ScalingBounds, params: PredictiveParams, clock: Clock, capacity: Capacity | None = None):
        super().__init__(bounds, params, clock, capacity)
        self.history = ArrivalHistory(params.window_s)

    def desire(self, obs: ScalingObservation, now: float) -> tuple[int, str, dict[str, float]]:
        p: PredictiveParams = self.params
        self.history.add(obs.arrivals)
        mean = self.history.load(self.capacity)
        horizon = max(p.horizon_s, obs.cold_start_s)  # a replica asked for now serves no sooner
        trend = self.history.load_at(self.capacity, now + horizon)
        backlog = obs.queued * (self.history.mean_work(self.capacity) or 0.0) / horizon
        load = max(mean, trend) + backlog
        desired = math.ceil(load * (1 + p.headroom) - 1e-9)
        inputs = {"load_mean": mean, "load_trend": trend, "load_backlog": backlog, "load": load, "horizon_s": horizon}
        return desired, f"forecast load {load:.2f} replicas x {1 + p.headroom:g} headroom: {desired}", inputs


AUTOSCALING_POLICIES: Registry[type[AutoscalingPolicy]] = Registry.of_named(
    "autoscaling policy", (TargetOngoing, QueueSlo, Predictive)
)


class AutoscaleConfig(ScalingBounds):
    """An autoscaled cluster as a user states it: the policy by name, the shared bounds, how
    often to decide, and the policy's own parameters (checked against its `Params`)."""

    policy: str = Field(description="autoscaling policy (see autoscaling.policies.AUTOSCALING_POLICIES)")
    period_s: PositiveFloat = Field(1.0, description="seconds between two decisions")
    drain_timeout_s: NonNegativeFloat = Field(
        30.0, description="a drained replica's running requests get this long to finish, then move"
    )
    params: dict[str, float] = Field(default_factory=dict, description="the policy's own parameters")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        return AUTOSCALING_POLICIES.check(policy)

    @model_validator(mode="after")
    def _policy_params(self) -> AutoscaleConfig:
        AUTOSCALING_POLICIES[self.policy].Params(**self.params)  # unknown or out-of-range: refused here
        return self


def make_autoscaling_policy(
    config: AutoscaleConfig, clock: Clock, capacity: Capacity | None = None
) -> AutoscalingPolicy:
    """The configured policy on `clock`; `capacity` is one replica's (required by the policies
    that price work: `queue_slo`, `predictive`)."""
    cls = AUTOSCALING_POLICIES[config.policy]
    return cls(config, cls.Params(**config.params), clock, capacity)
