"""Fake models for scheduling experiments, fast tests and the simulator: no torch, no weights.

The scripted runner's next token is a function of the sequence's content, so a preempted and
re-prefilled sequence replays exactly; its step time comes from a cost model and is paid on
the injected clock (instantly on a FakeClock, really on a WallClock).

Two cost models live here: `FlatCostModel` (every step the same: the idealised accelerator) and
`LinearCostModel` (a step priced from its work: decode and prefill tokens, attended context,
padding rows), whose coefficients `sim.cost_model.FittedCostModel` fits to the real engine. A
fake replica priced by a fitted model behaves like the real one where routing is concerned (a
long prefill slows the step, a prefix-cache hit saves it) at none of its CPU cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from protocol.clock import Clock
from replica.scheduling.request import Request
from replica.scheduling.scheduler import SchedulerOutput


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

    def step_time(self, out: SchedulerOutput) -> float:
        return self.predict(StepFeatures.of(out))

    def scaled(self, factor: float) -> LinearCostModel:
        """Every step `factor` times as long: the same machine's relative costs, run faster
        (or slower), so a wall-clock experiment on fake replicas fits its time."""
        names = ("c0", "c_decode", "c_prefill", "c_ctx", "c_held")
        return LinearCostModel(**{n: c * factor for n, c in zip(names, self.coefficients)})


class ScriptedFakeRunner:
    tokenizer = None

    def __init__(
        self,
        clock: Clock,
        cost: CostModel | None = None,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        max_model_len: int = 4096,
    ):
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

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        """The `n` tokens an undisturbed greedy run makes after `prompt`: what tests compare a
        preempted, migrated or batched run against."""
        ids = list(prompt)
        for _ in range(n):
            ids.append(self.next_token(ids))
        return ids[len(prompt) :]

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
