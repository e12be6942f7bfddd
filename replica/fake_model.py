"""Fake models for scheduling experiments, fast tests and the simulator: no torch, no weights.

The scripted runner's next token is a function of the sequence's content, so a preempted and
re-prefilled sequence replays exactly; its step time comes from a cost model and is paid on
the injected clock (instantly on a FakeClock, really on a WallClock).

Two cost models: `FlatCostModel` (every step the same: the idealised accelerator) and
`FittedCostModel` (a linear model of a step's work, fitted by least squares to step times
the real engine measured on a real machine by `slotserve calibrate`)."""

from __future__ import annotations

import json
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from replica.clock import Clock
from replica.errors import ConfigError
from replica.request import Request
from replica.scheduler import SchedulerOutput


class CostModel(Protocol):
    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds one engine step running `out` takes."""
        ...


@dataclass(frozen=True)
class FlatCostModel:
    """Every step costs the same, whatever the batch: the idealised accelerator."""

    step_seconds: float = 0.02

    def step_time(self, out: SchedulerOutput) -> float:
        return self.step_seconds


@dataclass(frozen=True)
class StepFeatures:
    """What a step's time is modelled from, read off its SchedulerOutput:

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
    def of(cls, out: SchedulerOutput) -> StepFeatures:
        return cls(out.num_decode_tokens, out.num_prefill_tokens, out.context_tokens, len(out.held_rows))

    @classmethod
    def of_row(cls, row: dict) -> StepFeatures:
        """The features of a recorded step (a `steps` row of the metrics store): how a cost
        model is fitted to real runs."""
        return cls(row["decode_tokens"], row["prefill_tokens"], row["context_tokens"],
                   row["computed_rows"] - row["useful_rows"])


FEATURES = ("decode_tokens", "prefill_tokens", "context_tokens", "padding_rows")


class FitQuality(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    r2: float = Field(description="coefficient of determination on the held-out samples")
    median_rel_error: float = Field(description="median |predicted - measured| / measured on the held-out samples")
    num_fit: int = Field(description="samples the coefficients were fitted on")
    num_heldout: int = Field(description="samples the quality was measured on (not fitted)")


class FittedCostModel(BaseModel):
    """step_time = c0 + c_decode * decode_tokens + c_prefill * prefill_tokens
    + c_ctx * context_tokens + c_held * padding_rows (seconds; see StepFeatures), every
    coefficient non-negative so no step is predicted to get cheaper by doing more. Saved as
    JSON with the machine it was measured on and how well it fits, since a cost model means
    nothing apart from both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    c0: float = Field(ge=0, description="seconds per step, whatever it runs")
    c_decode: float = Field(ge=0, description="seconds per decode token")
    c_prefill: float = Field(ge=0, description="seconds per prefill token")
    c_ctx: float = Field(ge=0, description="seconds per attended context token")
    c_held: float = Field(ge=0, description="seconds per padding row of a static batch")
    machine: dict[str, Any] = Field(default_factory=dict, description="cpu, cores, torch, threads, model, dtype, ...")
    quality: FitQuality | None = None

    @property
    def coefficients(self) -> tuple[float, ...]:
        return self.c0, self.c_decode, self.c_prefill, self.c_ctx, self.c_held

    def predict(self, f: StepFeatures) -> float:
        return self.c0 + self.c_decode * f.decode_tokens + self.c_prefill * f.prefill_tokens \
            + self.c_ctx * f.context_tokens + self.c_held * f.padding_rows

    def step_time(self, out: SchedulerOutput) -> float:
        return self.predict(StepFeatures.of(out))

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepFeatures, float]], machine: dict[str, Any] | None = None,
            heldout_every: int = 5) -> FittedCostModel:
        """Non-negative least squares on (features, measured seconds) samples; every
        `heldout_every`-th sample is kept out of the fit and used to measure its quality."""
        if heldout_every < 2:
            raise ConfigError(f"heldout_every must be >= 2 (every k-th sample held out), got {heldout_every}")
        held = [s for i, s in enumerate(samples) if i % heldout_every == heldout_every - 1]
        train = [s for i, s in enumerate(samples) if i % heldout_every != heldout_every - 1]
        if len(train) < 2 * (len(FEATURES) + 1) or not held:
            raise ConfigError(f"need at least {2 * (len(FEATURES) + 1) + 2} samples to fit a cost model, "
                              f"got {len(samples)}")
        x, y = _design(train)
        model = cls(**dict(zip(("c0", "c_decode", "c_prefill", "c_ctx", "c_held"), _nnls(x, y).tolist())),
                    machine=machine or {})
        xh, yh = _design(held)
        pred = xh @ np.array(model.coefficients)
        total = float(((yh - yh.mean()) ** 2).sum())
        r2 = 1.0 - float(((yh - pred) ** 2).sum()) / total if total > 0 else float("nan")
        rel = float(np.median(np.abs(pred - yh) / np.maximum(yh, 1e-12)))
        return model.model_copy(update={"quality": FitQuality(r2=r2, median_rel_error=rel, num_fit=len(train),
                                                              num_heldout=len(held))})

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


def _design(samples: Sequence[tuple[StepFeatures, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The design matrix (a column of ones for c0, then the features) and the targets."""
    x = np.array([(1, *astuple(f)) for f, _ in samples], dtype=float)
    return x, np.array([t for _, t in samples], dtype=float)


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


class ScriptedFakeRunner:
    tokenizer = None

    def __init__(self, clock: Clock, cost: CostModel | None = None, vocab_size: int = 1000,
                 eos_token_id: int | None = None, max_model_len: int = 4096):
        self.clock = clock
        self.cost = cost or FlatCostModel()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = set() if eos_token_id is None else {eos_token_id}
        self.num_steps = 0

    def next_token(self, token_ids: list[int]) -> int:
        """A fixed function of the whole sequence so far."""
        h = len(token_ids)
        for t in token_ids:
            h = (h * 1_000_003 + t) % 2_147_483_647
        return h % self.vocab_size

    def sample(self, request: Request) -> int:
        return self.next_token(request.token_ids(0, request.num_tokens))

    def execute(self, out: SchedulerOutput) -> list[int]:
        self.clock.sleep(self.cost.step_time(out))
        self.num_steps += 1
        return [self.sample(c.request) for c in out.chunks if c.samples]

    def release(self, request_id: str) -> None:
        pass


class SimulationRunner(ScriptedFakeRunner):
    """The scripted runner for long simulations: the next token is a function of the
    sequence's length and last token only, O(1) instead of a hash over the whole sequence
    (O(n^2) over a request's life). Still deterministic, and a re-prefilled sequence still
    replays, since both inputs are the same after a preemption."""

    def sample(self, request: Request) -> int:
        last = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
        return (request.num_tokens * 1_000_003 + last) % 2_147_483_647 % self.vocab_size
