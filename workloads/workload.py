"""The workload data types, and deterministic prompts of a given token length."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadRequest:
    arrival: float  # seconds after the start of the run
    prompt_len: int
    output_len: int  # forced: replayed with ignore_eos and max_tokens = output_len
    session_id: str | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    requests: list[WorkloadRequest]
    params: dict = field(default_factory=dict)  # the generator's arguments, for the record

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    def describe(self) -> str:
        n = len(self.requests)
        span = max(r.arrival for r in self.requests) if n else 0.0
        mean_out = sum(self.output_lens) / n if n else 0.0
        mean_in = sum(r.prompt_len for r in self.requests) / n if n else 0.0
        return (f"{self.name} (seed {self.seed}): {n} requests over {span:.2f} s, "
                f"mean prompt {mean_in:.1f} tokens, mean output {mean_out:.1f} tokens")


# Token ids below this are reserved for special and byte tokens in the models we ship.
_FIRST_ORDINARY_TOKEN = 100


def prompt_token_ids(length: int, seed: int, vocab_size: int) -> list[int]:
    """`length` token ids drawn from a seeded RNG: the same prompt every time for one seed,
    and never a special token, so forced-length replays don't depend on text."""
    rng = random.Random(seed)
    top = min(vocab_size, 32_000)
    return [rng.randrange(_FIRST_ORDINARY_TOKEN, top) for _ in range(length)]


def request_prompt(workload_seed: int, index: int, request: WorkloadRequest, vocab_size: int) -> list[int]:
    """The prompt of the `index`-th request of a workload replayed with `workload_seed`: the
    same ids whether the in-process replay or the cluster driver sends it."""
    return prompt_token_ids(request.prompt_len, workload_seed * 1_000_003 + index, vocab_size)
