"""Length distributions for prompts and outputs, as serialisable specs (a `kind` field tells
them apart). Each draws one integer length >= 1 from the RNG it is given; the workload spec
decides which RNG and in what order, so the draws are reproducible. `sample_array` draws `n`
at once from a numpy generator (the same distribution, not the same draws): for workloads of
millions, such as a day on hundreds of replicas."""

from __future__ import annotations

import math
import random
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from workloads.workload import SpecModel


class FixedLength(SpecModel):
    """Always `value` tokens; draws nothing from the RNG."""

    kind: Literal["fixed"] = "fixed"
    value: PositiveInt

    def sample(self, rng: random.Random) -> int:
        return self.value

    def sample_array(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class UniformLength(SpecModel):
    """An integer uniform on [low, high], both included."""

    kind: Literal["uniform"] = "uniform"
    low: PositiveInt
    high: PositiveInt

    @model_validator(mode="after")
    def _ordered(self) -> UniformLength:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def sample_array(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True)


class LognormalLength(SpecModel):
    """median * exp(sigma * N(0, 1)), rounded and clipped to [low, high]. sigma 0 gives the
    median every time but still draws, so changing sigma alone keeps the other draws in step."""

    kind: Literal["lognormal"] = "lognormal"
    median: PositiveFloat
    sigma: NonNegativeFloat
    low: PositiveInt = 1
    high: PositiveInt

    @model_validator(mode="after")
    def _ordered(self) -> LognormalLength:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> int:
        return int(min(self.high, max(self.low, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))))

    def sample_array(self, n: int, rng: np.random.Generator) -> np.ndarray:
        drawn = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(n)))
        return np.clip(drawn, self.low, self.high).astype(np.int64)


class MixtureLength(SpecModel):
    """Pick a component with probability weight / total weight (one uniform draw), then draw
    from it: e.g. 70% short and 30% long outputs."""

    kind: Literal["mixture"] = "mixture"
    components: tuple[tuple[NonNegativeFloat, LengthDist], ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _some_weight(self) -> MixtureLength:
        if sum(w for w, _ in self.components) <= 0:
            raise ValueError("components: the weights must sum to more than 0")
        return self

    def sample(self, rng: random.Random) -> int:
        u = rng.random() * sum(w for w, _ in self.components)
        cumulative = 0.0
        for weight, dist in self.components[:-1]:
            cumulative += weight
            if u < cumulative:
                return dist.sample(rng)
        return self.components[-1][1].sample(rng)

    def sample_array(self, n: int, rng: np.random.Generator) -> np.ndarray:
        weights = np.array([w for w, _ in self.components], dtype=float)
        picks = rng.choice(len(weights), size=n, p=weights / weights.sum())
        out = np.empty(n, dtype=np.int64)
        for i, (_, dist) in enumerate(self.components):
            chosen = picks == i
            out[chosen] = dist.sample_array(int(chosen.sum()), rng)
        return out


LengthDist = Annotated[FixedLength | UniformLength | LognormalLength | MixtureLength, Field(discriminator="kind")]
MixtureLength.model_rebuild()
