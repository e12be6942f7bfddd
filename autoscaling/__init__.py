"""Autoscaling: pure rules for a cluster's replica count (no Ray, an injected clock), so the
same policy objects run in the simulator (`sim.autoscaling`) and, on Ray, in a controller
beside the router. A caller builds a `protocol.scaling.ScalingObservation` every decision
period from the load reports it has, asks `policy.decide(observation)` and starts or drains
`decision.change` replicas."""

from autoscaling.base import AutoscalingPolicy, ScalingBounds
from autoscaling.policies import AUTOSCALING_POLICIES, AutoscaleConfig, make_autoscaling_policy
from protocol.scaling import ArrivalWindow, ScalingDecision, ScalingObservation

__all__ = [
    "AUTOSCALING_POLICIES",
    "ArrivalWindow",
    "AutoscaleConfig",
    "AutoscalingPolicy",
    "ScalingBounds",
    "ScalingDecision",
    "ScalingObservation",
    "make_autoscaling_policy",
]
