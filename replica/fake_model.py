"""Fake models for scheduling experiments and fast tests: no torch, no weights.

The scripted runner's next token is a function of the sequence's content, so a preempted and
re-prefilled sequence replays exactly; its step time comes from a cost model and is paid on
the injected clock (instantly on a FakeClock, really on a WallClock)."""

from __future__ import annotations

from dataclasses import dataclass

from replica.clock import Clock
from replica.scheduler import SchedulerOutput


@dataclass(frozen=True)
class FlatCostModel:
    """Every step costs the same, whatever the batch: the idealised accelerator."""

    step_seconds: float = 0.02

    def step_time(self, out: SchedulerOutput) -> float:
        return self.step_seconds


class ScriptedFakeRunner:
    tokenizer = None

    def __init__(self, clock: Clock, cost: FlatCostModel | None = None, vocab_size: int = 1000,
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

    def execute(self, out: SchedulerOutput) -> list[int]:
        self.clock.sleep(self.cost.step_time(out))
        self.num_steps += 1
        return [self.next_token(c.request.token_ids(0, c.request.num_tokens)) for c in out.chunks if c.samples]

    def release(self, request_id: str) -> None:
        pass
