"""The continuous-batching scheduler every batching policy is built on.

One step: running requests keep their rows (decodes first, then unfinished prefills), then
waiting requests are admitted into free slots, all under one token budget shared by decodes
and prefill chunks (vLLM v1's `max_num_batched_tokens`). The policies in `policies.py` differ
only in the small decisions below that are marked as hooks. Pure Python: no torch, no Ray, an
injected clock, so the simulator runs these same objects on virtual time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol import defaults
from protocol.clock import Clock
from replica.errors import InvariantViolation
from replica.scheduling.block_manager import PagedSlotTable
from replica.scheduling.request import FinishReason, Request, RequestStatus
from replica.scheduling.slot_table import SlotTable, TokenSlotTable


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_slots: int = Field(
        defaults.NUM_SLOTS, gt=0, description="rows of the K/V cache = most requests running at once"
    )
    max_seq_len: int = Field(defaults.MAX_SEQ_LEN, gt=1, description="K/V tokens one slot holds")
    kv_budget_tokens: int | None = Field(
        None, gt=0, description="K/V tokens for all slots together (default: all full)"
    )
    token_budget: int = Field(
        defaults.TOKEN_BUDGET, gt=0, description="`chunked`: tokens per step, decodes first, then prefill chunks"
    )
    max_wait: float = Field(
        0.5, ge=0.0, description="`dynamic`: seconds the oldest waiting request may wait for a full batch"
    )
    kv_cache: Literal["slot", "paged"] = Field(
        "slot", description='"slot": each request reserves a max_seq_len row; "paged": blocks taken as it grows'
    )
    block_size: int = Field(defaults.BLOCK_SIZE, gt=0, description="`paged`: K/V tokens per block")
    prefix_caching: bool = Field(False, description="`paged`: requests share the blocks of identical prompt prefixes")

    @property
    def num_blocks(self) -> int:
        """`paged`: the K/V budget in whole blocks."""
        return (self.kv_budget_tokens or self.num_slots * self.max_seq_len) // self.block_size

    @model_validator(mode="after")
    def _paged_options(self) -> SchedulerConfig:
        if self.prefix_caching and self.kv_cache != "paged":
            raise ValueError("prefix_caching shares blocks, so it needs kv_cache='paged'")
        if self.kv_cache == "paged" and self.num_blocks == 0:
            raise ValueError(f"the K/V budget holds no whole block of block_size={self.block_size} tokens")
        return self


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request` at positions [start, start + num_tokens) run this step."""

    request: Request
    start: int
    num_tokens: int
    is_decode: bool
    # The chunk reaches the request's last token, so its logits give the next token: set when the
    # chunk is planned (the request's tokens grow only once the step has run), read per row by
    # the runner and the engine.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Finished requests a static batch still holds: their rows are computed and thrown away.
    held_rows: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    # Sums over lists, not generators: a generator is resumed once per row, every step.
    @property
    def num_decode_tokens(self) -> int:
        return sum([c.num_tokens for c in self.chunks if c.is_decode])

    @property
    def num_prefill_tokens(self) -> int:
        return sum([c.num_tokens for c in self.chunks if not c.is_decode])

    @property
    def context_tokens(self) -> int:
        """Keys the step attends, summed over its rows: a row at position p sees p + 1 keys, so
        a chunk of n tokens from position s adds n*s + n(n+1)/2, and a padding row of a static
        batch its whole context. The attention work, which grows with context unlike the
        weight reads; a cost model's feature."""
        return sum([c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2 for c in self.chunks]) + sum(
            [r.num_computed_tokens for r in self.held_rows]
        )


