"""Flow control's configuration: what a user writes in a TOML file to give request classes
(priority bands, tenants) their place when the cluster is saturated. One pydantic model, the
one source of every default; the router's `router.flow_control.FlowController` runs it.

Policies: "fcfs" dispatches at once and holds nothing (the router's behaviour without flow
control); "priority" holds requests while every replica is saturated and releases them by
strict priority between bands, first come first served within one; "vtc" is strict priority
between bands and the Virtual Token Counter's fair share between tenants within one (Sheng et
al., "Fairness in Serving Large Language Models", OSDI'24).

Example (`FlowConfig.load("flow.toml")`):

    policy = "vtc"
    priorities = [0, 1, 2]
    max_held = 2000
    max_wait = { 0 = 5.0, 2 = 60.0 }

    [tenants.batch]
    weight = 1.0
    tokens_per_s = 4000

    [saturation]
    queue_depth = 2
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from protocol.errors import SlotServeError

FlowPolicy = Literal["fcfs", "priority", "vtc"]  # see the module docstring


class FlowConfigError(SlotServeError, ValueError):
    """A flow-control config that cannot be read or names a bad value; the message names the file and the field."""


class UnknownPriorityError(SlotServeError, ValueError):
    """A request's priority is not one of the configured bands. `field` is "priority", as a
    front end answering 400 names the request field at fault."""

    def __init__(self, priority: int, allowed: list[int]):
        self.field, self.priority, self.allowed = "priority", priority, list(allowed)
        self.reason = (
            f"{priority} is not a priority band; allowed: {', '.join(map(str, allowed))} (lower is served first)"
        )
        super().__init__(f"invalid request: priority: {self.reason}")

    def __reduce__(self):  # so the error crosses process boundaries (Ray) intact
        return type(self), (self.priority, self.allowed)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantConfig(_Section):
    """One tenant: its VTC `weight` (a tenant of weight 2 is owed twice the service of one of
    weight 1) and its token-bucket limits, each optional. A bucket holds `burst` seconds of its
    rate, so a tenant idle for a while may send that much at once."""

    weight: PositiveFloat = 1.0
    requests_per_s: PositiveFloat | None = Field(None, description="requests admitted per second, at most")
    tokens_per_s: PositiveFloat | None = Field(
        None, description="prompt + max_tokens tokens admitted per second, at most"
    )
    burst: PositiveFloat = Field(1.0, description="seconds of each rate a full bucket holds")
    api_keys: list[str] = Field(
        default_factory=list, description="HTTP API keys that authenticate as this tenant (`slotserve serve`)"
    )


class SaturationConfig(_Section):
    """When a replica is saturated, from its last load report corrected by what the router has
    sent it since (llm-d's saturation detector): its estimated queue (reported queue depth plus
    the requests routed there beyond its free slots) is at least `queue_depth`, or its free K/V
    is below `min_free_kv` of its stated budget. The cluster is saturated when every routable
    replica is (and when none is routable)."""

    queue_depth: NonNegativeInt = 5
    min_free_kv: float = Field(0.2, ge=0.0, le=1.0, description="share of the replica's K/V budget")


class FlowConfig(_Section):
    policy: FlowPolicy = "fcfs"
    priorities: list[int] = Field([0, 1, 2], min_length=1, description="the allowed bands; lower is served first")
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict, description="per-tenant weight and limits; one not named has TenantConfig()'s"
    )
    max_wait: dict[int, PositiveFloat] = Field(
        default_factory=dict, description="per band: seconds a request may be held before it is refused"
    )
    max_held: PositiveInt = Field(10_000, description="requests held in all; past it the least urgent are shed")
    prompt_weight: PositiveFloat = Field(1.0, description="VTC's cost of a prompt token")
    output_weight: PositiveFloat = Field(2.0, description="VTC's cost of an output token")
    saturation: SaturationConfig = SaturationConfig()

    @field_validator("priorities")
    @classmethod
    def _unique_sorted(cls, bands: list[int]) -> list[int]:
        if len(set(bands)) != len(bands):
            raise ValueError(f"repeated band in {bands}")
        return sorted(bands)

    @model_validator(mode="after")
    def _waits_name_bands(self) -> FlowConfig:
        unknown = sorted(set(self.max_wait) - set(self.priorities))
        if unknown:
            raise ValueError(f"max_wait names band {unknown[0]}, not one of priorities {self.priorities}")
        self.tenant_keys()
        return self

    def tenant_keys(self) -> dict[str, str]:
        """Each tenant's API keys: key -> tenant (a key of two tenants is an error)."""
        keys: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            for key in tenant.api_keys:
                if keys.setdefault(key, name) != name:
                    raise ValueError(f"tenants {keys[key]!r} and {name!r} share an API key")
        return keys

    def tenant(self, name: str) -> TenantConfig:
        """The tenant's config; one the file does not name has the defaults (no limits, weight 1)."""
        return self.tenants.get(name) or _DEFAULT_TENANT

    def check_priority(self, priority: int) -> None:
        if priority not in self.priorities:
            raise UnknownPriorityError(priority, self.priorities)

    @classmethod
    def load(cls, path: str | Path) -> FlowConfig:
        """Read a TOML file; an error names the file and the field."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as err:
            raise FlowConfigError(f"{path}: cannot read the flow-control config: {err.strerror}") from None
        except tomllib.TOMLDecodeError as err:
            raise FlowConfigError(f"{path}: TOML syntax: {err}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise FlowConfigError(f"{path}: {where}: {first['msg']}") from None


_DEFAULT_TENANT = TenantConfig()
