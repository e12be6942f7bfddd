"""What one engine replica is made of: the model, its dtype and device, the batching policy and
the scheduler's limits. One validated object that the engine, the model runner and the
cluster's replica config all take whole."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from replica.model_loader import DEFAULT_MODEL
from replica.policies import POLICIES
from replica.scheduler import SchedulerConfig


class EngineConfig(SchedulerConfig):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(DEFAULT_MODEL, description="built-in name or a local Hugging Face directory")
    policy: str = Field("continuous", description="batching policy (see replica.policies.POLICIES)")
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = Field("auto", description='"auto" (cuda when present), "cpu" or "cuda"')
    seed: int = 0

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        return POLICIES.check(policy)
