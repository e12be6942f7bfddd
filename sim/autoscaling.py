"""The simulated cluster with an autoscaling policy: the same policy objects the cluster runs
(`autoscaling.policies`), on the simulator's virtual time, with replicas that take time to
start and leave only once drained.

The cluster starts with `SimulationConfig.num_replicas` replicas serving. Every decision period
the policy is given what a controller beside the router has (`protocol.scaling.ScalingObservation`:
the router's last load report of each serving replica, the replicas starting and draining, the
arrivals since the last decision) and its decision is acted on at once:

- a replica asked for starts its cold start (`cold_start_s`: actor start, model load, first
  step) and is attached to the router only when it ends: it takes no traffic before;
- a scale-down first cancels replicas still starting (the newest first), then drains serving
  ones, the one holding fewest requests first (the newest on a tie): the router marks it down,
  so it gets no new requests, and the requests it holds run to their end there;
- a replica's replica-seconds run from the start of its cold start (the first arrival for the
  first ones) to the end of its drain (its last step), its cancellation, or the end of the run.
  The first arrival is where the report's `replica_timeline` begins too, the one time a run on
  Ray and one here both know on their own clocks.

Static provisioning is the plain simulator: `static_replica_seconds` counts its replicas over
the same span, from the first arrival to the run's last step (`run_end`); `offered_load` is what sizes it (at the
peak or the mean)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from autoscaling.policies import AutoscaleConfig, make_autoscaling_policy
from metrics.store import MetricsStore
from protocol.scaling import ArrivalWindow, ColdStart, ScalingDecision, ScalingObservation
from replica.errors import ConfigError
from replica.model.fake import CostModel
from sim.simulator import SimulationConfig, SimulationResult, Simulator, _advance
from workloads.capacity import Capacity
from workloads.workload import Workload


@dataclass
class ReplicaSpan:
    """One replica's life: asked for at `requested`, serving from `ready` (None: cancelled
    while starting), draining from `drain_started`, gone at `ended` (None while it lives)."""

    replica_id: str
    requested: float
    ready: float | None = None
    drain_started: float | None = None
    ended: float | None = None

    @property
    def seconds(self) -> float:
        if self.ended is None:
            raise ValueError(f"replica {self.replica_id} has not ended; finish the run first")
        return self.ended - self.requested


@dataclass
class ScalingRecord:
    """What an autoscaled run did with its replicas, whichever model of a replica ran it (this
    module's engines, or `sim.slot_queue`'s queues for days on hundreds of replicas)."""

    autoscale: AutoscaleConfig
    cold_start_s: float
    decisions: list[ScalingDecision]
    spans: list[ReplicaSpan]
    end: float  # the run's last step (`run_end`)

    @property
    def replica_seconds(self) -> float:
        return sum(s.seconds for s in self.spans)

    @property
    def scale_events(self) -> int:
        """Decisions that changed the replica count."""
        return sum(1 for d in self.decisions if d.change)

    @property
    def mean_replicas(self) -> float:
        return self.replica_seconds / self.end if self.end > 0 else 0.0

    @property
    def peak_replicas(self) -> int:
        """The most replicas alive (starting, serving or draining) at once."""
        edges = sorted([(s.requested, 1) for s in self.spans] + [(s.ended, -1) for s in self.spans])
        alive = peak = 0
        for _, step in edges:
            alive += step
            peak = max(peak, alive)
        return peak


@dataclass
class AutoscalingResult(ScalingRecord):
    simulation: SimulationResult


@dataclass
class _Window:
    start: float = 0.0
    seen: int = 0  # arrivals admitted before this window began


class AutoscalingSimulator(Simulator):
    """`AutoscalingSimulator(workload, config, autoscale, cost, capacity).run()`, then
    `scaling_result(simulation_result)`; `simulate()` does both. `capacity` is one
    replica's (`measure_capacity` with one replica), which `queue_slo` and `predictive` price
    work with."""

    _ONE_ROUTER = True  # replicas are added to, drained from and removed from the one router

    def __init__(
        self,
        workload: Workload,
        config: SimulationConfig,
        autoscale: AutoscaleConfig,
        cost: CostModel | None = None,
        capacity: Capacity | None = None,
        cold_start_s: float = 10.0,
        check_invariants: bool = False,
        *,
        keep_records: bool = True,
    ):
        if not autoscale.min_replicas <= config.num_replicas <= autoscale.max_replicas:
            raise ConfigError(
                f"num_replicas {config.num_replicas} must lie within the autoscaling bounds "
                f"[{autoscale.min_replicas}, {autoscale.max_replicas}]"
            )
        if cold_start_s < 0:
            raise ConfigError(f"cold_start_s must be >= 0, got {cold_start_s}")
        super().__init__(workload, config, cost, check_invariants, keep_records=keep_records)
        self.autoscale = autoscale
        self.cold_start_s = cold_start_s
        self.policy = make_autoscaling_policy(autoscale, self.clock, capacity)
        self.scaling_decisions: list[ScalingDecision] = []
        first = min((r.arrival for r in workload.requests), default=0.0)
        self.spans = {r.replica_id: ReplicaSpan(r.replica_id, first, first) for r in self.replicas}
        self._starting: list[str] = []  # in the order asked for: equal cold starts end in that order
        self._draining: set[str] = set()
        self._measured_cold_start = False
        self._next_decision = autoscale.period_s
        self._window = _Window()

    # ---- the timers (hooks of Simulator's event loop) ------------------------------------
    def _next_timer(self) -> float:
        ready = [self.spans[rid].requested + self.cold_start_s for rid in self._starting[:1]]
        return min([self._next_decision, *ready])

    def _run_timers(self, now: float) -> None:
        while self._starting and self.spans[self._starting[0]].requested + self.cold_start_s <= now:
            self._attach(self._starting.pop(0), now)
        self._retire_drained()
        if now >= self._next_decision:
            decision = self.policy.decide(self._observe(now))
            self.scaling_decisions.append(decision)
            if decision.change > 0:
                self._start(decision.change, now)
            elif decision.change < 0:
                self._shrink(-decision.change, now)
            while self._next_decision <= now:
                self._next_decision += self.autoscale.period_s

    def _observe(self, now: float) -> ScalingObservation:
        reports = tuple(
            v.report
            for v in self.router.load.views(now)
            if v.replica_id not in self.router.down and v.report is not None
        )
        serving = len(self.router.replica_ids) - len(self._draining)
        cold_start = self.cold_start_s if self._measured_cold_start else 0.0  # as on Ray: known once one started
        return ScalingObservation(
            serving, reports, self._arrivals_since(now), len(self._starting), len(self._draining), cold_start
        )

    def _arrivals_since(self, now: float) -> ArrivalWindow:
        """The requests admitted since the last decision (the newest entries of the arrivals)."""
        fresh = len(self._arrivals) - self._window.seen
        prompt = output = 0
        for arrival, _ in zip(reversed(self._arrivals.values()), range(fresh)):
            prompt += arrival.spec.prompt_len
            output += arrival.spec.output_len
        window = ArrivalWindow(self._window.start, now, fresh, prompt, output)
        self._window = _Window(now, len(self._arrivals))
        return window

    # ---- acting on a decision ------------------------------------------------------------
    def _start(self, count: int, now: float) -> None:
        for _ in range(count):
            rid = f"r{len(self.spans)}"
            self.spans[rid] = ReplicaSpan(rid, now)
            self._starting.append(rid)

    def _attach(self, replica_id: str, now: float) -> None:
        """The cold start ended: the replica reports and takes traffic from now on."""
        replica = self._make_replica(len(self.replicas), replica_id)
        _advance(replica.clock, now)
        replica.engine.set_arrivals_done(self._arrivals_done)
        self.replicas.append(replica)
        self._by_id[replica_id] = replica
        self._track_steps(replica_id)
        self.router.add_replica(replica_id)
        # the router's bound over all replicas grows with them (it is set from the first ones)
        self.router.max_in_flight = max(
            self.router.max_in_flight, self.router.max_in_flight_per_replica * len(self.router.replica_ids)
        )
        self.spans[replica_id].ready = now
        self._measured_cold_start = True
        self._report(replica, force=True)

    def _shrink(self, count: int, now: float) -> None:
        while count and self._starting:
            span = self.spans[self._starting.pop()]
            span.ended = now
            count -= 1
        attached = set(self.router.replica_ids) - self._draining
        serving = [r for r in self.replicas if r.replica_id in attached]
        serving.sort(key=lambda r: (len(r.engine.requests), -r.index))
        for replica in serving[:count]:
            self.router.mark_down(replica.replica_id, "draining")
            self._draining.add(replica.replica_id)
            self.spans[replica.replica_id].drain_started = now
        self._retire_drained()

    def _retire_drained(self) -> None:
        """Drained replicas whose last request has finished leave, at the end of their last step."""
        for rid in sorted(self._draining):
            replica = self._by_id[rid]
            if replica.busy or replica.engine.has_unfinished:
                continue
            span = self.spans[rid]
            span.ended = max(span.drain_started, self._step_ends.get(rid, span.drain_started))
            self._draining.discard(rid)
            self.router.remove_replica(rid)

    # ---- the result ----------------------------------------------------------------------
    def simulate(self) -> AutoscalingResult:
        """Run the workload through the autoscaled cluster and account its replica-seconds."""
        return self.scaling_result(self.run())

    def scaling_result(self, result: SimulationResult) -> AutoscalingResult:
        """The run's scaling record; replicas still alive end at the run's end."""
        self._retire_drained()
        end = run_end(result)
        for span in self.spans.values():
            if span.ended is None:
                span.ended = end
        return AutoscalingResult(
            self.autoscale, self.cold_start_s, self.scaling_decisions, list(self.spans.values()), end, result
        )


def record_autoscaling(store: MetricsStore, run_id: int, result: AutoscalingResult) -> None:
    """Write a simulated run's scaling decisions and its started replicas' cold starts (each
    `cold_start_s`, in every phase) to the store's `scaling` and `cold_starts` tables, as the
    cluster's controller does."""
    store.add_scaling(run_id, [asdict(d) for d in result.decisions])
    started = [s for s in result.spans if s.ready is not None and s.ready > s.requested]
    cold = result.cold_start_s
    store.add_cold_starts(run_id, [asdict(ColdStart(s.replica_id, s.requested, cold, cold, cold)) for s in started])


def run_end(result: SimulationResult) -> float:
    """When the run's last step ended (or its last request, if that is later): the span over
    which every replica is counted."""
    return max([0.0, *result.step_ends.values(), *(t.finish_time for t in result.traces)])


def static_replica_seconds(result: SimulationResult) -> float:
    """Replica-seconds of a static cluster: every replica from the first arrival to the run's end."""
    first = min((t.arrival for t in result.traces), default=0.0)
    return result.config.num_replicas * (run_end(result) - first)


def offered_load(workload: Workload, capacity: Capacity, window_s: float | None) -> float:
    """Replicas kept exactly busy by the workload: over its busiest `window_s` (None: its whole span)."""
    span = max(r.arrival for r in workload.requests)
    if window_s is None:
        return sum(capacity.work_seconds(r.prompt_len, r.output_len) for r in workload.requests) / span
    windows = [0.0] * (int(span // window_s) + 1)
    for r in workload.requests:
        windows[int(r.arrival // window_s)] += capacity.work_seconds(r.prompt_len, r.output_len)
    return max(windows) / window_s
