"""The autoscaling controller on Ray: a small actor beside the router that runs one of
`autoscaling.policies` every decision period and acts on its decisions.

Every `period_s` it reads the router's `ScalingView` (the replicas' last load reports, the new
requests routed since its last look), builds the `ScalingObservation` the simulator builds
(`sim.autoscaling`) from its own table of replica states, asks the policy, and:

- **scales up** by starting replica actors the way `cluster.deploy` starts them (its `launch`):
  a new replica is `starting` until its actor answers (Ray placed it, on a node Ray's
  autoscaler adds if none has room; it started and loaded its model), its first step has run
  (one warm-up request, before it knows the router, so it counts in no run), and the router,
  told of it, has attached it and seen its health check pass. Only then does it take traffic
  and count as `serving`. Each phase is measured (`ColdStart`). A replica that does not get
  there within `start_timeout` is stopped and forgotten;
- **scales down** by draining serving replicas (the one with the fewest requests in flight
  first, the newest on a tie) with `cluster.deploy.drain_replicas` (its `drain`): the router
  routes nothing more there, running requests get `drain_timeout_s` seconds to finish, the rest
  go back to their clients, which resume them token-exact on other replicas; then the
  replica stops and the router forgets it. It is `draining` until then. At least one replica
  keeps serving, and replicas still starting finish their start (the next decision drains
  what is extra), so a decision never cancels a start half-way.

The bounds (min and max replicas, the cooldown, never below what holds the requests already
in the cluster) are the policy's own (`autoscaling.base`). Each decision, with its inputs and
reason, and each cold start go to the store's `scaling` and `cold_starts` tables while a run
is recorded (as the router's routing decisions do), and to the live metrics
(`cluster.prometheus_exporters.AutoscalerExporter`). The controller restarts without limit:
a restarted one takes each of the router's replicas in the state the router holds it in
(`router_states`): draining (it finishes the drain), starting (it waits, within
`start_timeout`, for its health check to pass, then counts it serving) or serving.
The router restarts too, knowing then only the replicas the cluster started with (those still
alive): every period the controller gives the router back each replica of its own the router
has lost (down until its health check passes, as when it was first added), tells it again of
each it is draining, and has it forget those this controller no longer holds.

A warm-up request goes to a replica that knows no run yet, so it is first told that no more
requests come: a static batch does not wait to be full for it.

`launch` and `drain` are given by `cluster.deploy` (which starts this actor), so this module
does not import it."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from autoscaling.policies import AutoscaleConfig, make_autoscaling_policy
from cluster.connection import NAMESPACE, ClusterError
from cluster.prometheus_exporters import AutoscalerExporter
from metrics.live import PROBE_REQUEST_PREFIX
from protocol.clock import WallClock
from protocol.scaling import (
    AutoscalerStatus,
    ColdStart,
    ReplicaState,
    ScalingDecision,
    ScalingObservation,
    ScalingView,
)
from replica.scheduling.request import SamplingParams
from workloads.capacity import Capacity

AUTOSCALER_ACTOR_NAME = "slotserve-autoscaler"
STARTING, SERVING, DRAINING = "starting", "serving", "draining"
STATES = (STARTING, SERVING, DRAINING)
START_TIMEOUT = 900.0  # seconds from asking for a replica to its first traffic (a node added for it included)
WARMUP_SUBSCRIBER = "slotserve-autoscaler"
MAX_ERRORS = 20  # the latest failures kept for the status

Launch = Callable[[int], ActorHandle]  # replica index -> its new actor (named as start_cluster names it)
Drain = Callable[[ActorHandle, dict[str, ActorHandle], float], dict[str, dict[str, int]]]


def replica_index(replica_id: str) -> int:
    return int(replica_id.removeprefix("replica-"))


def router_states(replica_ids: Iterable[str], down: Mapping[str, str]) -> dict[str, str]:
    """The state of each of the router's replicas as the router holds it (`down`: its reasons,
    `ScalingView.down`): draining, starting (routed nothing until its first health answer,
    `router.actor`), or serving; one down for another reason (lost, unhealthy) was serving and
    is again once its health check passes."""
    held = {"draining": DRAINING, "starting": STARTING}
    return {replica_id: held.get(down.get(replica_id, ""), SERVING) for replica_id in replica_ids}


@dataclass
class _Replica:
    replica_id: str
    handle: ActorHandle
    state: str
    since: float  # wall clock: when it entered its state
    registered: bool  # given to the router (which must be told again if it restarts)


@ray.remote(num_cpus=0)
class AutoscalerActor:
    def __init__(
        self,
        config: AutoscaleConfig,
        capacity: Capacity | None,
        launch: Launch,
        drain: Drain,
        router_name: str,
        store_name: str,
        replica_prefix: str,
        start_timeout: float = START_TIMEOUT,
    ):
        """`capacity`: one replica's, for the policies that price work (`queue_slo`,
        `predictive`). The router and the store are found by name (in slotserve's namespace),
        so a controller Ray restarts finds them again; replica k's actor is named
        `replica_prefix` + k, which is how the router finds it."""
        self.config = config
        self.policy = make_autoscaling_policy(config, WallClock(), capacity)
        self._launch, self._drain, self._prefix = launch, drain, replica_prefix
        self.start_timeout = start_timeout
        self._router = ray.get_actor(router_name, namespace=NAMESPACE)
        self._store = ray.get_actor(store_name, namespace=NAMESPACE)
        self._telemetry = AutoscalerExporter(config.policy)
        self._lock = threading.Lock()  # the decision thread, the start and drain threads, status()
        self._replicas: dict[str, _Replica] = {}
        self._last: ScalingDecision | None = None
        self._decisions = self._ups = self._downs = 0
        self._drained_finished = self._drained_moved = self._drained_kv_moved = 0  # requests of drained replicas
        self._cold_starts: list[ColdStart] = []
        self._errors: deque[str] = deque(maxlen=MAX_ERRORS)
        # on their way to the store, sent with the next decision made inside a run
        self._unsent: tuple[list[ScalingDecision], list[ColdStart]] = ([], [])
        handles = ray.get(self._router.replicas.remote(), timeout=60)
        states = router_states(handles, ray.get(self._router.scaling_view.remote(), timeout=60).down)
        now = time.time()
        for replica_id, handle in handles.items():
            replica = self._replicas[replica_id] = _Replica(replica_id, handle, states[replica_id], now, True)
            if replica.state == DRAINING:  # this controller restarted mid-drain: finish it
                self._spawn(self._drain_one, replica)
            elif replica.state == STARTING:  # ... or mid-start (or the router restarted): see it up
                self._spawn(self._finish_start, replica)
        self._next_index = 1 + max((replica_index(r) for r in handles), default=-1)
        threading.Thread(target=self._loop, daemon=True, name="slotserve-autoscaler").start()

    def status(self) -> AutoscalerStatus:
        """The policy and bounds, every replica's state, the last decision, the cold starts."""
        with self._lock:
            return AutoscalerStatus(
                policy=self.config.policy,
                min_replicas=self.config.min_replicas,
                max_replicas=self.config.max_replicas,
                replicas=[ReplicaState(r.replica_id, r.state, r.since) for r in self._replicas.values()],
                last_decision=self._last,
                decisions=self._decisions,
                scale_ups=self._ups,
                scale_downs=self._downs,
                cold_starts=list(self._cold_starts),
                drained_finished=self._drained_finished,
                drained_moved=self._drained_moved,
                drained_kv_moved=self._drained_kv_moved,
                errors=list(self._errors),
            )

    # ---- deciding -----------------------------------------------------------------------
    def _loop(self) -> None:
        period = self.config.period_s
        due = time.monotonic()
        while True:
            due += period
            time.sleep(max(0.0, due - time.monotonic()))
            due = max(due, time.monotonic() - period)  # a slow decision does not bring a burst of late ones
            try:
                self._decide()
            except Exception as err:  # noqa: BLE001 - a failed period is reported, the next one tries again
                self._error(f"decision failed: {type(err).__name__}: {err}")

    def _decide(self) -> None:
        view = ray.get(self._router.scaling_view.remote(), timeout=30)
        self._reconcile(view)
        with self._lock:
            serving = [r for r in self._replicas.values() if r.state == SERVING]
            starting = sum(r.state == STARTING for r in self._replicas.values())
            draining = sum(r.state == DRAINING for r in self._replicas.values())
        reports = tuple(
            view.reports[r.replica_id]
            for r in serving
            if r.replica_id in view.reports and r.replica_id not in view.down
        )
        cold_start = self._cold_starts[-1].ready_s if self._cold_starts else 0.0
        observation = ScalingObservation(len(serving), reports, view.arrivals, starting, draining, cold_start)
        decision = self.policy.decide(observation)
        if decision.change > 0:
            for _ in range(decision.change):
                self._start_one()
        elif decision.change < 0:
            in_flight = view.in_flight
            fewest_first = sorted(serving, key=lambda r: (in_flight.get(r.replica_id, 0), -replica_index(r.replica_id)))
            for replica in fewest_first[: min(-decision.change, len(serving) - 1)]:
                with self._lock:
                    replica.state, replica.since = DRAINING, time.time()
                self._spawn(self._drain_one, replica)
        with self._lock:
            self._last = decision
            self._decisions += 1
            self._ups += decision.change > 0
            self._downs += decision.change < 0
            self._unsent[0].append(decision)
            by_state = {state: sum(r.state == state for r in self._replicas.values()) for state in STATES}
        self._telemetry.on_decision(decision, view.run_id)
        self._telemetry.set_replicas(by_state)
        self._send(view.run_id)

    def _reconcile(self, view: ScalingView) -> None:
        """Make the router's replicas this controller's (see the module docstring): what it
        routes to is in `view.in_flight`, one entry for each replica it holds."""
        known = view.in_flight.keys()
        with self._lock:
            mine = {r.replica_id: (r.state, r.registered) for r in self._replicas.values()}
        for replica_id, (state, registered) in mine.items():
            if state == DRAINING and replica_id in known and view.down.get(replica_id) != "draining":
                ray.get(self._router.start_drain.remote(replica_id), timeout=60)
            elif state != DRAINING and registered and replica_id not in known:
                name = f"{self._prefix}{replica_index(replica_id)}"
                ray.get(self._router.add_replica.remote(replica_id, name), timeout=60)
        for replica_id in known - mine.keys():
            ray.get(self._router.remove_replica.remote(replica_id), timeout=60)

    def _send(self, run_id: int | None) -> None:
        """Inside a run, what was decided and measured since the last write goes to the store;
        outside one it is dropped (as the router's routing decisions are)."""
        with self._lock:
            decisions, cold_starts = self._unsent
            self._unsent = ([], [])
        if run_id is not None and (decisions or cold_starts):
            try:
                ray.get(self._store.add_scaling_records.remote(run_id, decisions, cold_starts), timeout=30)
            except ray.exceptions.RayError as err:
                self._error(f"store write failed: {type(err).__name__}")

    # ---- acting -------------------------------------------------------------------------
    def _start_one(self) -> None:
        index, self._next_index = self._next_index, self._next_index + 1
        replica = _Replica(f"replica-{index}", self._launch(index), STARTING, time.time(), False)
        with self._lock:
            self._replicas[replica.replica_id] = replica
        self._spawn(self._bring_up, replica, index)

    def _bring_up(self, replica: _Replica, index: int) -> None:
        """Wait for the replica to start, warm it up, hand it to the router and wait for its
        first passed health check; measure each phase."""
        requested, handle, replica_id = replica.since, replica.handle, replica.replica_id
        deadline = requested + self.start_timeout
        try:
            ray.get(handle.info.remote(), timeout=self.start_timeout)
            loaded = time.time()
            _warm_up(handle, replica_id, max(1.0, deadline - loaded))
            first_step = time.time()
            ray.get(self._router.add_replica.remote(replica_id, f"{self._prefix}{index}"), timeout=60)
            with self._lock:
                replica.registered = True
            self._wait_up(replica, deadline)
        except Exception as err:  # noqa: BLE001 - a start that failed is reported and undone
            self._abandon(replica, err)
            return
        ready = time.time()
        cold = ColdStart(replica_id, requested, loaded - requested, first_step - requested, ready - requested)
        with self._lock:
            replica.state, replica.since = SERVING, ready
            self._cold_starts.append(cold)
            self._unsent[1].append(cold)
        self._telemetry.on_cold_start(cold, None)

    def _finish_start(self, replica: _Replica) -> None:
        """A replica the router held starting when this controller started: serving once its
        health check passes (its cold start was not seen here, so none is recorded)."""
        try:
            self._wait_up(replica, replica.since + self.start_timeout)
        except Exception as err:  # noqa: BLE001 - a start that failed is reported and undone
            self._abandon(replica, err)
            return
        with self._lock:
            replica.state, replica.since = SERVING, time.time()

    def _wait_up(self, replica: _Replica, deadline: float) -> None:
        if wait_until_up(self._router, [replica.replica_id], deadline, time.time):
            raise ClusterError(f"no passed health check within {self.start_timeout:g} s")

    def _abandon(self, replica: _Replica, err: Exception) -> None:
        """A start that failed: reported, its actor stopped, the router and this table rid of it."""
        self._error(f"{replica.replica_id} did not start: {type(err).__name__}: {str(err)[:200]}")
        ray.kill(replica.handle)
        self._router.remove_replica.remote(replica.replica_id)
        with self._lock:
            self._replicas.pop(replica.replica_id, None)

    def _drain_one(self, replica: _Replica) -> None:
        """Drain the replica (see the module docstring), then have the router forget it."""
        try:
            counts = self._drain(self._router, {replica.replica_id: replica.handle}, self.config.drain_timeout_s)
            with self._lock:
                for done in counts.values():
                    self._drained_finished += done.get("finished", 0)
                    self._drained_moved += done.get("migrated", 0)
                    self._drained_kv_moved += done.get("kv_moved", 0)
            ray.get(self._router.remove_replica.remote(replica.replica_id), timeout=60)
        except Exception as err:  # noqa: BLE001 - reported; the replica is gone from this table either way
            self._error(f"{replica.replica_id} drain: {type(err).__name__}: {str(err)[:200]}")
        with self._lock:
            self._replicas.pop(replica.replica_id, None)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        threading.Thread(target=target, args=args, daemon=True, name=f"slotserve-{target.__name__}").start()

    def _error(self, message: str) -> None:
        with self._lock:
            self._errors.append(f"{time.strftime('%H:%M:%S')} {message}")


def wait_until_up(
    router: ActorHandle, replica_ids: list[str], deadline: float, clock: Callable[[], float] = time.monotonic
) -> list[str]:
    """Ask the router until it routes to every one of `replica_ids` (its first health check
    passed) or `clock()` is past `deadline`; the replicas still down then (empty: all up). How
    `cluster.deploy` waits for a cluster's first replicas and this controller for each it adds."""
    waiting = replica_ids
    while waiting := [r for r in waiting if not ray.get(router.is_up.remote(r), timeout=60)]:
        if clock() > deadline:
            return waiting
        time.sleep(0.05)
    return []


def _warm_up(handle: ActorHandle, replica_id: str, timeout: float) -> None:
    """One one-token request straight to the replica, before it knows the router: its first
    step (kernels built, caches allocated) is paid here, not by a user's request. Its id marks
    it a probe's, so live metrics count it apart from any run. It runs as the only request to
    come, then the replica is given back a fresh one's word (more may come) before the router
    hears of it: the router passes on the driver's word, when it has one."""
    handle.set_arrivals_done.remote(True)  # before the submission: one caller's calls arrive in order
    stream = handle.events.remote(WARMUP_SUBSCRIBER)
    request_id = f"{PROBE_REQUEST_PREFIX}warmup-{replica_id}"
    ray.get(handle.submit.remote(WARMUP_SUBSCRIBER, [1], SamplingParams(max_tokens=1), request_id), timeout=timeout)
    try:
        for ref in stream:
            events = ray.get(ref, timeout=timeout)
            ended = [e for e in events if e.request_id == request_id and e.finished]
            if ended:
                if ended[0].error:
                    raise ClusterError(f"warm-up request failed: {ended[0].error}")
                break
    finally:
        handle.close_events.remote(WARMUP_SUBSCRIBER)
    ray.get(handle.set_arrivals_done.remote(False), timeout=timeout)


def autoscaler_status(timeout: float = 10.0) -> AutoscalerStatus | None:
    """The running controller's status, or None when the cluster is not autoscaled."""
    try:
        controller = ray.get_actor(AUTOSCALER_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
    return ray.get(controller.status.remote(), timeout=timeout)
