"""The serving loop of one replica: the engine stepping in a background thread while
requests arrive and tokens stream out on an asyncio event loop. No Ray here; `actor.py`
wraps this in a Ray actor.

The engine is not thread-safe, so it is only touched between steps: submissions and aborts
wait in an inbox that the loop applies before each step, and each step runs in one worker
thread (torch releases the GIL inside its kernels, so the event loop keeps streaming).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from protocol.messages import LoadReport
from replica.config import EngineConfig
from replica.engine import Engine, RequestOutput, StepRecord
from replica.request import SamplingParams


class ReplicaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    fake_step_seconds: float | None = Field(
        None, gt=0, description="serve the flat-cost fake model (every step this long) instead of a real one"
    )


def build_engine(config: ReplicaConfig) -> Engine:
    if config.fake_step_seconds is None:
        return Engine(config.engine)
    from protocol.clock import WallClock
    from replica.fake_model import FlatCostModel, ScriptedFakeRunner

    clock = WallClock()
    return Engine(config.engine, ScriptedFakeRunner(clock, FlatCostModel(config.fake_step_seconds)), clock)


# Seconds between load reports while requests run; an idle replica reports at once, so the
# router learns of freed slots without delay.
REPORT_INTERVAL = 0.02


def load_report(engine: Engine, replica_id: str, queued: int = 0) -> LoadReport:
    """The engine's load at a step boundary; `queued` counts submissions not yet in its queue."""
    s = engine.scheduler
    return LoadReport(
        replica_id,
        len(s.waiting) + queued,
        len(s.running),
        s.slots.num_free_slots,
        s.slots.num_slots,
        s.slots.free_kv_tokens,
        engine.clock.now(),
    )


def report_due(load: LoadReport, since_last: float) -> bool:
    """Whether a replica sends this report to the router (the cluster and the simulator
    throttle alike): always when idle, else at most every REPORT_INTERVAL."""
    return not load.running or since_last >= REPORT_INTERVAL


@dataclass
class _Submission:
    prompt: str | list[int]
    params: SamplingParams | dict | None
    request_id: str
    arrival_time: float | None
    accepted: asyncio.Future
    sink: Callable[[RequestOutput], None]


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[StepRecord], None] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
        on_load: Callable[[LoadReport], None] | None = None,
        replica_id: str = "replica",
    ):
        self.engine = engine
        self.replica_id = replica_id
        self._on_step = on_step or (lambda record: None)
        self._on_finish = on_finish or (lambda output: None)
        self._on_load = on_load or (lambda load: None)
        self._inbox: list[_Submission | str] = []  # submissions, or request ids to abort
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        self._arrivals_done = False

    def set_arrivals_done(self, done: bool) -> None:
        """Whether more requests may come before one of the running ones ends. Only the driver
        knows; with none coming, a static batch need not wait to be full."""
        self._arrivals_done = done
        self._wake.set()

    async def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | dict | None,
        request_id: str,
        arrival_time: float | None,
        sink: Callable[[RequestOutput], None],
    ) -> None:
        """Queue a request; once accepted, each of its outputs is passed to `sink` on the event
        loop as steps make them, the last with finished=True. Raises InvalidRequestError when
        the engine refuses it."""
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._run())
        sub = _Submission(prompt, params, request_id, arrival_time, loop.create_future(), sink)
        self._inbox.append(sub)
        self._wake.set()
        await sub.accepted

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
        self._inbox.append(request_id)
        self._wake.set()

    def load(self) -> LoadReport:
        return load_report(self.engine, self.replica_id, sum(isinstance(i, _Submission) for i in self._inbox))

    def _apply_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, str):
                if (final := self.engine.abort(item)) is not None:
                    self._deliver(final)
                continue
            try:
                self.engine.add_request(item.prompt, item.params, item.request_id, item.arrival_time)
            except Exception as err:  # noqa: BLE001 - the caller gets the error; the loop goes on
                item.accepted.set_exception(err)
                continue
            self._sinks[item.request_id] = item.sink
            item.accepted.set_result(None)

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is not None:
            sink(output)
        if output.finished:
            self._sinks.pop(output.request_id, None)
            self._on_finish(output)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_inbox()
            if not self.engine.has_unfinished:
                self._on_load(self.load())
                self._wake.clear()
                await self._wake.wait()
                continue
            self.engine.scheduler.arrivals_done = self._arrivals_done
            result = await loop.run_in_executor(self._executor, self.engine.step)
            for output in result.outputs:
                self._deliver(output)
            if result.record is not None:
                self._on_step(result.record)
                self._on_load(self.load())
                continue
            # Nothing could run (a static batch filling up): sleep until the policy's timer
            # or until something new arrives (a submission made during the step counts).
            wake = self.engine.scheduler.wake_time()
            timeout = None if wake is None else max(0.0, wake - self.engine.clock.now())
            self._wake.clear()
            if self._inbox:
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
