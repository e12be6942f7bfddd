# Over 400 lines: the event loop, the replicas it steps, the router it feeds and what it records
# share one virtual clock.
"""A discrete-event simulator of the cluster: N replicas behind one router (or several), on virtual time.

Nothing here re-implements a policy. Each simulated replica is a real `replica.engine.Engine`
(so the real scheduler of its batching policy) whose runner pays a cost model's step time on
the replica's own `FakeClock`; routing is done by a real `router.router.Router`, fed the
same load reports the replicas send in the cluster (`replica.engine.Engine.load_report`, sent at
step boundaries and throttled by `report_due`) and told of every completion. So a policy
compared here is the same object that runs on the cluster.

Events, always the earliest first: a replica's current step ends, the next arrival, or an
idle replica's policy timer (`scheduler.wake_time()`). A step is computed when it starts (the
engine runs it at once on its FakeClock), but what it did (tokens, finishes, the load report)
reaches the router only when its end comes, so at an arrival the router sees what each
replica reported at its last step boundary, as in the cluster. A request routed to a busy
replica joins its queue and its next step, as the cluster's inbox does. At equal times, step
ends come first, then arrivals, then new steps, so one replica replays exactly what
`sim.replay.replay` does on a FakeClock.

What a cluster spends outside the steps, as its runs measured it
(`benchmarks/experiment_fidelity.py --file`): each replica's serving loop between two steps (token
events, the load report, the inbox; a fake step's sleep overshoot), `step_overhead` seconds
added after every step (its tokens out at its priced end), not scaled by `cost_scales`; and a
request's way to its replica (the route and submit calls) and its first token's way back,
`dispatch_delay` seconds, by which each request is routed and queued after its planned arrival;
and the client's own time per request, `submit_interval`: it sends each request in a Ray call of
its own, so requests due together leave it one after another, that far apart, and a replica idle
when a burst comes starts a step on the first that reaches it while the rest wait for its next
step (the capacity probes send every request at once: their first decode steps follow one
prefill of every request but the first). Without them a simulated cluster decodes faster than
the one it stands for, and a prefix hit's TTFT (one short step) misses a large part.

Routing split across `routers` routers, as Ray Serve's ingresses each route on their own: the
request of workload index i is routed by router i mod `routers`, which alone hears of its end,
while every router is given every replica's load reports and K/V events, the same objects. Each
router counts in flight only what it routed itself, and its policy's seed is the run's plus its
number (router 0 is the one router of `routers=1`). Decisions of all of them are kept, in time
order. `self.router` is router 0: the subclasses, which change the replicas behind the router
(`sim.autoscaling`) or route a request twice (`sim.disaggregation`), model one router only.

Flow control (`SimulationConfig.flow`, `protocol.flow`): each router places requests with
`Router.submit`; one it holds waits in the router, and when released it takes the router's
answer back to its client and its submission to the replica, another `dispatch_delay`; one
refused while held ends `rejected` with its reason, as one refused at once does.

Left out on purpose: a decision's own time (tens of microseconds against steps of milliseconds);
reports and completions reach the router at once.

What a run keeps grows with its requests, not with its replicas times its length: every
request's trace, decision and output tokens, but each decision's per-replica figures
(`Decision.scores` and `in_flight`) only until `max_decision_figures` of them are kept (later
decisions keep the chosen replica's alone, so a report then misses a replica that was never
chosen and ran no step). With `keep_records=False` (a day on hundreds of replicas, judged by its
traces alone) it keeps no step records, decisions or output tokens, only each replica's step
count and last step end; such a run cannot be written to the store.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from operator import attrgetter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, field_validator

from metrics.definitions import SLO, RequestTrace
from metrics.recording import record_run
from protocol.blocks import block_hashes
from protocol.clock import FakeClock
from protocol.errors import OverloadedError, SlotServeError
from protocol.flow import FlowConfig
from protocol.routing import RouteRequest
from replica.config import EngineConfig
from replica.engine import Engine, StepRecord, StepResult
from replica.errors import ConfigError, InvariantViolation
from replica.model.fake import CostModel, FlatCostModel, SimulationRunner
from replica.scheduling.kv_events import with_kv_events
from replica.scheduling.request import Request
from replica.serving.loop import report_due
from router.policies import DEFAULT_POLICY, ROUTING_POLICIES
from router.router import Decision, Router
from sim.replay import request_trace
from workloads.capacity import Capacity, probe_capacity
from workloads.schedule import ArrivalSchedule
from workloads.workload import Workload, WorkloadRequest, request_prompt

# Per-replica decision figures a run keeps: every shipped experiment's cells keep all of theirs,
# while a day on 256 replicas would keep 512 a request.
MAX_DECISION_FIGURES = 1_000_000


class SimulationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(2, gt=0, description="replicas behind the router")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="every replica's engine (model unused)")
    routing_policy: str = Field(DEFAULT_POLICY, description="router policy (see router.policies.ROUTING_POLICIES)")
    seed: int = Field(0, description="seeds the prompts (as the driver does) and the router's policy")
    vocab_size: int = Field(1000, gt=100, description="token ids of the simulated model")
    cost_scales: list[PositiveFloat] | None = Field(
        None,
        min_length=1,
        description="replicas of different speeds: replica i's step times x cost_scales[i] (repeating past the list)",
    )
    slo: SLO = Field(default_factory=SLO, description="the SLO the run is judged by; the router routes within its TPOT")
    step_overhead: NonNegativeFloat = Field(0.0, description="seconds a replica's loop adds to each step (not scaled)")
    dispatch_delay: NonNegativeFloat = Field(
        0.0, description="seconds from arrival to routed and queued: its way to a replica and its token's way back"
    )
    submit_interval: NonNegativeFloat = Field(
        0.0, description="the client's seconds per request: requests due together are routed this far apart"
    )
    routers: int = Field(
        1,
        gt=0,
        description="routers sharing the traffic (workload index mod routers), each told every replica's "
        "load reports and K/V events but only the ends of the requests it routed",
    )

    flow: FlowConfig | None = Field(
        None, description="flow control at every router (protocol.flow): priorities, tenants, holding while saturated"
    )

    @field_validator("routing_policy")
    @classmethod
    def _known_routing(cls, policy: str) -> str:
        return ROUTING_POLICIES.check(policy)


@dataclass(slots=True)  # one a request: a day of them is millions
class Arrival:
    """When a request was planned, what it asked for, and its index in the workload."""

    index: int
    spec: WorkloadRequest
    planned: float


@dataclass
class SimulationResult:
    config: SimulationConfig
    workload: Workload
    cost: CostModel
    traces: list[RequestTrace]  # in arrival order, each with its replica (None if refused)
    steps: dict[str, list[StepRecord]]  # per replica, in step order
    decisions: list[Decision]  # per-replica figures past the run's bound: the chosen replica's
    arrivals: dict[str, Arrival]  # by request id
    # Output tokens by request id, of finished requests only (a refused or unfinished one has
    # none): each is the request's own list, which nothing appends to once it has finished.
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # why a refused request was refused
    step_counts: dict[str, int] = field(default_factory=dict)  # per replica, records kept or not
    step_ends: dict[str, float] = field(default_factory=dict)  # each replica's last step end (if any)
    records_kept: bool = True  # False: steps, decisions and token_ids are empty (`keep_records`)


@dataclass
class _Replica:
    index: int
    replica_id: str
    clock: FakeClock
    engine: Engine
    busy: bool = False
    wake_at: float | None = None  # a pending policy-timer event
    last_report: float = -math.inf


class Simulator:
    """One run: `Simulator(workload, config, cost).run()`. Set `check_invariants` to check
    every replica's scheduler after every step (slower; tests do); `keep_records=False` and
    `max_decision_figures` bound what the run keeps (see the module docstring)."""

    _STEP_END, _WAKE = 0, 1  # at equal times, step ends before timers
    _ONE_ROUTER = False  # a subclass that models one router only refuses `routers` > 1

    def __init__(
        self,
        workload: Workload,
        config: SimulationConfig | None = None,
        cost: CostModel | None = None,
        check_invariants: bool = False,
        *,
        keep_records: bool = True,
        max_decision_figures: int = MAX_DECISION_FIGURES,
    ):
        if max_decision_figures < 0:
            raise ConfigError(f"max_decision_figures must be >= 0, got {max_decision_figures}")
        self.workload = workload
        self.config = config or SimulationConfig()
        self.cost = cost or FlatCostModel()
        self.check_invariants = check_invariants
        self.keep_records = keep_records
        self.max_decision_figures = max_decision_figures
        if self._ONE_ROUTER and self.config.routers > 1:
            raise ConfigError(f"{type(self).__name__} models one router, not routers={self.config.routers}")
        self.clock = FakeClock()  # the routers': global virtual time
        ids = [f"r{i}" for i in range(self.config.num_replicas)]
        self.routers = [self._make_router(ids, self.config.seed + k) for k in range(self.config.routers)]
        self.router = self.routers[0]
        self.replicas = [self._make_replica(i, rid) for i, rid in enumerate(ids)]
        self._by_id = {r.replica_id: r for r in self.replicas}
        self.schedule = ArrivalSchedule(workload)
        self._events: list[tuple[float, int, int, int, StepResult | None]] = []
        self._seq = itertools.count()  # keeps equal-time events in the order they were made
        self._dirty: set[int] = set()  # replicas that may be able to start a step now
        self._arrivals_done = False
        self._held: deque[tuple[int, WorkloadRequest, float]] = deque()  # due, not yet sent (`submit_interval`)
        self._send_free = -math.inf  # when the client can send its next request
        self._requests: dict[str, tuple[Request, str]] = {}  # until they end
        self._token_ids: dict[str, list[int]] = {}
        self._done: dict[str, RequestTrace] = {}
        self._arrivals: dict[str, Arrival] = {}
        self._errors: dict[str, str] = {}
        self._steps: dict[str, list[StepRecord]] = {}
        self._step_counts: dict[str, int] = {}
        self._step_ends: dict[str, float] = {}
        for rid in ids:
            self._track_steps(rid)
        self._decisions: list[Decision] = []
        self._decision_figures = 0
        self._flow_held: dict[str, tuple[list[int], float]] = {}  # held by flow control: prompt, sent
        self._released: deque[tuple[float, str, str]] = deque()  # released, on the way: due, request, replica

    def _track_steps(self, replica_id: str) -> None:
        """Start the step records of a replica (one attached later too)."""
        self._steps[replica_id] = []
        self._step_counts[replica_id] = 0

    def _make_router(self, ids: list[str], seed: int) -> Router:
        """A router over the replicas (`sim.disaggregation`: one over two pools), its policy
        seeded by `seed`, with no per-replica figures in decisions a run without records never keeps."""
        c = self.config
        return Router(
            ids,
            c.routing_policy,
            self.clock,
            seed=seed,
            tpot_slo=c.slo.tpot,
            decision_figures=self.keep_records,
            flow=c.flow,
        )

    def _router_of(self, request_id: str) -> Router:
        """The router that routes the request, and alone hears of its end: its workload index mod `routers`."""
        return self.routers[self._arrivals[request_id].index % len(self.routers)]

    def _hands_over(self, replica_id: str) -> bool:
        """Whether the replica only prefills what it is routed (`sim.disaggregation`: a prefill
        replica, whose requests end here handed over once their first token is out)."""
        return False

    def _make_replica(self, index: int, replica_id: str) -> _Replica:
        clock = FakeClock()
        scales = self.config.cost_scales
        cost = self.cost if scales is None else self.cost.scaled(scales[index % len(scales)])
        runner = SimulationRunner(clock, cost, vocab_size=self.config.vocab_size)
        return _Replica(index, replica_id, clock, Engine(self.config.engine, runner, clock))

    # ---- the event loop --------------------------------------------------------------------
    def run(self) -> SimulationResult:
        for replica in self.replicas:  # a replica reports once it is attached
            self._report(replica, force=True)
        while (now := self._next_time()) is not None:
            _advance(self.clock, now)
            while self._events and self._events[0][0] <= now:
                _, kind, _, index, result = heapq.heappop(self._events)
                if kind == self._STEP_END:
                    self._end_step(self.replicas[index], result, now)
                else:
                    self.replicas[index].wake_at = None
                    self._dirty.add(index)
            self._run_timers(now)
            self._admit_arrivals(now)
            if self.config.flow is not None:
                self._release_held(now)
            for index in sorted(self._dirty):
                if not self.replicas[index].busy:
                    self._start_step(index, now)
            self._dirty.clear()
        self._check_all_ended()
        return SimulationResult(
            self.config,
            self.workload,
            self.cost,
            traces=[self._done[rid] for rid in self._arrivals],
            steps=self._steps,
            decisions=self._decisions,
            arrivals=self._arrivals,
            token_ids=self._token_ids,
            errors=self._errors,
            step_counts=self._step_counts,
            step_ends=self._step_ends,
            records_kept=self.keep_records,
        )

    def _next_time(self) -> float | None:
        if self._held:  # due already: the next leaves once the client is free
            arrival = self._send_free
        else:  # plus the delay: the sum `due` tests, so none is left behind
            arrival = self.schedule.next_time()
            arrival = None if arrival is None else max(arrival + self.config.dispatch_delay, self._send_free)
        times = [
            t for t in (arrival, self._events[0][0] if self._events else None, *self._flow_times()) if t is not None
        ]
        if not times:
            return None  # a subclass's timers never keep a run going that has nothing left to do
        timer = self._next_timer()
        return max(min(times if timer is None else [*times, timer]), self.clock.now())

    def _flow_times(self) -> list[float | None]:
        """When flow control next has something to do: a released request reaches its replica,
        a held one's deadline comes."""
        if self.config.flow is None:
            return []
        return [self._released[0][0] if self._released else None, *(r.next_tick() for r in self.routers)]

    def _release_held(self, now: float) -> None:
        """Refuse the held requests whose deadline has come, start the released ones on their
        way (`dispatch_delay`), and queue those that arrived by `now`."""
        for router in self.routers:
            router.tick()
            for released in router.take_released():
                rid = released.request_id
                if released.decision is None:
                    self._refuse(rid, released.refusal, self._flow_held.pop(rid)[1], now, told=False)
                else:
                    self._released.append((now + self.config.dispatch_delay, rid, released.decision.replica_id))
        self._take_decisions()
        while self._released and self._released[0][0] <= now:
            _, rid, replica_id = self._released.popleft()
            prompt, sent = self._flow_held.pop(rid)
            self._queue(rid, replica_id, prompt, sent, now)

    def _next_timer(self) -> float | None:
        """When a subclass's own timer is next due (`sim.autoscaling`: a scaling decision, a
        replica's cold start ending); None: none."""
        return None

    def _run_timers(self, now: float) -> None:
        """A subclass's timers due at `now`, run after the step ends and before the arrivals of
        that time (so a replica ready at `now` can take them)."""

    def _admit_arrivals(self, now: float) -> None:
        """Send the requests due by `now`, one every `submit_interval` (all at once without one)."""
        self._held.extend(self.schedule.due(now, start=self.config.dispatch_delay))
        sent = False
        while self._held and self._send_free <= now:
            self._send(*self._held.popleft(), now)
            self._send_free, sent = now + self.config.submit_interval, True
        if sent:
            self._take_decisions()
        self._tell_arrivals_done()

    def _send(self, index: int, spec: WorkloadRequest, planned: float, now: float) -> None:
        """Route one request and queue it on its replica (or record its refusal). Its arrival is
        when the client sent it, as the cluster's driver stamps it: `planned`, or later by the
        time it waited for the client (`submit_interval`)."""
        rid = f"{self.workload.name}-{index}"
        self._arrivals[rid] = Arrival(index, spec, planned)
        delay = self.config.dispatch_delay
        sent = planned if now <= planned + delay else now - delay
        prompt = request_prompt(self.config.seed, index, spec, self.config.vocab_size)
        try:
            decision = self._router_of(rid).submit(self._route_request(rid, spec, prompt, sent))
        except SlotServeError as err:  # refused by the router, as the cluster's driver records it
            self._refuse(rid, err, sent, now)
            return
        if decision is None:  # held by flow control until the router releases it
            self._flow_held[rid] = (prompt, sent)
        else:
            self._queue(rid, decision.replica_id, prompt, sent, now)

    def _queue(self, rid: str, replica_id: str, prompt: list[int], sent: float, now: float) -> None:
        """Submit a routed request to its replica (a refusal there is recorded as the driver does)."""
        spec, replica = self._arrivals[rid].spec, self._by_id[replica_id]
        try:
            replica.engine.add_request(
                prompt,
                {"max_tokens": spec.output_len, "ignore_eos": True, "priority": spec.priority},
                request_id=rid,
                arrival_time=sent,
                oracle_output_len=spec.output_len,
                hand_over=self._hands_over(replica.replica_id),
            )
        except SlotServeError as err:
            self._refuse(rid, err, sent, now)
            return
        self._requests[rid] = (replica.engine.requests[rid], replica.replica_id)
        self._dirty.add(replica.index)

    def _refuse(self, rid: str, err: SlotServeError, sent: float, now: float, told: bool = True) -> None:
        """The request ends refused: `rejected` when overloaded or invalid, else `error`, with its
        reason; its router is told unless it refused it while holding it (`told=False`)."""
        arrival = self._arrivals[rid]
        self._errors[rid] = str(err)
        rejected = isinstance(err, (ValueError, OverloadedError))
        self._done[rid] = RequestTrace(
            rid,
            sent,
            [],
            now,
            "rejected" if rejected else "error",
            arrival.spec.prompt_len,
            None,
            priority=arrival.spec.priority,
            tenant=arrival.spec.tenant,
        )
        if told:
            self._router_of(rid).complete(rid)
        self.schedule.finished(arrival.index, now)

    def _take_decisions(self) -> None:
        """Keep the routers' new decisions, in time order, their per-replica figures within the run's bound."""
        decisions = heapq.merge(*(router.drain_decisions() for router in self.routers), key=attrgetter("time"))
        if not self.keep_records:
            return
        for decision in decisions:
            figures = len(decision.scores) + len(decision.in_flight)
            if self._decision_figures + figures <= self.max_decision_figures:
                self._decision_figures += figures
            else:  # the bound is reached: no later decision keeps more than its choice's
                self._decision_figures = self.max_decision_figures
                chosen = decision.replica_id
                decision = replace(
                    decision, scores={chosen: decision.scores[chosen]}, in_flight={chosen: decision.in_flight[chosen]}
                )
            self._decisions.append(decision)

    def _route_request(self, rid: str, spec: WorkloadRequest, prompt: list[int], sent: float) -> RouteRequest:
        """What the router is told, as a client sends it: lengths, session, the prompt's block
        hashes at the engine's block size, and when it was sent."""
        size = self.config.engine.block_size
        hashes = tuple(block_hashes(prompt, size))
        return RouteRequest(
            rid,
            spec.prompt_len,
            spec.output_len,
            spec.session_id,
            hashes,
            size,
            sent_at=sent,
            priority=spec.priority,
            tenant=spec.tenant,
        )

    def _tell_arrivals_done(self) -> None:
        """Whether a request may come before a running one ends, as the cluster's driver tells
        its replicas: with none coming, a static batch need not wait to be full."""
        done = self.schedule.waiting_on_ends and not self._held and not self._flow_held
        if done != self._arrivals_done:
            self._arrivals_done = done
            for i, replica in enumerate(self.replicas):
                replica.engine.set_arrivals_done(done)
                self._dirty.add(i)

    def _start_step(self, index: int, now: float) -> None:
        replica = self.replicas[index]
        _advance(replica.clock, now)
        result = replica.engine.step()
        if result.record is None:  # nothing may run: wait for an arrival or the policy's timer
            wake = replica.engine.scheduler.wake_time()
            if wake is not None and wake > replica.clock.now() and wake != replica.wake_at:
                replica.wake_at = wake
                heapq.heappush(self._events, (wake, self._WAKE, next(self._seq), index, None))
            return
        if self.check_invariants:
            replica.engine.scheduler.check_invariants()
        _advance(replica.clock, replica.clock.now() + self.config.step_overhead)  # the loop's own work
        replica.busy = True
        heapq.heappush(self._events, (replica.clock.now(), self._STEP_END, next(self._seq), index, result))

    def _end_step(self, replica: _Replica, result: StepResult, now: float) -> None:
        """What the step did reaches the router now: completions first, then the load report."""
        replica.busy = False
        for output in result.outputs:
            if output.finished and output.handover is None:  # a hand-over is a subclass's to deliver
                request, replica_id = self._requests.pop(output.request_id)
                self._done[output.request_id] = self._classed(request_trace(request, output.time, replica_id))
                if self.keep_records:
                    self._token_ids[output.request_id] = request.output_token_ids
                self._router_of(output.request_id).complete(output.request_id, output_len=request.num_output_tokens)
                self.schedule.finished(self._arrivals[output.request_id].index, now)
        record, rid = result.record, replica.replica_id
        self._step_counts[rid] += 1
        self._step_ends[rid] = record.start + record.duration
        if self.keep_records:
            self._steps[rid].append(record)
        self._report(replica)
        self._dirty.add(replica.index)
        self._tell_arrivals_done()

    def _classed(self, trace: RequestTrace) -> RequestTrace:
        """The trace with its request's priority and tenant (from its workload request)."""
        spec = self._arrivals[trace.request_id].spec
        if (spec.priority, spec.tenant) == (trace.priority, trace.tenant):
            return trace
        return replace(trace, priority=spec.priority, tenant=spec.tenant)

    def _report(self, replica: _Replica, force: bool = False) -> None:
        load = replica.engine.load_report(replica.replica_id)
        if force or report_due(load, load.time - replica.last_report):
            replica.last_report = load.time
            load = with_kv_events(load, replica.engine)
            for router in self.routers:
                router.report(load)

    def _check_all_ended(self) -> None:
        """Every request ends exactly once; anything else is a stuck policy or a lost request."""
        stuck = {r.replica_id: len(r.engine.requests) for r in self.replicas if r.engine.has_unfinished}
        if stuck:
            raise InvariantViolation(
                f"simulation stopped with requests that can never run: {stuck} ({self.config.engine.policy} batching)"
            )
        if not self.schedule.done:
            raise InvariantViolation(
                f"the arrival schedule of {self.workload.name!r} is not done, yet nothing is "
                "running that could release its next request"
            )
        missing = set(self._arrivals) - set(self._done)
        if missing:
            raise InvariantViolation(f"requests without a final event: {sorted(missing)[:5]}")


