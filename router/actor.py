# Over 400 lines: one thin method per call the clients, replicas, autoscaler and CLI make, over the handles it holds.
"""The router as a Ray actor: a thin shell around `Router` that holds the replica handles and
ships decisions to the metrics store in batches.

Clients ask it for a replica id, then talk to that replica's handle directly: the router sees
one call per request at dispatch and one at completion, never a token. It asks Ray for no CPU
(its own work is tens of microseconds per call). Its methods are synchronous and run one at a
time, so the `Router` inside needs no lock; and on the 2-core development machine a no-op
synchronous actor took 1.3-1.6x the calls per second of an async one
(`benchmarks/router_decisions.py --actor` prints both next to this actor's figures).

Health: with `health_period` set, a watcher thread asks every replica for its `health()` each
period (never two questions to one replica at once) and hands the answers to the actor's own
queue (`apply_health`), so the router's state is only ever changed by its one method thread. A
replica that is dead, does not answer within `health_timeout`, or reports unhealthy is marked
down at once (a client that loses a replica's stream says so too, through `replica_lost`); one
that reports a failed or stalled loop is killed so Ray restarts it; a replica Ray restarted is
attached to this router again and marked up only once its health check passes. A replica being
drained stays down until it is gone.

A replica that has not answered this router once yet is `starting` (down, routed nothing):
those a new router is created with, those a router Ray restarted holds, and each one
`add_replica` brings. Its actor answers only once it is
built, and building one (loading a model, compiling kernels) may take minutes on a busy
machine, so its silence is not held against it: `health_timeout` applies from its first answer
on, as Kubernetes' startup probe precedes its liveness probe. Whoever started it bounds the
start (`cluster.deploy.start_cluster`, which returns only once every replica is up, and the
autoscaling controller's `start_timeout`). Requests meanwhile go to the replicas that are up. A
router Ray restarted cannot tell a replica that had answered the router it replaces from one
still loading (that router may have died while `start_cluster` waited), so it holds every one
starting too, and asks each for its health once before it takes its first call (waiting at
most `health_timeout`): the replicas that were serving are routed to from that call on, and one
that has not answered yet is left to the watcher, as a starting one.

Scaling: the autoscaling controller (`cluster.autoscaler`) reads `scaling_view` every decision
period (the last load reports, the requests in flight, the new requests routed since its last
look), adds a replica it started with `add_replica` (down, `starting`, until the health check
above attaches it and passes) and takes a drained one away with `remove_replica`. Ray restarts
this actor with the arguments it was created with, so a restarted router knows the replicas the
cluster started with (one drained away since, whose name is gone, as down: `gone`): the
controller gives it back the ones it added and has it remove the gone ones.

Whether more requests may come (`set_arrivals_done`, from the driver) is kept here and passed,
without waiting, to every replica, to each added or restarted one too, so a replica the cluster
did not start with is not left waiting to fill a static batch. A router Ray restarted has no
word until the driver's next one: it passes none, and a replica keeps the one it had.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import ray
from ray.actor import ActorHandle

from protocol import defaults
from protocol.backlog import StoreBacklog
from protocol.errors import SlotServeError
from protocol.flow import FlowConfig
from protocol.messages import Completion, HealthReport, KvEvents, LoadReport
from protocol.records import Decision, JsonObject
from protocol.replicas import Unreachable
from protocol.routing import Admission, Released, RouteRequest, RouterView
from protocol.scaling import ArrivalWindow, ScalingView
from protocol.telemetry_hooks import RouterTelemetry
from router.pd_router import PdPools, PdRouter
from router.policies import DEFAULT_POLICY
from router.release_box import ReleaseBox
from router.router import Router

ROUTER_ACTOR_NAME = "slotserve-router"
FLUSH_EVERY = 100
KV_LOG_BATCHES = 64  # K/V event batches kept per replica for the clients that route locally
RELEASE_WAITERS = 64  # clients' long polls for held requests (`released`) waiting at once
TICK_SECONDS = 0.05  # how often, while flow control holds requests, their deadlines are looked at
GAUGE_REFRESH_SECONDS = 1.0


# Flow control's long polls wait on threads of their own: the default group stays one thread,
# so every method that changes the router still runs alone.
@ray.remote(num_cpus=0, concurrency_groups={"release": RELEASE_WAITERS})
class RouterActor:
    def __init__(
        self,
        replica_handles: dict[str, ActorHandle | str],
        policy: str = DEFAULT_POLICY,
        seed: int = 0,
        store: ActorHandle | str | None = None,
        flush_every: int = FLUSH_EVERY,
        max_in_flight_per_replica: int = defaults.MAX_IN_FLIGHT_PER_REPLICA,
        max_in_flight: int | None = None,
        health_period: float | None = None,
        health_timeout: float = 15.0,
        telemetry=None,
        pools: PdPools | None = None,
        tpot_slo: float = defaults.TPOT_SLO,
        flow: FlowConfig | None = None,
    ):
        """`store`, if given, receives `add_decision_records.remote(run_id, decisions)` every `flush_every`
        decisions and on `flush()`. Decisions are recorded only inside a run (from
        `set_run(run_id)` to `set_run(None)`), like the replicas' step samples. With
        `health_period` (seconds) the replicas' health is watched (see the module docstring).
        A replica or the store may be given by its actor name (in the router's namespace)
        instead of a handle: a router Ray restarts after its creator has gone then finds them
        again by name, where handles passed by reference would be gone with their owner.
        `pools`: the replicas' prefill/decode roles and the P/D decider (`router.pd_router`).
        `tpot_slo`: the TPOT limit of the SLO runs are judged by (see `Router`). `flow`: flow
        control (`protocol.flow`): a request `admit_many` holds is answered so (`Admission.held`),
        and its client takes its dispatch or refusal from `released`."""
        # Restarted by Ray: the replicas were registered long ago, so a name that is gone now
        # belonged to a replica drained since; it stays down, as `gone`, until the autoscaling
        # controller, which gives back the replicas it added, has it removed.
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        found = {r: _actor(h, 0.0 if restarted else 60.0, missing_ok=restarted) for r, h in replica_handles.items()}
        self._handles = {replica_id: h for replica_id, h in found.items() if h is not None}
        store = _actor(store) if store is not None else None
        bounds = {"max_in_flight_per_replica": max_in_flight_per_replica, "max_in_flight": max_in_flight, "flow": flow}
        if pools is None:
            self._router = Router(list(replica_handles), policy, seed=seed, tpot_slo=tpot_slo, **bounds)
        else:  # prefill and decode pools (router.pd_router)
            self._router = PdRouter(list(replica_handles), pools, policy=policy, seed=seed, tpot_slo=tpot_slo, **bounds)
        # live metrics: `telemetry(router)` builds the exporter it is given (cluster.prometheus_exporters)
        self._telemetry = telemetry(self._router) if telemetry else RouterTelemetry()
        for replica_id in replica_handles.keys() - self._handles.keys():
            self._router.mark_down(replica_id, "gone")
        # not answered a health question yet, restarted or not (see the module docstring);
        # without health checks nothing would mark them up, so they are taken as up from the start
        self._starting: set[str] = set()
        if health_period is not None:
            for replica_id in self._handles:
                self._start(replica_id)
        self._bound_given = max_in_flight is not None  # else the bound in all follows the replica count
        # new requests routed since the last scaling view: count, prompt tokens, max_tokens
        self._window_start = time.time()
        self._arrived = self._arrived_prompt = self._arrived_output = 0
        self._draining: set[str] = set()
        self._arrivals_done: bool | None = None  # None: not said since this actor (re)started
        self._health: dict[str, HealthReport | Unreachable] = {}  # last answer per replica
        self._restarting: set[str] = set()  # killed for a restart, not yet healthy again
        self._restarts_asked = 0
        self._store = store
        self._run_id: int | None = None
        # Decisions of the current run on their way to the store; never waits on it (protocol.backlog).
        self._decisions: StoreBacklog[Decision] = StoreBacklog(self._send_decisions, flush_every)
        self._kv_log: dict[str, deque[KvEvents]] = {}  # each replica's last K/V batches, for clients routing locally
        if health_period is not None and restarted:
            self.apply_health(self._ask_health(health_timeout))
        if health_period is not None:
            threading.Thread(
                target=self._watch, args=(health_period, health_timeout), daemon=True, name="slotserve-health"
            ).start()
        self._releases = ReleaseBox()
        self._last_held: dict[int, int] = {}
        if flow is not None:
            threading.Thread(target=self._tick_while_held, daemon=True, name="slotserve-flow-ticks").start()

    def route(self, request: RouteRequest) -> str:
        """The id of the replica to send the request to (its handle is in `replicas()`).
        Raises OverloadedError when the bounds are reached or no replica is up."""
        decision = self._telemetry.route(self._router.route, request)
        self._count_arrival(request)
        self._take_decisions()
        return decision.replica_id

    def _count_arrival(self, request: RouteRequest) -> None:
        if request.moved_from is None:
            self._arrived += 1
            self._arrived_prompt += request.prompt_len
            self._arrived_output += request.max_tokens

    def route_many(self, requests: list[RouteRequest]) -> list[str | SlotServeError]:
        """`route` for several requests in one call. A call through Ray costs far more than a
        decision, so a client routing a burst of arrivals sends them together. Each request
        gets its own answer: a replica id, or the typed error that refused it (a duplicate id,
        overload), so one bad request never fails the others of its burst."""
        answers: list[str | SlotServeError] = []
        for request in requests:
            try:
                answers.append(self.route(request))
            except SlotServeError as err:
                answers.append(err)
        return answers

    def admit_many(self, requests: list[RouteRequest], client: str) -> list[Admission | SlotServeError]:
        """`route_many` under flow control, for `client`: each request's `Admission`, held (its
        `Released` comes from `released`) or with its replica, or the error that refused it
        (also an unknown priority, a tenant over its limit). A move is never held: it was
        admitted once. Without a flow config nothing is held."""
        answers: list[Admission | SlotServeError] = []
        for request in requests:
            try:
                if self._router.flow is None or request.moved_from is not None:
                    answers.append(Admission(request.request_id, self.route(request)))
                else:
                    answers.append(self._submit(request, client))
            except SlotServeError as err:
                answers.append(err)
        self._pass_released()
        return answers

    def _submit(self, request: RouteRequest, client: str) -> Admission:
        try:
            decision = self._telemetry.route(self._router.submit, request)
        except SlotServeError:
            self._telemetry.flow(request.priority, request.tenant, "refused")
            raise
        self._count_arrival(request)
        if decision is not None:
            self._telemetry.flow(request.priority, request.tenant, "dispatched")
            return Admission(request.request_id, decision.replica_id)
        self._telemetry.flow(request.priority, request.tenant, "held")
        self._releases.hold(request, client)
        return Admission(request.request_id, None)

    @ray.method(concurrency_group="release")
    def released(self, client: str, timeout: float) -> list[Released]:
        """The `client`'s held requests dispatched or refused since its last call, waiting up to
        `timeout` seconds for one (a long poll, on a thread of its own)."""
        return self._releases.take(client, timeout)

    def withdraw(self, request_id: str) -> bool:
        """A held request's caller left: it is never dispatched."""
        self._releases.withdraw(request_id)
        return self._router.withdraw(request_id)

    def tick(self) -> None:
        """Refuse held requests past their deadline, and dispatch what the view allows."""
        self._router.tick()
        self._pass_released()

    def _tick_while_held(self) -> None:
        """Ask for a `tick` while requests are held; and set the held-per-band gauge again every
        `GAUGE_REFRESH_SECONDS` from the last count (Ray exports a gauge no one sets for a while no
        more), reading only that count, which the method thread replaces whole."""
        me = ray.get_runtime_context().current_actor
        refreshed = time.monotonic()
        while True:
            time.sleep(TICK_SECONDS)
            if self._releases.num_held:
                me.tick.remote()
            if time.monotonic() - refreshed >= GAUGE_REFRESH_SECONDS:
                self._telemetry.flow_held(self._last_held)
                refreshed = time.monotonic()

    def _pass_released(self) -> None:
        """Held requests the last change released, to their clients (decisions to the store)."""
        if self._router.flow is not None:
            released = self._router.take_released()
            if released:
                for item, request in self._releases.put(released):
                    outcome = "released" if item.decision is not None else "refused"
                    self._telemetry.flow(request.priority, request.tenant, outcome)
                self._take_decisions()
            held = self._router.flow.held_by_band()
            if held != self._last_held:
                self._telemetry.flow_held(held)
                self._last_held = held

    def replicas(self) -> dict[str, ActorHandle]:
        return dict(self._handles)

    def complete(self, request_id: str, replica_id: str | None = None, output_len: int | None = None) -> bool:
        """See `Router.complete` (the same arguments in the same order)."""
        done = self._router.complete(request_id, replica_id, output_len)
        self._pass_released()
        return done

    def complete_many(self, completions: list[Completion]) -> None:
        """`complete` for the requests that ended in one loop turn of a replica, in one call."""
        for done in completions:
            self._router.complete(done.request_id, done.replica_id, done.output_len)
        self._pass_released()

    def sync(self, decisions: list[Decision], kv_next: dict[str, int] | None = None) -> RouterView:
        """For a client that routes on its own (`cluster.local_routing`): record its decisions
        as this router's own, and return every replica's last load report, the replicas that
        are down (with why), and the K/V event batches from `kv_next` on (the number of the
        batch its block index expects next, per replica), so its view is this router's, one
        call per report interval. A client further behind than the batches kept here gets this
        router's index of the replica whole."""
        if self._store is not None and self._run_id is not None:
            self._decisions.add(decisions)
        kv_next = kv_next or {}
        kv_events = {}
        for replica_id, log in self._kv_log.items():
            batches = self._router.block_index.catch_up(replica_id, log, kv_next.get(replica_id))
            if batches:
                kv_events[replica_id] = batches
        return RouterView(self._router.load.last_reports(), dict(self._router.down), tuple(self._handles), kv_events)

    def replica_lost(self, replica_id: str, reason: str) -> int:
        """A client lost its stream from the replica (the actor died, or its node): route
        nothing there until a health check passes. Returns the requests forgotten there."""
        if replica_id not in self._handles:
            return 0
        return len(self._router.mark_down(replica_id, f"lost: {reason}"[:200]))

    def start_drain(self, replica_id: str) -> None:
        """Route nothing more to the replica: it is being drained and removed."""
        self._draining.add(replica_id)
        self._router.mark_down(replica_id, "draining")

    def scaling_view(self) -> ScalingView:
        """For the autoscaling controller: the replicas' last load reports, which are down, the
        requests in flight on each, and the new requests routed since the last call."""
        now = time.time()
        arrivals = ArrivalWindow(self._window_start, now, self._arrived, self._arrived_prompt, self._arrived_output)
        self._window_start = now
        self._arrived = self._arrived_prompt = self._arrived_output = 0
        in_flight = {v.replica_id: v.in_flight for v in self._router.load.views(self._router.clock.now())}
        return ScalingView(self._router.load.last_reports(), dict(self._router.down), in_flight, arrivals, self._run_id)

    def add_replica(self, replica_id: str, actor_name: str) -> None:
        """A replica the controller started (its actor, by name): routed to once the health
        check has attached it and passed, as a replica Ray restarted is. A replica it already
        holds is left as it is: the controller's start and its reconciling of a view taken
        just before may both add the same one."""
        if replica_id in self._handles:
            return
        self._handles[replica_id] = _actor(actor_name)
        self._router.add_replica(replica_id)
        self._start(replica_id)
        self._follow_replica_count()
        self._tell_arrivals_done([replica_id])

    def set_arrivals_done(self, done: bool) -> None:
        """The driver says whether more requests may come before a running one ends: passed to
        every replica and to each replica added or restarted from now on. Sent without waiting,
        so a replica that is restarting holds up no route call; a replica that hears it a little
        after a request only batches that request as it would have a moment before."""
        self._arrivals_done = done
        self._tell_arrivals_done(list(self._handles))

    def _tell_arrivals_done(self, replica_ids: list[str]) -> None:
        if self._arrivals_done is not None:
            for replica_id in replica_ids:
                self._handles[replica_id].set_arrivals_done.remote(self._arrivals_done)

    def remove_replica(self, replica_id: str) -> None:
        """A drained replica is gone: forget it (its requests were handed back to their clients)."""
        if replica_id not in self._router.replica_ids:
            return
        self._router.remove_replica(replica_id)
        self._handles.pop(replica_id, None)
        for held in (self._draining, self._restarting, self._starting):
            held.discard(replica_id)
        self._health.pop(replica_id, None)
        self._follow_replica_count()

    def is_up(self, replica_id: str) -> bool:
        """Whether the replica is routed to (known and not down)."""
        return replica_id in self._handles and replica_id not in self._router.down

    def _start(self, replica_id: str) -> None:
        """Route nothing to the replica until its first health answer passes (`starting`)."""
        self._starting.add(replica_id)
        self._router.mark_down(replica_id, "starting")

    def _follow_replica_count(self) -> None:
        if not self._bound_given:
            self._router.max_in_flight = self._router.max_in_flight_per_replica * len(self._handles)

    def apply_health(
        self, answers: dict[str, HealthReport | Unreachable], silent: dict[str, Unreachable] | None = None
    ) -> None:
        """The watcher's findings put into effect (a replica removed meanwhile is left out):
        `answers`, each replica's health or the error its question raised (dead, broken), and
        `silent`, the replicas that have not answered within `health_timeout`. A starting
        replica's silence leaves it starting (the module docstring says why)."""
        self._starting -= answers.keys()  # they answered: from now on each is held to health_timeout
        for replica_id, quiet in (silent or {}).items():
            if replica_id in self._starting:
                self._health[replica_id] = Unreachable(replica_id, "starting: no health answer yet", quiet.time)
            else:
                answers = {**answers, replica_id: quiet}
        answers = {replica_id: a for replica_id, a in answers.items() if replica_id in self._handles}
        self._health.update(answers)
        for replica_id, answer in answers.items():
            if replica_id in self._draining:
                continue
            if isinstance(answer, HealthReport) and answer.healthy:
                self._restarting.discard(replica_id)
                if not answer.attached:  # restarted by Ray, or new: attach now, mark up on the next healthy answer
                    me = ray.get_runtime_context().current_actor
                    self._handles[replica_id].attach.remote(me, self._store, self._run_id)
                    self._tell_arrivals_done([replica_id])
                elif replica_id in self._router.down:
                    self._router.mark_up(replica_id)
                continue
            why = answer.reason if isinstance(answer, Unreachable) else f"unhealthy: {answer.reason}"
            if self._router.down.get(replica_id) != why:
                self._router.mark_down(replica_id, why)
            if isinstance(answer, HealthReport) and replica_id not in self._restarting:
                # Alive, but its loop failed or stalled: kill it once so Ray restarts it.
                self._restarting.add(replica_id)
                self._restarts_asked += 1
                ray.kill(self._handles[replica_id], no_restart=False)

    def _ask_health(self, timeout: float) -> dict[str, HealthReport | Unreachable]:
        """Every replica's answer to one health question, waiting at most `timeout` in all;
        those that have not answered by then are left out."""
        asked = {replica_id: handle.health.remote() for replica_id, handle in self._handles.items()}
        if not asked:
            return {}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout)
        return {replica_id: _answer(replica_id, ref) for replica_id, ref in asked.items() if ref in ready}

    def _watch(self, period: float, timeout: float) -> None:
        """The watcher thread: ask, wait at most `timeout`, hand the answers to the actor."""
        me = ray.get_runtime_context().current_actor
        pending: dict[str, tuple[ray.ObjectRef, float]] = {}
        while True:
            time.sleep(period)
            now = time.monotonic()
            for replica_id, handle in list(self._handles.items()):  # replicas come and go meanwhile
                if replica_id not in pending:
                    pending[replica_id] = (handle.health.remote(), now)
            answers: dict[str, HealthReport | Unreachable] = {}
            silent: dict[str, Unreachable] = {}
            ready, _ = ray.wait([ref for ref, _ in pending.values()], num_returns=len(pending), timeout=0.5)
            for replica_id, (ref, asked) in list(pending.items()):
                if ref in ready:
                    del pending[replica_id]
                    answers[replica_id] = _answer(replica_id, ref)
                elif now - asked > timeout:
                    silent[replica_id] = Unreachable(replica_id, f"no health answer within {timeout:g} s", time.time())
            if answers or silent:
                me.apply_health.remote(answers, silent)

    def set_policy(self, policy: str, tpot_slo: float | None = None) -> None:
        """Switch routing policy (and TPOT SLO) between runs (see `Router.set_policy`)."""
        self._router.set_policy(policy, tpot_slo)

    def report(self, load_report: LoadReport) -> bool:
        """A replica's load report (see `Router.report`). A replica whose K/V events showed a gap
        is asked here for a snapshot, once: until it comes the router believes it holds nothing."""
        kept = self._router.report(load_report)
        if load_report.kv_events is not None:
            self._kv_log.setdefault(load_report.replica_id, deque(maxlen=KV_LOG_BATCHES)).append(load_report.kv_events)
        for replica_id in self._router.block_index.take_snapshot_requests():
            if (handle := self._handles.get(replica_id)) is not None:
                handle.request_kv_snapshot.remote()
        self._pass_released()
        return kept

    def status(self) -> JsonObject:
        """A read-out for people and dashboards (`slotserve status`, `slotserve top`)."""
        return {
            **self._router.status(),
            "run_id": self._run_id,
            "decisions_waiting": self._decisions.waiting,
            "decisions_dropped": self._decisions.dropped,
            "decisions_lost": self._decisions.failed,
            "draining": sorted(self._draining),
            "starting": sorted(self._starting),
            "restarts_asked": self._restarts_asked,
            "health": dict(self._health),
        }

    def set_run(self, run_id: int | None) -> None:
        """Record decisions from now on under `run_id` (None: stop recording); those buffered
        so far go out under the previous run."""
        self.flush()
        self._run_id = run_id
        self._arrivals_done = False  # as each replica's `set_run` says: the run's requests are to come
        self._telemetry.set_run(run_id)

    def flush(self) -> None:
        """Send every decision made so far and wait until the store has them."""
        self._take_decisions()
        self._decisions.flush()

    def _take_decisions(self) -> None:
        decisions = self._router.drain_decisions()
        if self._store is not None and self._run_id is not None:
            self._decisions.add(decisions)

    def _send_decisions(self, decisions: list[Decision]) -> Future:
        """One store write (see protocol.backlog: at most one in flight)."""
        return self._store.add_decision_records.remote(self._run_id, decisions).future()


def _actor(handle_or_name: ActorHandle | str, wait: float = 60.0, missing_ok: bool = False) -> ActorHandle | None:
    """The handle, or the actor of that name in this actor's namespace. Ray registers a new
    named actor asynchronously, so a name given right after its creation is retried for `wait`
    seconds; then a name still missing raises, or with `missing_ok` gives None."""
    if not isinstance(handle_or_name, str):
        return handle_or_name
    deadline = time.monotonic() + wait
    while True:
        try:
            return ray.get_actor(handle_or_name)
        except ValueError:
            if time.monotonic() >= deadline:
                if missing_ok:
                    return None
                raise
            time.sleep(0.1)


def _answer(replica_id: str, ref: ray.ObjectRef) -> HealthReport | Unreachable:
    """A replica's answer to a health question that has come back: its report, or the error
    the question raised (a dead or broken replica), which is an answer too."""
    try:
        return ray.get(ref)
    except Exception as err:  # noqa: BLE001 - whatever Ray raised, the replica did not answer healthy
        return Unreachable(replica_id, f"no health answer: {type(err).__name__}", time.time())