class Scheduler:
    """Continuous batching with decodes and whole prompts in the same step (the `mixed` policy)."""

    name = "mixed"
    # Static batching keeps a finished request's row (and slot) until its whole batch is done.
    holds_finished_rows = False
    # Whether the policy overrides `_token_budget` (a token_budget sweep means nothing otherwise).
    reads_token_budget = False

    def __init__(self, config: SchedulerConfig, clock: Clock):
        self.config = config
        self.clock = clock
        if config.kv_cache == "paged":
            self.slots: SlotTable = PagedSlotTable(
                config.num_slots, config.max_seq_len, config.num_blocks, config.block_size, config.prefix_caching
            )
        else:
            self.slots = TokenSlotTable(config.num_slots, config.max_seq_len, config.kv_budget_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the youngest
        self.held: list[Request] = []
        self._arrivals_done = False
        self.num_preemptions = 0
        self.num_prefix_cached_tokens = 0  # tokens admission skipped: their K/V were in the prefix cache

    # ---- hooks the policies override -------------------------------------------------
    def _admission_open(self, now: float) -> bool:
        """May waiting requests take free slots now?"""
        return True

    def _token_budget(self) -> float:
        """Tokens one step may run, decodes and prefill chunks together."""
        return math.inf

    def _compose(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Which of the planned rows run together in this step."""
        return chunks

    def _admission_order(self) -> Iterable[Request]:
        return list(self.waiting)

    def wake_time(self) -> float | None:
        """When admission may open by itself with nothing else happening (None: not by time)."""
        return None

    # ---- the queue -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue behind every waiting request as urgent or more (lower priority first, FCFS
        within a priority)."""
        request.status = RequestStatus.WAITING
        self._queue(request, at_front_of_band=False)

    def _queue(self, request: Request, at_front_of_band: bool) -> None:
        waiting, priority = self.waiting, request.priority
        if not waiting or (waiting[-1].priority <= priority and not at_front_of_band):
            waiting.append(request)  # the one-priority case, whatever the traffic's size
            return
        for i, other in enumerate(waiting):
            if other.priority > priority or (at_front_of_band and other.priority == priority):
                waiting.insert(i, request)
                return
        waiting.append(request)

    @property
    def arrivals_done(self) -> bool:
        """Whether no more requests will come before a running one ends (a static batch then
        need not wait to be full). Only a replayer knows: the driver, the simulator."""
        return self._arrivals_done

    def set_arrivals_done(self, done: bool) -> None:
        self._arrivals_done = done

    def close_arrivals(self) -> None:
        """No more requests will come."""
        self.set_arrivals_done(True)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def live_requests(self) -> list[Request]:
        """Every request waiting or running, for a load report's work counts."""
        return [*self.waiting, *self.running]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._token_budget()
        running = [(r, r.is_decoding) for r in self.running]
        for request, is_decode in [x for x in running if x[1]] + [x for x in running if not x[1]]:  # decodes first
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num = int(min(request.num_pending_tokens, budget))
            if num <= 0:
                break
            start = request.num_computed_tokens
            if self._reserve(request, start + num, out):
                out.chunks.append(ScheduledChunk(request, start, num, is_decode))
                budget -= num
        if self.waiting and self._admission_open(self.clock.now()):
            self._preempt_for_priority(out)
            for request in self._admission_order():
                hit = self.slots.cached_prefix_tokens(request)  # prefix caching: K/V already computed
                cached = max(hit, request.num_kv_in)  # or handed over with it, written on admission
                num = int(min(request.num_pending_tokens - cached, budget))
                if num <= 0 or not self.slots.can_admit(request, cached + num):
                    break
                self.waiting.remove(request)
                self.slots.admit(request, cached + num)
                request.num_computed_tokens = cached
                self.num_prefix_cached_tokens += hit
                if request.num_cached_prompt_tokens is None:
                    request.num_cached_prompt_tokens = hit
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.chunks.append(ScheduledChunk(request, cached, num, is_decode=request.is_decoding))
                budget -= num
        out.chunks = self._compose(out.chunks)
        out.held_rows = list(self.held) if out.chunks else []
        return out

    def _victim(self) -> Request:
        """The running request to preempt first: the least urgent, the youngest among those
        (`max` keeps the first of equals, and `running` is in admission order)."""
        return max(reversed(self.running), key=attrgetter("priority"))

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """The most urgent waiting request that cannot start for want of a slot or K/V takes the
        place of running requests less urgent than it (vLLM's priority scheduling): rows this
        step has not planned yet, so the step's plan holds only requests that keep their place."""
        head = self.waiting[0]
        while self.running:
            victim = self._victim()  # asked first: the prefix lookup below is the dearer question
            if victim.priority <= head.priority or self.slots.can_admit(
                head, self.slots.cached_prefix_tokens(head) + 1
            ):
                return
            self._preempt(victim)
            out.preempted.append(victim)
            out.chunks = [c for c in out.chunks if c.request is not victim]

    def _reserve(self, request: Request, total: int, out: SchedulerOutput) -> bool:
        """Reserve K/V for `request`, preempting running requests (the least urgent, the
        youngest first) while it does not fit. False when `request` itself had to go."""
        while not self.slots.reserve(request, total):
            victim = self._victim()
            self._preempt(victim)
            out.preempted.append(victim)
            out.chunks = [c for c in out.chunks if c.request is not victim]
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop its K/V and requeue it at the front; it later re-prefills
        prompt + the tokens it has already emitted, and only then samples a new one."""
        self.running.remove(request)
        self.slots.release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(request, at_front_of_band=True)
        self._release_held_if_drained()

    def advance(self, out: SchedulerOutput) -> None:
        """The step ran: each chunk's tokens now have K/V in the cache."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (any state but finished) and free or hold its slot."""
        if request.is_finished:
            raise InvariantViolation(f"{request.request_id} finished twice ({request.finish_reason}, then {reason})")
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            if self.holds_finished_rows:
                self.held.append(request)
            else:
                self.slots.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._release_held_if_drained()

    def _release_held_if_drained(self) -> None:
        """A static batch's held rows go when its last running request does (by finishing or
        by being preempted)."""
        if not self.running:
            for held in self.held:
                self.slots.release(held)
            self.held.clear()

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the queues and the slot table disagree."""
        self.slots.check_invariants()
        ids = [r.request_id for r in (*self.waiting, *self.running, *self.held)]
        if len(ids) != len(set(ids)):
            raise InvariantViolation(f"a request is in two queues: {sorted(ids)}")
        for request in self.waiting:
            if request.status is not RequestStatus.WAITING or request.slot is not None:
                raise InvariantViolation(f"waiting {request.request_id} is {request.status} with slot {request.slot}")
        for request in self.running:
            if request.status is not RequestStatus.RUNNING or self.slots.owner(request.slot) is not request:
                raise InvariantViolation(f"running {request.request_id} does not own slot {request.slot}")
            if not 0 <= request.num_computed_tokens <= request.num_tokens:
                raise InvariantViolation(
                    f"{request.request_id} computed {request.num_computed_tokens} of {request.num_tokens}"
                )
        for request in self.held:
            if not request.is_finished or self.slots.owner(request.slot) is not request:
                raise InvariantViolation(f"held {request.request_id} is not a finished slot owner")
        if self.slots.num_used_slots != len(self.running) + len(self.held):
            raise InvariantViolation(
                f"{self.slots.num_used_slots} slots used but {len(self.running)} running + {len(self.held)} held"
            )
