# Over 400 lines: every call clients, the router and the store make on a replica lands here, each thin.
"""The Ray actor around one replica: a thin shell over `AsyncEngine`.

It streams tokens straight to each client (one Ray streaming generator per client, one message
per step), tells the router its load and each completion through the handle it is given, and
pushes step samples to the store in bounded batches: it knows both as handles only (`replica` imports neither).

Client streams are bounded, because Ray runs at most 1,000 calls of an async actor at once and
each open stream holds one: at most `max_subscribers` streams are open (a new one first ends
the stream idle longest, and is refused with OverloadedError if every one has requests in
flight), a stream with nothing in flight ends after `subscriber_idle_timeout`, and a client
that stops reading (its outbox past MAX_OUTBOX step messages) has its requests aborted. A
client whose stream ended simply opens a new one when it next submits.

Roles (prefill/decode disaggregation, `ReplicaConfig.role`): a prefill replica ends each request once
its first token is out and keeps its `Handover` (as a drained one keeps its decoding requests')
until the replica the client moves it to takes it (`take_handover`, called by that replica's
`submit`, which times the fetch and falls back to computing the K/V from the tokens carried).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import ray
from ray.actor import ActorHandle

from protocol.backlog import StoreBacklog
from protocol.errors import OverloadedError, SlotServeError
from protocol.finish import NATURAL_ENDINGS
from protocol.handover import Handover, KvFetch
from protocol.messages import Completion, HealthReport, LoadReport, StreamEvent
from protocol.records import StepRecord
from protocol.replicas import ReplicaInfo, Resume, Submission
from protocol.telemetry_hooks import ReplicaTelemetry
from replica.engine import RequestOutput
from replica.errors import InvalidRequestError
from replica.scheduling.kv_events import with_kv_events
from replica.scheduling.request import SamplingParams, validate_prompt, validate_request_id
from replica.serving.loop import DRAIN_HANDOVER_WAIT, AsyncEngine, ReplicaConfig, build_engine, report_due

STEP_BATCH = 64  # step samples per store write
MAX_OUTBOX = 4096  # step messages waiting for a client that does not read; past it its requests are aborted
SWEEP_INTERVAL = 5.0  # seconds between checks for idle client streams
FETCH_TIMEOUT = 30.0  # seconds a decode replica waits for a hand-over's K/V before computing them


@dataclass
class _Subscriber:
    """One client's stream: step messages not yet sent, the requests of its in flight here,
    and which stream is current (a client that reconnects supersedes its old stream, which
    then ends; the messages wait in the outbox meanwhile)."""

    outbox: deque = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    requests: set[str] = field(default_factory=set)
    stream: int = 0  # generation of the current stream; 0: none open
    last_active: float = field(default_factory=time.monotonic)


@ray.remote
class ReplicaActor:
    def __init__(self, replica_id: str, config: dict[str, Any], telemetry: Any = None):
        self.replica_id = replica_id
        self.config = ReplicaConfig.model_validate(config)
        self.serving = AsyncEngine(
            build_engine(self.config),
            self._on_step,
            self._on_finish,
            self._on_load,
            replica_id=replica_id,
            max_queue=self.config.max_queue,
            stall_timeout=self.config.stall_timeout,
            hand_over=self.config.role == "prefill",
            handover_ttl=self.config.handover_ttl,
        )
        # live metrics: `telemetry(replica_id, engine)` builds the exporter it is given (cluster.prometheus_exporters)
        self.telemetry = telemetry(replica_id, self.serving.engine) if telemetry else ReplicaTelemetry()
        self.router = None
        self.store = None
        self.run_id: int | None = None
        self._steps: StoreBacklog[StepRecord] = StoreBacklog(self._send_steps, STEP_BATCH)
        self._pending: dict[str, list[StreamEvent]] = {}  # this step's events, per subscriber
        self._completions: list[Completion] = []  # ended this loop turn, for the router in one call
        self._subscribers: dict[str, _Subscriber] = {}
        self._owner: dict[str, str] = {}  # request id -> subscriber, for requests held here
        self._streams = 0  # generations handed out
        self._sweeper: asyncio.Task | None = None
        self._last_report = 0.0

    def attach(
        self, router: ActorHandle | None = None, store: ActorHandle | None = None, run_id: int | None = None
    ) -> None:
        """Given after creation, since the router is made from the replicas' handles (and
        again by the router when Ray has restarted this replica). The first load report goes
        out now, so the router knows this replica's free slots."""
        self.router, self.store = router, store
        if run_id is not None:
            self.run_id = run_id
        self._last_report = 0.0
        self._on_load(self.serving.load())

    def info(self) -> ReplicaInfo:
        engine = self.serving.engine
        return ReplicaInfo(
            replica_id=self.replica_id,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            policy=engine.config.policy,
            model=engine.config.model,
            num_slots=engine.config.num_slots,
            block_size=engine.config.block_size,
            vocab_size=engine.runner.vocab_size,
            max_request_tokens=engine.scheduler.slots.max_request_tokens,
            fake=self.config.fake,
            fake_step_seconds=self.config.fake_step_seconds,
            config=self.config.model_dump(),
            load=self.serving.load(),
            health=self.health(),
            peak_queued=self.serving.peak_queued,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            rejected=self.serving.rejected,
            steps_waiting=self._steps.waiting,
            steps_dropped=self._steps.dropped,
            steps_failed=self._steps.failed,
            telemetry=self.telemetry.snapshot(),
        )

    def health(self) -> HealthReport:
        subscribers = sum(s.stream > 0 for s in self._subscribers.values())
        return self.serving.health(subscribers=subscribers, attached=self.router is not None)

    async def drain(self, timeout: float, move_kv: bool = True) -> dict[str, int]:
        """`AsyncEngine.drain`; with `move_kv`, wait until the hand-overs kept here are taken or
        expired (DRAIN_HANDOVER_WAIT at most); flush step samples. The caller stops us then."""
        counts = await self.serving.drain(timeout, move_kv)
        if move_kv:  # a fetch after the wait finds this replica gone: its K/V are computed again
            await self.serving.handovers_taken(DRAIN_HANDOVER_WAIT)
        await asyncio.sleep(0.05)  # let the last step messages go out before the caller stops us
        await self.flush()
        return counts

    async def submit(
        self,
        subscriber: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str,
        arrival_time: float | None = None,
        resume: Resume | None = None,
        handover_from: ActorHandle | None = None,
    ) -> KvFetch | None:
        """Queue a request whose events go to `subscriber`'s stream (see `events`); `resume`
        continues one another replica started. A refused request raises its typed error here
        (InvalidRequestError, OverloadedError, DrainingError), and the router is told it is done.
        `handover_from`: the replica that handed it over, which holds its K/V: they are fetched
        from it (`take_handover`) and written here, and what that came to is returned; a fetch
        that fails (the sender gone, the hand-over expired or not matching `resume`) leaves the
        request to compute them again from `resume`, so none is lost."""
        _check_arguments(subscriber, prompt, request_id, arrival_time)
        handover, fetch = None, None
        if handover_from is not None and resume is not None:
            handover, fetch = await self._fetch(handover_from, request_id, resume)
        if request_id in self._owner:  # refused without telling the router: the one running is its
            raise InvalidRequestError("request_id", f"{request_id!r} is already running here")
        sub = self._subscribers.setdefault(subscriber, _Subscriber())
        sub.requests.add(request_id)
        sub.last_active = time.monotonic()
        self._owner[request_id] = subscriber
        try:
            kv_taken = await self.serving.submit(
                prompt, params, request_id, arrival_time, partial(self._collect, subscriber), resume, handover
            )
            self.telemetry.on_submit(request_id)
        except BaseException as err:
            sub.requests.discard(request_id)
            self._owner.pop(request_id, None)
            if isinstance(err, SlotServeError):
                self.telemetry.on_reject(request_id)
            if isinstance(err, SlotServeError):
                self._tell_completed(Completion(request_id, self.replica_id))
            raise
        if handover is not None and not kv_taken:
            fetch = KvFetch(0, fetch.seconds, self.serving.engine.kv_transfer.unusable(handover))
        if fetch is not None:
            self.telemetry.on_handover(fetch)
        return fetch

    async def submit_many(self, subscriber: str, submissions: list[Submission]) -> list[KvFetch | BaseException | None]:
        """`submit` for each of `submissions`, in one call; each gets its own answer (what its
        `submit` returned, or the error that refused it), so one bad request never fails the
        others of its burst."""
        answers = await asyncio.gather(
            *[
                self.submit(subscriber, s.prompt, s.params, s.request_id, s.arrival_time, s.resume, s.handover_from)
                for s in submissions
            ],
            return_exceptions=True,
        )
        return list(answers)

    async def _fetch(self, sender: ActorHandle, request_id: str, resume: Resume) -> tuple[Handover | None, KvFetch]:
        """The hand-over from `sender` (a direct actor call), timed; None with why when there is
        none to use: the tokens it carries must be those the client delivered (`resume`)."""
        start = time.perf_counter()
        try:
            handover = await asyncio.wait_for(sender.take_handover.remote(request_id), FETCH_TIMEOUT)
        except Exception as err:  # noqa: BLE001 - the sender is gone or did not answer: compute them here
            return None, KvFetch(0, time.perf_counter() - start, f"fetch failed: {type(err).__name__}")
        seconds = time.perf_counter() - start
        if handover is None:
            return None, KvFetch(0, seconds, "no hand-over there (expired, or its replica restarted)")
        if handover.output_token_ids != resume.token_ids or handover.text != resume.text:
            return None, KvFetch(0, seconds, "the hand-over's tokens are not those delivered")
        return handover, KvFetch(handover.nbytes, seconds)

    def take_handover(self, request_id: str) -> Handover | None:
        """A request handed over here (prefill role, drain), for the replica that continues it:
        given once, then dropped here (None when expired or unknown)."""
        return self.serving.take_handover(request_id)

    async def events(self, subscriber: str) -> AsyncIterator[list[StreamEvent]]:
        """The subscriber's event stream: one message per step, holding every token that step
        made for any of the subscriber's requests. Batching per step, not per token, keeps the
        cost of streaming through Ray flat as batches grow (like vLLM's per-step outputs)."""
        if not isinstance(subscriber, str) or not subscriber:
            raise InvalidRequestError("subscriber", f"must be a non-empty string, got {subscriber!r:.80}")
        self._start_sweeper()
        sub = self._subscribers.get(subscriber)
        if sub is None or sub.stream == 0:
            self._make_room()
        sub = self._subscribers.setdefault(subscriber, _Subscriber())
        self._streams += 1
        generation = sub.stream = self._streams
        sub.wake.set()  # a superseded stream of this subscriber wakes and ends
        sub.last_active = time.monotonic()
        while sub.stream == generation:
            if sub.outbox:
                sub.last_active = time.monotonic()
                yield _coalesce(sub.outbox)
                continue
            sub.wake.clear()
            await sub.wake.wait()

    def close_events(self, subscriber: str) -> None:
        """The client is going away: abort its requests here and end its stream."""
        sub = self._subscribers.get(subscriber)
        if sub is None:
            return
        for request_id in list(sub.requests):
            self.serving.abort(request_id)
        self._end_stream(subscriber, sub)

    def _end_stream(self, subscriber: str, sub: _Subscriber) -> None:
        sub.stream = 0
        sub.wake.set()
        if not sub.requests:
            self._subscribers.pop(subscriber, None)

    def _make_room(self) -> None:
        """Before a new stream opens: if `max_subscribers` are open, end the one idle longest
        (nothing in flight); if every one has requests in flight, refuse the newcomer."""
        open_streams = [(s.last_active, name) for name, s in self._subscribers.items() if s.stream > 0]
        if len(open_streams) < self.config.max_subscribers:
            return
        idle = sorted((t, name) for t, name in open_streams if not self._subscribers[name].requests)
        if not idle:
            raise OverloadedError(
                self.replica_id,
                self.config.max_subscribers,
                self.serving.retry_after(1),
                "client streams, each with requests in flight",
            )
        name = idle[0][1]
        self._end_stream(name, self._subscribers[name])

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """End streams idle past `subscriber_idle_timeout` (a client that never closed them)."""
        while True:
            await asyncio.sleep(min(SWEEP_INTERVAL, self.config.subscriber_idle_timeout / 2))
            limit = time.monotonic() - self.config.subscriber_idle_timeout
            for name, sub in list(self._subscribers.items()):
                if not sub.requests and sub.last_active < limit:
                    self._end_stream(name, sub)

    def _collect(self, subscriber: str, out: RequestOutput) -> None:
        first = not self._pending  # the step's first output: its others follow in this loop iteration
        events = self._pending.setdefault(subscriber, [])
        handed_over = out.handover is not None
        if handed_over and (out.new_token_ids or out.new_text):  # its first token, then the hand-over
            events.append(StreamEvent(out.request_id, self.replica_id, out.new_token_ids, out.new_text, out.time))
            out = replace(out, new_token_ids=[], new_text="")
        events.append(
            StreamEvent(
                out.request_id,
                self.replica_id,
                out.new_token_ids,
                out.new_text,
                out.time,
                out.finished,
                out.finish_reason,
                out.error,
                handed_over=handed_over,
                cached_tokens=out.num_cached_prompt_tokens,
            )
        )
        if out.finished:
            self._owner.pop(out.request_id, None)
            if (sub := self._subscribers.get(subscriber)) is not None:
                sub.requests.discard(out.request_id)
        if first:  # send the step's outputs together
            asyncio.get_running_loop().call_soon(self._send_pending)

    def _send_pending(self) -> None:
        for subscriber, batch in self._pending.items():
            sub = self._subscribers.setdefault(subscriber, _Subscriber())
            sub.outbox.append(batch)
            sub.wake.set()
            if len(sub.outbox) > MAX_OUTBOX:  # nobody reads it: stop computing for it
                self.close_events(subscriber)
                sub.outbox.clear()
        self._pending = {}

    def abort(self, subscriber: str, request_id: str) -> bool:
        """Cancel one of `subscriber`'s requests (no other client's); returns whether it was there."""
        if self._owner.get(request_id) != subscriber:
            return False
        self.serving.abort(request_id)
        return True

    async def set_run(self, run_id: int | None) -> None:
        """Tag step samples from now on with this run (flushing the previous run's); its
        requests are still to come. The run starts with an empty prefix cache, so runs of the
        same traffic do not inherit each other's hits."""
        await self.flush()
        self.serving.reset_prefix_cache()
        self.run_id = run_id
        self.telemetry.set_run(run_id)
        self.serving.set_arrivals_done(False)

    def request_kv_snapshot(self) -> None:
        """The router lost track of this replica's prefix cache (a gap in its K/V events'
        numbers): the next load report sends it whole."""
        self.serving.request_kv_snapshot()

    def set_arrivals_done(self, done: bool) -> None:
        """The driver says whether more requests may come before a running one ends."""
        self.serving.set_arrivals_done(done)

    async def flush(self) -> None:
        """Push buffered step samples to the store and wait until they are written."""
        while self.store is not None and (write := self._steps.pump(force=True)) is not None:
            with contextlib.suppress(Exception):  # a refused write is counted by the backlog
                await asyncio.wrap_future(write)

    def _send_steps(self, records: list[StepRecord]) -> Future:
        """One store write of step records (see protocol.backlog: at most one in flight)."""
        return self.store.add_step_records.remote(self.run_id, self.replica_id, self._num_slots, records).future()

    # ---- callbacks from the serving loop --------------------------------------------------
    def _on_step(self, record: StepRecord) -> None:
        self.telemetry.on_step(record)
        if self.run_id is None:
            return
        if self.store is not None:
            self._steps.add([record])  # never waits on the store (protocol.backlog)

    def _on_finish(self, output: RequestOutput) -> None:
        self.telemetry.on_finish(output)
        if self.router is not None:
            # Only a natural end says how long the output was; a cut-short one would teach a
            # length estimate a length the request never had.
            natural = output.finish_reason in NATURAL_ENDINGS
            output_len = output.num_output_tokens if natural else None
            self._tell_completed(Completion(output.request_id, self.replica_id, output_len))

    def _tell_completed(self, completion: Completion) -> None:
        """The router hears of every request that ended in one loop turn in one call: a Ray
        call costs far more than the router's bookkeeping of a completion."""
        if self.router is None:
            return
        if not self._completions:
            asyncio.get_running_loop().call_soon(self._send_completions)
        self._completions.append(completion)

    def _send_completions(self) -> None:
        completions, self._completions = self._completions, []
        if self.router is not None:
            self.router.complete_many.remote(completions)

    @property
    def _num_slots(self) -> int:
        return self.serving.engine.config.num_slots

    def _on_load(self, load: LoadReport) -> None:
        self.telemetry.on_load(load)
        now = time.monotonic()
        if self.router is None or not report_due(load, now - self._last_report):
            return
        self._last_report = now
        self.router.report.remote(with_kv_events(load, self.serving.engine))


def _coalesce(outbox: deque) -> list[StreamEvent]:
    """Every step message waiting for a client, as one: a client slower than the steps gets
    one Ray message per read, not one per step it missed, so streaming costs no more as the
    steps come faster (events keep their order, and each its own step's time)."""
    if len(outbox) == 1:
        return outbox.popleft()
    events = [event for step in outbox for event in step]
    outbox.clear()
    return events


def _check_arguments(subscriber: Any, prompt: Any, request_id: Any, arrival_time: Any) -> None:
    """What a caller that skipped the client's checks could send wrong (the engine checks the
    sampling parameters and the prompt against its vocabulary and limits)."""
    if not isinstance(subscriber, str) or not subscriber:
        raise InvalidRequestError("subscriber", f"must be a non-empty string, got {repr(subscriber)[:80]}")
    validate_request_id(request_id)
    validate_prompt(prompt)
    if arrival_time is not None and (
        not isinstance(arrival_time, (int, float)) or isinstance(arrival_time, bool) or not math.isfinite(arrival_time)
    ):
        raise InvalidRequestError("arrival_time", f"must be a finite number of seconds, got {repr(arrival_time)[:80]}")
