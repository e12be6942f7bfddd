"""The calibrated cost model of the simulator: a step's time as a linear function of its work
(decode and prefill tokens, attended context, padding rows), fitted by non-negative least
squares to step times the real engine measured (`slotserve calibrate`, or recorded runs); and
the serving loop's time per step beside what the model prices (`step_overhead`), which a
simulated replica adds to every step (`sim.simulator.SimulationConfig.step_overhead`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.cost import MAX_LOOP_GAP, LinearCostModel, StepFeatures, fit_linear_cost
from replica.errors import ConfigError

FEATURES = ("decode_tokens", "prefill_tokens", "context_tokens", "padding_rows")


class FitQuality(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    r2: float = Field(description="coefficient of determination on the held-out samples")
    median_rel_error: float = Field(description="median |predicted - measured| / measured on the held-out samples")
    num_fit: int = Field(description="samples the coefficients were fitted on")
    num_heldout: int = Field(description="samples the quality was measured on (not fitted)")


class FittedCostModel(LinearCostModel):
    """A `LinearCostModel` fitted to measured step times, saved as JSON with the machine it was
    measured on and how well it fits, since a cost model means nothing apart from both."""

    machine: dict[str, Any] = Field(default_factory=dict, description="cpu, cores, torch, threads, model, dtype, ...")
    quality: FitQuality | None = None

    @classmethod
    def fit(
        cls,
        samples: Sequence[tuple[StepFeatures, float]],
        machine: dict[str, Any] | None = None,
        heldout_every: int = 5,
    ) -> FittedCostModel:
        """Non-negative least squares on (features, measured seconds) samples; every
        `heldout_every`-th sample is kept out of the fit and used to measure its quality."""
        if heldout_every < 2:
            raise ConfigError(f"heldout_every must be >= 2 (every k-th sample held out), got {heldout_every}")
        held = [s for i, s in enumerate(samples) if i % heldout_every == heldout_every - 1]
        train = [s for i, s in enumerate(samples) if i % heldout_every != heldout_every - 1]
        if len(train) < 2 * (len(FEATURES) + 1) or not held:
            raise ConfigError(
                f"need at least {2 * (len(FEATURES) + 1) + 2} samples to fit a cost model, got {len(samples)}"
            )
        model = cls(**fit_linear_cost(train).model_dump(), machine=machine or {})
        pred = np.array([model.predict(f) for f, _ in held])
        yh = np.array([t for _, t in held])
        total = float(((yh - yh.mean()) ** 2).sum())
        r2 = 1.0 - float(((yh - pred) ** 2).sum()) / total if total > 0 else float("nan")
        rel = float(np.median(np.abs(pred - yh) / np.maximum(yh, 1e-12)))
        return model.model_copy(
            update={"quality": FitQuality(r2=r2, median_rel_error=rel, num_fit=len(train), num_heldout=len(held))}
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FittedCostModel:
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no cost model at {path} (make one with `slotserve calibrate --out {path}`)") from None
        except (ValidationError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path} is not a slotserve cost model: {err}") from None


def step_overhead(steps: Sequence[dict], cost: LinearCostModel) -> float | None:
    """Seconds a replica spends per step beyond what `cost` prices the step at, from the steps a
    cluster's replicas recorded (`steps` rows of the metrics store, any replicas and runs): the
    median, over every step a busy replica followed at once with another (the next one starting
    within `MAX_LOOP_GAP` of its end: not an idle wait for an arrival), of the time from its start
    to the next one's start less its price. That covers the loop's work between steps (token
    events, the load report, the inbox) and, on a fake replica, each priced sleep's overshoot.
    A pair further apart than MAX_LOOP_GAP is left out as idle, so a loop that spends that much
    or more between its steps is not measured. `cost` prices every replica: replicas of
    different speeds are read one speed at a time. None: no such pair of steps."""
    by_replica: dict[tuple, list[dict]] = {}
    for row in steps:
        by_replica.setdefault((row.get("run_id"), row["replica_id"]), []).append(row)
    excess = []
    for rows in by_replica.values():
        rows.sort(key=lambda r: r["start"])
        for step, after in zip(rows, rows[1:]):
            if after["start"] - (step["start"] + step["duration"]) < MAX_LOOP_GAP:
                excess.append(after["start"] - step["start"] - cost.predict(StepFeatures.of_row(step)))
    return float(np.median(excess)) if excess else None
