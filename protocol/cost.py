"""What an engine step costs, as a linear function of its work: the pricing a fake replica pays
its steps by (`replica.model.fake`), the simulator's fitted cost model extends
(`sim.cost_model.FittedCostModel`), and a router predicting latency prices a replica's queue by
(`router.predicted_latency`). Here, in the bottom layer, because the replica, the simulator and
the router all read it and the router may import nothing else of theirs.

A replica that knows its pricing sends it on its load reports (`StepPricing`), with the token
budget that decides how many steps a prompt takes, so a router prices each replica by its own
speed from its first report on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class ScheduledStep(Protocol):
    """The work of one step as a scheduler lays it out (`replica.scheduling.scheduler.SchedulerOutput`)."""

    @property
    def num_decode_tokens(self) -> int: ...

    @property
    def num_prefill_tokens(self) -> int: ...

    @property
    def context_tokens(self) -> int: ...

    @property
    def held_rows(self) -> list: ...


@dataclass(frozen=True)
class StepFeatures:
    """What a step's time is modelled from, read off its scheduled work:

    - decode_tokens, prefill_tokens: rows through the weight matrices (every row costs the
      same there, but a CPU runs small decode batches far from its FLOP roof, so the two
      kinds get separate coefficients);
    - context_tokens: keys attended, summed over the step's rows (SchedulerOutput.context_tokens);
    - padding_rows: finished requests a static batch still computes (one row each, which
      also attends its whole context)."""

    decode_tokens: int
    prefill_tokens: int
    context_tokens: int
    padding_rows: int

    @classmethod
    def of(cls, out: ScheduledStep) -> StepFeatures:
        return cls(out.num_decode_tokens, out.num_prefill_tokens, out.context_tokens, len(out.held_rows))

    @classmethod
    def of_row(cls, row: dict) -> StepFeatures:
        """The features of a recorded step (a `steps` row of the metrics store): how a cost
        model is fitted to real runs."""
        return cls(
            row["num_decode_tokens"],
            row["num_prefill_tokens"],
            row["context_tokens"],
            row["computed_rows"] - row["useful_rows"],
        )


class LinearCostModel(BaseModel):
    """step_time = c0 + c_decode * decode_tokens + c_prefill * prefill_tokens
    + c_ctx * context_tokens + c_held * padding_rows (seconds; see StepFeatures), every
    coefficient non-negative so no step is predicted to get cheaper by doing more."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    c0: float = Field(ge=0, description="seconds per step, whatever it runs")
    c_decode: float = Field(ge=0, description="seconds per decode token")
    c_prefill: float = Field(ge=0, description="seconds per prefill token")
    c_ctx: float = Field(ge=0, description="seconds per attended context token")
    c_held: float = Field(ge=0, description="seconds per padding row of a static batch")

    @property
    def coefficients(self) -> tuple[float, ...]:
        return self.c0, self.c_decode, self.c_prefill, self.c_ctx, self.c_held

    def predict(self, f: StepFeatures) -> float:
        return (
            self.c0
            + self.c_decode * f.decode_tokens
            + self.c_prefill * f.prefill_tokens
            + self.c_ctx * f.context_tokens
            + self.c_held * f.padding_rows
        )

    def step_time(self, out: ScheduledStep) -> float:
        return self.predict(StepFeatures.of(out))

    def scaled(self, factor: float) -> LinearCostModel:
        """Every step `factor` times as long: the same machine's relative costs, run faster
        (or slower), so a wall-clock experiment on fake replicas fits its time."""
        names = ("c0", "c_decode", "c_prefill", "c_ctx", "c_held")
        return LinearCostModel(**{n: c * factor for n, c in zip(names, self.coefficients)})


# Seconds from a step's end to the next one's start that still count as the serving loop going
# on: a longer gap is an idle wait for an arrival, so a step followed by one is timed alone
# (`replica.pricing`, and the simulator's `step_overhead`, which cannot measure loop work of
# this much or more per step since it is dropped with the idle waits).
MAX_LOOP_GAP = 0.01


def fit_linear_cost(samples: Sequence[tuple[StepFeatures, float]]) -> LinearCostModel:
    """The `LinearCostModel` that fits (features, measured seconds) samples best by
    non-negative least squares: what the simulator's calibration fits to recorded steps
    (`sim.cost_model.FittedCostModel`) and a real replica to its own (`replica.pricing`)."""
    x = np.array([(1, f.decode_tokens, f.prefill_tokens, f.context_tokens, f.padding_rows) for f, _ in samples])
    y = np.array([t for _, t in samples], dtype=float)
    return LinearCostModel(**dict(zip(("c0", "c_decode", "c_prefill", "c_ctx", "c_held"), _nnls(x, y).tolist())))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (no scipy here): solve on the active columns and
    drop the most negative coefficient until none is negative. Columns are scaled to unit
    norm first, since context tokens run to 1e5 while the intercept column is ones."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol = np.linalg.lstsq(xs[:, active], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return coef / scale


@dataclass(frozen=True)
class StepPricing:
    """How a replica's steps are priced, as its load reports tell a router: its cost model,
    the tokens one step may run (`token_budget`; None: a prompt is prefilled in one step), and
    the serving loop's own seconds between two steps run back to back that the cost model
    leaves out (`loop_overhead`: a stated model prices a step's work alone; a measured one,
    timed from one step's start to the next's, has it in already)."""

    cost: LinearCostModel
    token_budget: int | None
    loop_overhead: float = 0.0
