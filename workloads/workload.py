"""The workload data types, and deterministic prompts of a given token length."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Self

import numpy as np
from pydantic import BaseModel, ConfigDict

from protocol import defaults


class SpecModel(BaseModel):
    """Base of every part of a workload spec: frozen, because a spec is a value a run stores
    and replays, and strict about unknown fields, so a typo is an error rather than a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def replace(self, **changes) -> Self:
        """A copy with `changes`, validated (pydantic's `model_copy(update=...)` is not)."""
        return type(self).model_validate({**self.model_dump(), **changes})


@dataclass(frozen=True)
class WorkloadRequest:
    """One request. `blocks` gives its prompt a prefix structure: the prompt is the
    concatenation of those blocks of `block_len` tokens each (a block id always stands for the
    same tokens within a workload, so requests naming the same leading ids share that prefix,
    as Mooncake's `hash_ids` do), cut or padded with the request's own tokens to `prompt_len`.
    Without blocks the whole prompt is the request's own. `priority` and `tenant` are its class
    for flow control (`protocol.flow`), as a client would send them."""

    arrival: float  # seconds after the start of the run
    prompt_len: int
    output_len: int  # forced: replayed with ignore_eos and max_tokens = output_len
    session_id: str | None = None
    blocks: tuple[int, ...] = ()
    block_len: int = 0
    priority: int = defaults.PRIORITY
    tenant: str = defaults.TENANT


@dataclass(frozen=True)
class ClosedLoop:
    """`users` concurrent users: each sends its next request `think_time` seconds after its
    previous one finished, so arrivals are known only at run time (see `ArrivalSchedule`)."""

    users: int
    think_time: float


@dataclass(frozen=True)
class WorkloadColumns:
    """Requests as arrays, in arrival order: what a model of millions of requests reads
    (`sim.slot_queue`) where a list of `WorkloadRequest`s would not fit its time or memory."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray

    def __len__(self) -> int:
        return int(self.arrival.size)


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    requests: list[WorkloadRequest]  # in a closed loop every `arrival` is 0: the schedule releases them
    params: dict = field(default_factory=dict)  # the generator's arguments, for the record
    spec: dict | None = None  # the JSON dump of the spec that built it: validate and build it to replay exactly
    closed_loop: ClosedLoop | None = None

    def columns(self) -> WorkloadColumns:
        return WorkloadColumns(
            np.array([r.arrival for r in self.requests], dtype=float),
            np.array([r.prompt_len for r in self.requests], dtype=np.int64),
            np.array([r.output_len for r in self.requests], dtype=np.int64),
        )

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    def describe(self) -> str:
        n = len(self.requests)
        span = max(r.arrival for r in self.requests) if n else 0.0
        mean_out = sum(self.output_lens) / n if n else 0.0
        mean_in = sum(r.prompt_len for r in self.requests) / n if n else 0.0
        timing = (
            f"{self.closed_loop.users} closed-loop users (think {self.closed_loop.think_time:g} s)"
            if self.closed_loop
            else f"over {span:.2f} s"
        )
        return (
            f"{self.name} (seed {self.seed}): {n} requests {timing}, "
            f"mean prompt {mean_in:.1f} tokens, mean output {mean_out:.1f} tokens"
        )


# Token ids below this are reserved for special and byte tokens in the models we ship.
_FIRST_ORDINARY_TOKEN = 100


def prompt_token_ids(length: int, seed: int, vocab_size: int) -> list[int]:
    """`length` token ids drawn from a seeded RNG: the same prompt every time for one seed,
    and never a special token, so forced-length replays don't depend on text."""
    rng = random.Random(seed)
    top = min(vocab_size, 32_000)
    return [rng.randrange(_FIRST_ORDINARY_TOKEN, top) for _ in range(length)]


def block_token_ids(block_id: int, block_len: int, workload_seed: int, vocab_size: int) -> list[int]:
    """The tokens a prompt block id stands for in a workload replayed with `workload_seed`."""
    rng = random.Random(f"block-{workload_seed}-{block_id}")
    top = min(vocab_size, 32_000)
    return [rng.randrange(_FIRST_ORDINARY_TOKEN, top) for _ in range(block_len)]


def request_prompt(workload_seed: int, index: int, request: WorkloadRequest, vocab_size: int) -> list[int]:
    """The prompt of the `index`-th request of a workload replayed with `workload_seed`: the
    same ids whether the in-process replay or the cluster driver sends it. A request with
    `blocks` starts with its blocks' tokens (see WorkloadRequest)."""
    own_seed = workload_seed * 1_000_003 + index
    if not request.blocks:
        return prompt_token_ids(request.prompt_len, own_seed, vocab_size)
    ids: list[int] = []
    for block_id in request.blocks:
        if len(ids) >= request.prompt_len:
            break
        ids += block_token_ids(block_id, request.block_len, workload_seed, vocab_size)
    ids = ids[: request.prompt_len]
    return ids + prompt_token_ids(request.prompt_len - len(ids), own_seed, vocab_size)
