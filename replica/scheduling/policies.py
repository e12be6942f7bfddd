"""The batching policies compared by slotserve. Each is `Scheduler` with one or two hooks
overridden; everything else (queues, slots, budget, preemption) is shared, so the difference
between two runs is the policy and nothing else."""

from __future__ import annotations

from collections.abc import Iterable

from protocol.clock import Clock
from protocol.registry import Registry
from replica.scheduling.request import Request
from replica.scheduling.scheduler import ScheduledChunk, Scheduler, SchedulerConfig


class MixedScheduler(Scheduler):
    """Continuous batching; new prompts join the same step as the running decodes."""

    name = "mixed"


class ContinuousScheduler(Scheduler):
    """Continuous batching, prefill-first: a step with a new prompt runs only prefills, so
    running decodes stall for it (the ITL spike that chunked prefill removes)."""

    name = "continuous"

    def _compose(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        prefills = [c for c in chunks if not c.is_decode]
        return prefills or chunks


class ChunkedScheduler(Scheduler):
    """A per-step token budget, one token per running decode first, then prefill chunks;
    a prompt that does not fit continues next step."""

    name = "chunked"
    reads_token_budget = True

    def _token_budget(self) -> float:
        return self.config.token_budget


class StaticScheduler(Scheduler):
    """Static batching is continuous batching with admission closed until the running batch
    has drained and a full batch waits (or no more arrivals are coming). Finished requests
    keep their rows until the batch ends, like padded `generate()`."""

    name = "static"
    holds_finished_rows = True

    def _batch_drained(self) -> bool:
        return not self.running and not self.held

    def _admission_open(self, now: float) -> bool:
        full = len(self.waiting) >= self.config.num_slots
        return self._batch_drained() and (full or self.arrivals_done)


class DynamicScheduler(StaticScheduler):
    """Static batching that also starts a partial batch once the oldest waiting request has
    waited `max_wait` seconds."""

    name = "dynamic"

    def _admission_open(self, now: float) -> bool:
        timed_out = bool(self.waiting) and now - self.waiting[0].arrival_time >= self.config.max_wait
        return super()._admission_open(now) or (self._batch_drained() and timed_out)

    def wake_time(self) -> float | None:
        return self.waiting[0].arrival_time + self.config.max_wait if self.waiting else None


class BucketedScheduler(StaticScheduler):
    """Oracle: static batches of requests with similar true output lengths (shortest first),
    to show what length awareness alone buys. Needs `oracle_output_len` (else max_tokens)."""

    name = "bucketed"

    def _admission_order(self) -> Iterable[Request]:
        return sorted(self.waiting, key=lambda r: r.oracle_output_len or r.params.max_tokens)


POLICIES: Registry[type[Scheduler]] = Registry.of_named(
    "batching policy",
    (StaticScheduler, DynamicScheduler, ContinuousScheduler, MixedScheduler, ChunkedScheduler, BucketedScheduler),
)


def make_scheduler(policy: str, config: SchedulerConfig, clock: Clock) -> Scheduler:
    return POLICIES[policy](config, clock)
