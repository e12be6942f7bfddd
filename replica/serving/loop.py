# Over 400 lines: the inbox, the step thread, draining, health and K/V-snapshot requests act on one state.
"""The serving loop of one replica: the engine stepping in a background thread while
requests arrive and tokens stream out on an asyncio event loop. No Ray here; `actor.py`
wraps this in a Ray actor.

The engine is not thread-safe, so it is only touched between steps: submissions and aborts
wait in an inbox that the loop applies before each step, and each step runs in one worker
thread (torch releases the GIL inside its kernels, so the event loop keeps streaming).

What keeps a replica serving when things go wrong: the waiting queue is bounded (past
`max_queue` a submission gets an OverloadedError at once, with a retry-after hint from the
recent completion rate); `health()` reports a loop that raised or a step that has run longer
than `stall_timeout`; a loop that raised hands every request it held back for migration
instead of leaving them hanging (their K/V are not trusted: the next replica computes them
again); and `drain()` stops admissions, lets what it holds finish within a timeout and hands
the rest back for migration (finish reason `migrate`), each decoding one with its K/V, kept
here for the next replica to fetch, as a prefill replica keeps its hand-overs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.errors import DrainingError, OverloadedError
from protocol.finish import FinishReason
from protocol.handover import Handover
from protocol.messages import HealthReport, LoadReport
from protocol.rates import CompletionRate
from protocol.records import StepRecord
from protocol.replicas import Resume
from replica.config import EngineConfig
from replica.engine import Engine, RequestOutput
from replica.errors import InvalidRequestError
from replica.model.fake import FlatCostModel, LinearCostModel, ScriptedFakeRunner
from replica.scheduling.handover import can_export
from replica.scheduling.request import SamplingParams


class ReplicaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    fake_step_seconds: float | None = Field(
        None, gt=0, description="serve the flat-cost fake model (every step this long) instead of a real one"
    )
    fake_cost: LinearCostModel | None = Field(
        None, description="serve the fake model with each step priced by its work (a fitted cost model) instead"
    )
    max_queue: int = Field(256, gt=0, description="requests waiting for a slot; past it a submission is refused")
    stall_timeout: float = Field(
        30.0, gt=0, description="seconds one step may run, with work waiting, before the replica reports unhealthy"
    )
    max_subscribers: int = Field(
        256, gt=0, description="client event streams held at once (Ray caps an actor at 1000 concurrent calls)"
    )
    subscriber_idle_timeout: float = Field(
        300.0, gt=0, description="seconds a client's event stream stays open with no request of its in flight"
    )
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed",
        description="prefill: compute each request's prompt and first token, then hand it over with its K/V; "
        "decode or mixed: serve requests to the end (prefill/decode disaggregation)",
    )
    handover_ttl: float = Field(
        30.0,
        gt=0,
        description="seconds a replica keeps a hand-over's K/V for the next replica to fetch: a prefill "
        "replica's, and a drained replica's decoding requests' (which keep it up that long, at most "
        "DRAIN_HANDOVER_WAIT)",
    )

    @model_validator(mode="after")
    def _one_fake_cost(self) -> ReplicaConfig:
        if self.fake_step_seconds is not None and self.fake_cost is not None:
            raise ValueError("give fake_step_seconds (a flat step) or fake_cost (a step priced by its work), not both")
        return self

    @property
    def fake(self) -> bool:
        """Whether this replica serves the fake model (no weights, step times paid on the wall clock)."""
        return self.fake_step_seconds is not None or self.fake_cost is not None


def build_engine(config: ReplicaConfig) -> Engine:
    if not config.fake:
        return Engine(config.engine)
    from protocol.clock import WallClock

    clock = WallClock()
    cost = config.fake_cost or FlatCostModel(config.fake_step_seconds)
    return Engine(config.engine, ScriptedFakeRunner(clock, cost), clock)


# Seconds between load reports while requests run; an idle replica reports at once, so the
# router learns of freed slots without delay.
REPORT_INTERVAL = 0.02
# Seconds a drained replica stays up at most for its hand-overs to be taken (fewer when
# `handover_ttl` expires them sooner), so whoever stops it knows how long a drain can take.
DRAIN_HANDOVER_WAIT = 60.0


def report_due(load: LoadReport, since_last: float) -> bool:
    """Whether a replica sends this report to the router (the cluster and the simulator
    throttle alike): always when idle, else at most every REPORT_INTERVAL."""
    return not load.running or since_last >= REPORT_INTERVAL


@dataclass
class Submission:
    """A request for the engine, applied between steps; `accepted` resolves once it is queued
    (or carries the engine's refusal), then `sink` gets each of its outputs."""

    prompt: str | list[int]
    params: SamplingParams | dict | None
    request_id: str
    arrival_time: float | None
    accepted: asyncio.Future
    sink: Callable[[RequestOutput], None]
    resume: Resume | None = None
    handover: Handover | None = None  # queued with its K/V (`Engine.import_request`)


@dataclass(frozen=True)
class Abort:
    """Cancel a request, applied between steps."""

    request_id: str


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[StepRecord], None] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
        on_load: Callable[[LoadReport], None] | None = None,
        replica_id: str = "replica",
        max_queue: int = 256,
        stall_timeout: float = 30.0,
        hand_over: bool = False,
        handover_ttl: float = 30.0,
    ):
        """`hand_over`: the prefill role: each request ends here once its first token is out,
        and its `Handover` waits `handover_ttl` seconds for `take_handover`."""
        self.engine = engine
        self.hand_over = hand_over
        self.handover_ttl = handover_ttl
        self._handovers: dict[str, tuple[Handover, float]] = {}  # request id -> hand-over, expiry (clock)
        self._handover_taken = asyncio.Event()  # set by each take, for a drain waiting on the rest
        self.replica_id = replica_id
        self.max_queue = max_queue
        self.stall_timeout = stall_timeout
        self._on_step = on_step or (lambda record: None)
        self._on_finish = on_finish or (lambda output: None)
        self._on_load = on_load or (lambda load: None)
        self._inbox: list[Submission | Abort] = []
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._wake = asyncio.Event()
        self._drain_deadline: float | None = None  # on the clock; the loop hands back what is left then
        self._drain_moves_kv = False  # and hands the decoding ones over with their K/V
        self._drained, self._handed_back, self._kv_moved = asyncio.Event(), 0, 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        self._arrivals_done = False
        self._reset_prefix_cache = False  # asked for; done between steps, on the loop's side
        self._kv_snapshot = False  # likewise: the next load report's K/V events a snapshot
        # Every time here is on the engine's clock, so tests drive a FakeClock instead of waiting.
        self.clock = engine.clock
        self._step_started: float | None = None  # start of the step running now
        self._last_step = self.clock.now()
        self.loop_error: str | None = None
        self.draining = False
        self.peak_queued = 0
        self.rejected = 0
        self._completions = CompletionRate()

    def set_arrivals_done(self, done: bool) -> None:
        """Whether more requests may come before one of the running ones ends. Only the driver
        knows; with none coming, a static batch need not wait to be full."""
        self._arrivals_done = done
        self._wake.set()

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes no request holds, before the next step (never
        during one: the step runs on another thread)."""
        self._reset_prefix_cache = True
        self._wake.set()

    def request_kv_snapshot(self) -> None:
        """Send the whole prefix cache on the next load report's K/V events (the router saw a
        gap in their numbers), set between steps: the step thread records the cache's changes."""
        self._kv_snapshot = True
        self._wake.set()

    async def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | dict | None,
        request_id: str,
        arrival_time: float | None,
        sink: Callable[[RequestOutput], None],
        resume: Resume | None = None,
        handover: Handover | None = None,
    ) -> bool:
        """Queue a request; once accepted, each of its outputs is passed to `sink` on the event
        loop as steps make them, the last with finished=True. Raises InvalidRequestError when
        the engine refuses it, OverloadedError when the waiting queue is full, DrainingError
        while draining. `resume`: the tokens another replica already delivered, prefilled with
        the prompt; generation continues after them. `handover`: those tokens with their K/V
        (the decode role); returns whether its K/V were taken in (False: they are computed
        again, as a resumed request's)."""
        if self.draining:
            raise DrainingError(self.replica_id)
        if self.loop_error is not None:
            raise DrainingError(self.replica_id, detail=f"its loop failed: {self.loop_error}")
        queued = self.queued
        if queued >= self.max_queue:
            self.rejected += 1
            raise OverloadedError(
                self.replica_id,
                self.max_queue,
                self.retry_after(queued - self.max_queue + 1),
                f"{queued} requests waiting for a slot",
            )
        if resume is not None:
            resume = _check_resume(resume, params, self.engine.runner.vocab_size)
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._run())
        sub = Submission(prompt, params, request_id, arrival_time, loop.create_future(), sink, resume, handover)
        self._inbox.append(sub)
        self.peak_queued = max(self.peak_queued, queued + 1)
        self._wake.set()
        return await sub.accepted

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | dict | None,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`submit` as an async iterator of this request's outputs."""
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await self.submit(prompt, params, request_id, arrival_time, outputs.put_nowait)
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:  # the consumer went away: stop computing for it
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.append(Abort(request_id))
        self._wake.set()

    @property
    def _submitted(self) -> int:  # submissions in the inbox, not yet in the engine's queue
        return sum(isinstance(i, Submission) for i in self._inbox)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot: in the engine's queue, or submitted and not yet in it."""
        return self.engine.num_waiting + self._submitted

    def retry_after(self, ahead: int) -> float:
        """Seconds until `ahead` more requests have finished here, at the recent rate."""
        return self._completions.retry_after(ahead)

    def load(self) -> LoadReport:
        return self.engine.load_report(self.replica_id, self._submitted)

    def health(self, subscribers: int = 0, attached: bool = False) -> HealthReport:
        """Unhealthy when the loop raised, or one step has run longer than `stall_timeout`;
        `subscribers` and `attached` are what only the actor around this loop knows."""
        now = self.clock.now()
        age = now - (self._step_started if self._step_started is not None else self._last_step)
        reason = None
        if self.loop_error is not None:
            reason = f"step loop failed: {self.loop_error}"
        elif self._step_started is not None and age > self.stall_timeout:
            reason = f"one step has run for {age:.1f} s (stall limit {self.stall_timeout:g} s)"
        return HealthReport(
            self.replica_id,
            reason is None,
            reason,
            age,
            self.loop_error,
            self.engine.num_running,
            self.queued,
            subscribers,
            self.draining,
            attached,
            now,
        )

    async def drain(self, timeout: float, move_kv: bool = True) -> dict[str, int]:
        """Admit nothing new, let every request held finish within `timeout` seconds, then hand
        the rest back (finish reason `migrate`) for their clients to continue elsewhere. With
        `move_kv` each decoding one goes as a hand-over with its K/V (`Engine.hand_over`), kept
        for `take_handover` as a prefill replica keeps its own (see `handovers_taken`), so the
        next replica computes neither its prompt nor its output again; one waiting or
        mid-prefill has no K/V to continue from and carries its tokens only. Returns how many
        finished, how many were handed back, and how many of those with their K/V."""
        self.draining = True
        held = len(self.engine.requests) + self._submitted
        if self._task is None or self._task.done():  # no loop runs: nothing is held, or it failed and handed back
            return {"finished": 0, "migrated": 0, "kv_moved": 0}
        self._drain_deadline, self._drain_moves_kv = self.clock.now() + timeout, move_kv
        self._wake.set()
        try:  # the loop hands back between steps, once all is done or its clock passes the deadline
            await asyncio.wait_for(self._drained.wait(), timeout)
        except TimeoutError:  # an idle loop sees the deadline only when woken
            self._wake.set()
            await self._drained.wait()
        return {"finished": held - self._handed_back, "migrated": self._handed_back, "kv_moved": self._kv_moved}

    async def handovers_taken(self, within: float) -> None:
        """Return once every hand-over kept here has been taken or has expired, or after
        `within` seconds: a drained replica stays up until then, since the replicas its
        requests moved to fetch their K/V from it (a dead one cannot be asked: they compute
        them again)."""
        deadline = self.clock.now() + within
        while True:
            self._expire_handovers()
            if not self._handovers or self.clock.now() >= deadline:
                return
            expiry = min(deadline, *(until for _, until in self._handovers.values()))
            self._handover_taken.clear()
            waits = {
                asyncio.ensure_future(self._handover_taken.wait()),
                asyncio.ensure_future(self.clock.asleep(expiry - self.clock.now())),
            }
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for waiting in pending:
                waiting.cancel()

    def _drain_due(self) -> bool:
        """Draining, not yet handed back, and nothing left or past the deadline."""
        if self._drain_deadline is None or self._drained.is_set():
            return False
        return not (self.engine.has_unfinished or self._inbox) or self.clock.now() >= self._drain_deadline

    def _hand_back(self, reason: str, move_kv: bool = False) -> None:
        """End every request held with finish reason `migrate`, to be resumed by its client on
        another replica: with `move_kv` a decoding one is handed over with its K/V, any other
        aborted here; submissions not yet applied are refused. Counted in `_handed_back` (and
        `_kv_moved`) for a drain waiting on `_drained`."""
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, Submission) and not item.accepted.done():
                item.accepted.set_exception(DrainingError(self.replica_id, detail=reason))
        count = kv_moved = 0
        for request_id, request in list(self.engine.requests.items()):
            try:
                if move_kv and can_export(request):
                    final = self.engine.hand_over(request_id)
                else:
                    final = self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - a broken engine must not keep the others from moving
                final = RequestOutput(request_id, [], "", True, FinishReason.ABORT, self.clock.now())
                self.engine.requests.pop(request_id, None)
            if final is not None:
                count += 1
                kv_moved += final.handover is not None
                self._deliver(replace(final, finish_reason=FinishReason.MIGRATE, error=f"{self.replica_id}: {reason}"))
        self._handed_back, self._kv_moved = count, kv_moved
        self._drained.set()

    def _apply_inbox(self) -> None:
        if self._reset_prefix_cache:
            self._reset_prefix_cache = False
            self.engine.reset_prefix_cache()
        if self._kv_snapshot:
            self._kv_snapshot = False
            self.engine.request_kv_snapshot()
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            match item:
                case Abort(request_id):
                    if (final := self.engine.abort(request_id)) is not None:
                        self._deliver(final)
                case Submission():
                    self._admit(item)

    def _admit(self, sub: Submission) -> None:
        try:
            if sub.handover is not None:
                kv_taken = self.engine.import_request(sub.handover)
            else:
                kv_taken = False
                self.engine.add_request(
                    sub.prompt,
                    sub.params,
                    sub.request_id,
                    sub.arrival_time,
                    resume=sub.resume,
                    hand_over=self.hand_over,
                )
        except Exception as err:  # noqa: BLE001 - the caller gets the error; the loop goes on
            sub.accepted.set_exception(err)
            return
        self._sinks[sub.request_id] = sub.sink
        sub.accepted.set_result(kv_taken)

    def take_handover(self, request_id: str) -> Handover | None:
        """The request's hand-over, given once to the replica that continues it (and dropped
        here); None when there is none, or it waited past `handover_ttl` (the receiver then
        computes the K/V again)."""
        self._expire_handovers()
        handover, _ = self._handovers.pop(request_id, (None, 0.0))
        self._handover_taken.set()
        return handover

    def _expire_handovers(self) -> None:
        now = self.clock.now()
        for request_id in [r for r, (_, expiry) in self._handovers.items() if expiry <= now]:
            del self._handovers[request_id]

    @property
    def handovers_waiting(self) -> int:
        return len(self._handovers)

    def _deliver(self, output: RequestOutput) -> None:
        if output.handover is not None:
            self._expire_handovers()
            self._handovers[output.request_id] = (output.handover, self.clock.now() + self.handover_ttl)
        sink = self._sinks.get(output.request_id)
        if sink is not None:
            sink(output)
        if output.finished:
            self._sinks.pop(output.request_id, None)
            self._completions.add(self.clock.now())
            self._on_finish(output)

    async def _run(self) -> None:
        """The loop, guarded: if it raises, the replica reports unhealthy and hands every
        request it holds back for migration, so none is left hanging."""
        try:
            await self._loop()
        except Exception as err:  # noqa: BLE001 - recorded for health(); the requests move on
            self.loop_error = f"{type(err).__name__}: {err}"
            self._step_started = None
            self._hand_back(f"step loop failed: {self.loop_error}")
            raise

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_inbox()
            if self._drain_due():
                self._hand_back("replica draining", self._drain_moves_kv)
            if not self.engine.has_unfinished:
                self._on_load(self.load())
                self._wake.clear()
                await self._wake.wait()
                continue
            self.engine.set_arrivals_done(self._arrivals_done)
            self._step_started = self.clock.now()
            result = await loop.run_in_executor(self._executor, self.engine.step)
            self._step_started, self._last_step = None, self.clock.now()
            for output in result.outputs:
                self._deliver(output)
            if result.record is not None:
                self._on_step(result.record)
                self._on_load(self.load())
                continue
            # Nothing could run (a static batch filling up): sleep until the policy's timer
            # (on the clock) or until something new arrives (a submission made during the step counts).
            wake = self.engine.wake_time()
            self._wake.clear()
            if self._inbox:
                continue
            waits = {asyncio.ensure_future(self._wake.wait())}
            if wake is not None:
                waits.add(asyncio.ensure_future(self.clock.asleep(wake - self.clock.now())))
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for waiting in pending:
                waiting.cancel()


def _check_resume(resume: object, params: SamplingParams | dict | None, vocab_size: int) -> Resume:
    """`resume` must be a Resume of token ids in the vocabulary and text, with fewer tokens than
    max_tokens (a request that had them all was finished)."""
    if not isinstance(resume, Resume):
        raise InvalidRequestError("resume", f"must be a Resume (token ids, text), got {type(resume).__name__}")
    if not isinstance(resume.token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in resume.token_ids
    ):
        raise InvalidRequestError("resume", f"token ids must be a list of integers in [0, {vocab_size})")
    if not isinstance(resume.text, str):
        raise InvalidRequestError("resume", f"text must be a string, got {type(resume.text).__name__}")
    max_tokens = SamplingParams.parse(params).max_tokens
    if len(resume.token_ids) >= max_tokens:
        raise InvalidRequestError("resume", f"{len(resume.token_ids)} tokens already reach max_tokens={max_tokens}")
    return resume
