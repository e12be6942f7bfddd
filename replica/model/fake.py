"""Fake models for scheduling experiments, fast tests and the simulator: no torch, no weights.

The scripted runner's next token is a function of the sequence's content, so a preempted and
re-prefilled sequence replays exactly; its step time comes from a cost model and is paid on
the injected clock (instantly on a FakeClock, really on a WallClock).

Two cost models price the steps: `FlatCostModel` (every step the same: the idealised
accelerator), here, and `protocol.cost.LinearCostModel` (a step priced from its work: decode and
prefill tokens, attended context, padding rows), whose coefficients
`sim.cost_model.FittedCostModel` fits to the real engine. A
fake replica priced by a fitted model behaves like the real one where routing is concerned (a
long prefill slows the step, a prefix-cache hit saves it) at none of its CPU cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from protocol.clock import Clock
from protocol.cost import LinearCostModel
from replica.scheduling.request import Request
from replica.scheduling.scheduler import SchedulerOutput


class CostModel(Protocol):
    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds one engine step running `out` takes."""
        ...

    def scaled(self, factor: float) -> CostModel:
        """The same costs, every step `factor` times as long (a replica of another speed)."""
        ...


@dataclass(frozen=True)
class FlatCostModel:
    """Every step costs the same, whatever the batch: the idealised accelerator."""

    step_seconds: float = 0.02

    def step_time(self, out: SchedulerOutput) -> float:
        return self.step_seconds

    def scaled(self, factor: float) -> FlatCostModel:
        return FlatCostModel(self.step_seconds * factor)


# K/V bytes per token a fake replica states for a hand-over: the default model's
# (SmolLM2-135M: 30 layers, 3 K/V heads of 64, K and V) in bfloat16.
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2


class ScriptedFakeRunner:
    tokenizer = None

    def __init__(
        self,
        clock: Clock,
        cost: CostModel | None = None,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        max_model_len: int = 4096,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
    ):
        self.clock = clock
        self.cost = cost or FlatCostModel()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_bytes_per_token = kv_bytes_per_token  # no tensors: what a hand-over of its K/V would send
        self.eos_token_ids = set() if eos_token_id is None else {eos_token_id}
        self.num_steps = 0

    @property
    def step_cost(self) -> LinearCostModel | None:
        """Its step prices as a linear model (a flat step is one of `c0` alone), which the
        engine puts on its load reports for a router that predicts latency; None for a cost
        model of another shape."""
        if isinstance(self.cost, FlatCostModel):
            return LinearCostModel(c0=self.cost.step_seconds, c_decode=0, c_prefill=0, c_ctx=0, c_held=0)
        return self.cost if isinstance(self.cost, LinearCostModel) else None

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
