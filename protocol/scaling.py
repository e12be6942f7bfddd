"""What an autoscaling policy is told and what it answers: the cluster as the router sees it at
one decision (`ScalingObservation`: the serving replicas' last load reports, how many replicas
are starting or draining, the arrivals since the last decision) and the decision itself
(`ScalingDecision`, with its reason and the inputs it was made from, so a run can show why the
cluster grew or shrank). Plain frozen dataclasses: the simulator and a controller actor beside
the router build the same observation, and a decision travels to the store as it is. On Ray,
the controller (`cluster.autoscaler`) reads the router's `ScalingView`, measures each new
replica's `ColdStart` and answers `AutoscalerStatus` (every replica's `ReplicaState`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import LoadReport


@dataclass(frozen=True)
class ArrivalWindow:
    """The requests that arrived in [start, end): how many, and their prompt and expected output
    tokens (the requested `max_tokens`, or a router's estimate where outputs are not known)."""

    start: float
    end: float
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class ScalingObservation:
    """The cluster at one decision. `serving` replicas take traffic; `reports` holds the last
    load report of each that has sent one. `starting` replicas were asked for and take traffic
    once their cold start ends; `draining` ones take nothing new and leave once what they hold
    has finished. Policies count `current` (serving + starting) as the cluster's size, so they
    do not ask again for replicas already on their way. `cold_start_s` is how long the last
    replica took from being asked for to taking traffic (0 before one has started): a replica
    asked for now serves no sooner, so a policy that looks ahead looks at least that far."""

    serving: int
    reports: tuple[LoadReport, ...]
    arrivals: ArrivalWindow
    starting: int = 0
    draining: int = 0
    cold_start_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.reports) > self.serving:
            raise ValueError(f"{len(self.reports)} load reports for {self.serving} serving replicas")

    @property
    def current(self) -> int:
        return self.serving + self.starting

    @property
    def running(self) -> int:
        return sum(r.running for r in self.reports)

    @property
    def queued(self) -> int:
        return sum(r.queue_depth for r in self.reports)

    @property
    def ongoing(self) -> int:
        """Requests running or waiting on the serving replicas (Ray Serve's "ongoing requests")."""
        return self.running + self.queued

    @property
    def slots_per_replica(self) -> int:
        """Slots of one replica (the largest reported; 0 before any report)."""
        return max((r.num_slots for r in self.reports), default=0)


@dataclass(frozen=True)
class ScalingDecision:
    """One decision of an autoscaling policy: at `time` the cluster had `current` replicas
    (serving + starting) and should have `desired`. `reason` says which rule set the number (a
    bound or cooldown that held it back included); `inputs` are the figures it was made from."""

    time: float
    policy: str
    current: int
    desired: int
    reason: str
    inputs: dict[str, float] = field(default_factory=dict)

    @property
    def change(self) -> int:
        """Replicas to start (positive) or drain (negative)."""
        return self.desired - self.current


@dataclass(frozen=True)
class ScalingView:
    """What the router actor tells the autoscaling controller each decision period
    (`RouterActor.scaling_view`): every replica's last load report, the replicas marked down
    (with why), the requests it has in flight on each, the new requests routed since the last
    view, and the run being recorded (None outside a run)."""

    reports: dict[str, LoadReport]
    down: dict[str, str]
    in_flight: dict[str, int]
    arrivals: ArrivalWindow
    run_id: int | None = None


@dataclass(frozen=True)
class ColdStart:
    """One replica's start, in seconds from the controller's request (`requested`, wall
    clock): `loaded_s` when the actor answered (placed on a node, started, model loaded),
    `first_step_s` when its first step (one warm-up request) returned a token, `ready_s` when
    the router's health check passed and it took traffic."""

    replica_id: str
    requested: float
    loaded_s: float
    first_step_s: float
    ready_s: float


@dataclass(frozen=True)
class ReplicaState:
    """A replica as the controller sees it: `state` is `starting` (asked for, not yet taking
    traffic), `serving` or `draining` (taking nothing new, leaving once what it holds is done)."""

    replica_id: str
    state: str
    since: float


@dataclass(frozen=True)
class AutoscalerStatus:
    """The controller's read-out (`slotserve status`, `slotserve top`): its policy and bounds,
    every replica's state, the last decision, and the cold starts measured so far."""

    policy: str
    min_replicas: int
    max_replicas: int
    replicas: list[ReplicaState]
    last_decision: ScalingDecision | None
    decisions: int
    scale_ups: int
    scale_downs: int
    cold_starts: list[ColdStart]
    drained_finished: int  # requests of drained replicas that finished there
    drained_moved: int  # and those handed back to their clients to resume elsewhere
    drained_kv_moved: int  # of those, the ones handed over with their K/V (the receiver may still compute them again)
    errors: list[str]
