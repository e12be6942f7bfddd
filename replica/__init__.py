"""One engine replica: model runner, slot K/V cache, batching schedulers, sampler.

The engine and its schedulers import no Ray; torch is loaded only when a real model is used.
"""

from replica.config import EngineConfig
from replica.engine import Completion, Engine, RequestOutput, StepRecord, StepResult
from replica.errors import ConfigError, InvalidRequestError, InvariantViolation, RequestTooLongError
from replica.scheduling.policies import POLICIES, make_scheduler
from replica.scheduling.request import FinishReason, Request, SamplingParams

__all__ = [
    "POLICIES",
    "Completion",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "InvalidRequestError",
    "InvariantViolation",
    "Request",
    "RequestOutput",
    "RequestTooLongError",
    "SamplingParams",
    "StepRecord",
    "StepResult",
    "make_scheduler",
]
