"""Fake models for scheduling experiments, fast tests and the simulator: no torch, no weights.

The scripted runner's next token is a function of the sequence's content, so a preempted and
re-prefilled sequence replays exactly; its step time comes from a cost model and is paid on
the injected clock (instantly on a FakeClock, really on a WallClock).

The cost model here is `FlatCostModel` (every step the same: the idealised accelerator); the
simulator's `sim.cost_model.FittedCostModel` prices a step from its work instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from protocol.clock import Clock
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
