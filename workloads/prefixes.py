"""Prompts with a shared-prefix structure, and the best prefix-cache hit rate a workload allows.

`SharedPrefix` is what the `shared-prefix` standard workload adds to a synthetic spec: a few
system prompts of stated lengths, picked by Zipf popularity, and multi-turn sessions. Each turn
of a session sends the whole conversation so far (system prompt, every earlier user message and
answer) plus a new user message, so turn k+1's prompt extends turn k's. Prompts are built from
blocks (`WorkloadRequest.blocks`): a system prompt's blocks are shared by every session that
uses it, a session's history blocks by its later turns, and every new message or answer takes
fresh block ids.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import Field, PositiveFloat, PositiveInt

from protocol.blocks import block_hashes, cacheable_block_hashes
from workloads.workload import SpecModel, Workload, WorkloadRequest, request_prompt

_SYSTEM_BLOCK_BASE = 1_000_000  # system prompt k's j-th block: (k + 1) * base + j
_FRESH_BLOCK_BASE = 1_000_000_000  # message and answer blocks, numbered from here


@dataclass
class _Session:
    session_id: str
    blocks: list[int]  # the conversation so far
    turns: int = 0


@dataclass
class _Sessions:
    """The sessions open while a workload is built (one per `active_sessions` seat)."""

    spec: SharedPrefix
    rng: random.Random
    seats: list[_Session | None] = field(default_factory=list)
    made: itertools.count = field(default_factory=itertools.count)
    fresh: itertools.count = field(default_factory=lambda: itertools.count(_FRESH_BLOCK_BASE))

    def blocks_for(self, tokens: int) -> list[int]:
        return [next(self.fresh) for _ in range(-(-tokens // self.spec.block_len))]

    def open(self) -> _Session:
        k = self.rng.choices(range(len(self.spec.system_prompt_lens)), weights=self.spec.popularity)[0]
        system = -(-self.spec.system_prompt_lens[k] // self.spec.block_len)
        return _Session(f"s{next(self.made)}", [(k + 1) * _SYSTEM_BLOCK_BASE + j for j in range(system)])


class SharedPrefix(SpecModel):
    """Turns a spec's lengths into shared-prefix sessions: the spec's prompt length becomes each
    turn's new user message, its output length each turn's answer."""

    system_prompt_lens: tuple[PositiveInt, ...] = Field(
        (256, 192, 128, 64), min_length=1, description="tokens of each system prompt (rounded up to whole blocks)"
    )
    zipf_s: PositiveFloat = Field(1.2, description="system prompt k (from 1) is picked with weight 1 / k**zipf_s")
    active_sessions: PositiveInt = Field(16, description="sessions open at once; each arrival continues one at random")
    turns: PositiveInt = Field(4, description="most turns per session; then a new session takes its seat")
    block_len: PositiveInt = Field(16, description="tokens per prompt block")
    max_prompt_len: PositiveInt = Field(448, description="a session ends before a turn's prompt + answer exceed this")

    @property
    def popularity(self) -> list[float]:
        return [1.0 / (k + 1) ** self.zipf_s for k in range(len(self.system_prompt_lens))]

    def requests(self, times: Sequence[float], lengths: Sequence[tuple[int, int]], seed: int) -> list[WorkloadRequest]:
        """One request per arrival time and (user message, answer) length pair, in order."""
        sessions = _Sessions(self, random.Random(f"{seed}-sessions"), [None] * self.active_sessions)
        out = []
        for t, (message, answer) in zip(times, lengths):
            seat = sessions.rng.randrange(self.active_sessions)
            session = sessions.seats[seat]
            message_blocks = sessions.blocks_for(message)
            if session is None or session.turns >= self.turns or self._too_long(session, message_blocks, answer):
                session = sessions.seats[seat] = sessions.open()
            prompt = session.blocks + message_blocks
            out.append(
                WorkloadRequest(
                    t, len(prompt) * self.block_len, answer, session.session_id, tuple(prompt), self.block_len
                )
            )
            session.blocks = prompt + sessions.blocks_for(answer)
            session.turns += 1
        return out

    def _too_long(self, session: _Session, message_blocks: list[int], answer: int) -> bool:
        return (len(session.blocks) + len(message_blocks)) * self.block_len + answer > self.max_prompt_len


def best_prefix_hit_rate(workload: Workload, prompt_seed: int, vocab_size: int, block_size: int) -> float:
    """The share of prompt tokens a prefix cache could skip if every request went where its
    longest cached prefix lives and nothing were ever evicted: for each request, its leading
    cacheable blocks (of `block_size` tokens) that any earlier request's prompt already had,
    over all prompt tokens. Every full block of an earlier prompt counts as cached, the one
    holding its last token included (the engine files it once computed), while a request's own
    last token is always computed. The ceiling a prefix-aware router is measured against;
    prompts are the ones a run with `prompt_seed` sends."""
    seen: set[int] = set()
    hit = total = 0
    for index, request in enumerate(workload.requests):
        prompt = request_prompt(prompt_seed, index, request, vocab_size)
        hashes = cacheable_block_hashes(prompt, block_size)
        matched = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        hit += matched * block_size
        total += request.prompt_len
        seen.update(block_hashes(prompt, block_size))
    return hit / total if total else 0.0