def _advance(clock: FakeClock, t: float) -> None:
    """Bring a clock to `t` as the in-process replay's sleeps would: `now + (t - now)` can land
    an ulp short of t; a second sleep then lands on it exactly."""
    while clock.now() < t:
        clock.sleep(t - clock.now())


def simulate(
    workload: Workload,
    config: SimulationConfig | None = None,
    cost: CostModel | None = None,
    check_invariants: bool = False,
) -> SimulationResult:
    """Run `workload` through a simulated cluster (see the module docstring)."""
    return Simulator(workload, config, cost, check_invariants).run()


def measure_capacity(config: SimulationConfig, cost: CostModel | None = None) -> Capacity:
    """The simulated cluster's capacity, by the probes the real cluster is measured with
    (`workloads.capacity.probe_capacity`), on virtual time."""
    slots = config.num_replicas * config.engine.num_slots
    return probe_capacity(lambda probe: simulate(probe, config, cost).traces, slots, config.engine.max_seq_len)


def cost_description(cost: CostModel) -> dict[str, Any]:
    """The cost model as the run's config records it."""
    if isinstance(cost, BaseModel):
        return {"kind": type(cost).__name__, **cost.model_dump()}
    return {"kind": type(cost).__name__, **asdict(cost)}


def record_simulation(
    store,
    result: SimulationResult,
    name: str | None = None,
    slo: dict | None = None,
    extra_config: dict[str, Any] | None = None,
) -> int:
    """Write a simulation into the metrics store through `metrics.recording.record_run`, with
    the rows the cluster writes, the run marked simulated and `extra_config` added to its
    config, under `slo` (default: the SLO it was routed within, its config's); returns its run id."""
    config, workload = result.config, result.workload
    if not result.records_kept:
        raise ConfigError("the simulation kept no steps or decisions (keep_records=False): the store needs them")
    run_config = {
        "simulated": True,
        "num_replicas": config.num_replicas,
        "engine": config.engine.model_dump(),
        "vocab_size": config.vocab_size,
        "cost_model": cost_description(result.cost),
        "workload": workload.describe(),
        "workload_params": workload.params,
        **(extra_config or {}),
    }
    traces = []
    for trace in result.traces:
        arrival = result.arrivals[trace.request_id]
        traces.append(
            replace(
                trace,
                session_id=arrival.spec.session_id,
                max_tokens=arrival.spec.output_len,
                error=result.errors.get(trace.request_id),
                planned_arrival=arrival.planned,
                submit_lateness=trace.arrival - arrival.planned,
            )
        )
    return record_run(
        store,
        name=name or f"sim-{workload.name}-{config.engine.policy}-{config.routing_policy}",
        config=run_config,
        batching_policy=config.engine.policy,
        routing_policy=config.routing_policy,
        seed=config.seed,
        slo=asdict(config.slo) if slo is None else slo,
        simulated=True,
        traces=traces,
        steps=[(rid, config.engine.num_slots, record) for rid, records in result.steps.items() for record in records],
        decisions=result.decisions,
    )
