# Over 400 lines: the cluster spec with its checks and the start, find and stop of every actor
# it names: one lifecycle, read top to bottom.
"""Start, find and stop a slotserve cluster on Ray: a metrics store actor (pinned to this
node, where its SQLite file lives), N replica actors spread over the nodes, and the router.

`slotserve up` makes them detached, so they outlive the command; tests and one-shot runs
make them owned by the driver, so they go when it does.

Failure handling set up here: replicas are created with `max_restarts` (Ray restarts a dead
one; the router attaches it again once its health check passes), the router and the store
restart without limit, the router watches replica health every `health_period`. A cluster
that asks for more CPUs or GPUs than Ray has is refused at once instead of waiting on a
pending actor; one whose router died is recovered by `up` (live replicas and store kept). A
replica leaves by draining: no new requests, running ones finish within a timeout, the rest
move to other replicas (the decoding ones with their K/V, which it keeps until taken). With
`ClusterSpec.autoscale` a controller actor beside the router (`cluster.autoscaler`) starts and
drains replicas the same ways as the traffic changes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import ray
from pydantic import ConfigDict, Field, field_validator, model_validator
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from autoscaling.policies import AUTOSCALING_POLICIES, AutoscaleConfig
from cluster.autoscaler import AUTOSCALER_ACTOR_NAME, AutoscalerActor, autoscaler_status, wait_until_up
from cluster.connection import NAMESPACE, ClusterError, connect, router_handle, use_token_auth
from cluster.disaggregation import PoolsSpec
from cluster.prometheus_exporters import replica_telemetry, router_telemetry
from cluster.store_actor import STORE_ACTOR_NAME, StoreActor
from metrics.definitions import SLO
from metrics.live import EXPORT_INTERVAL_MS
from metrics.store import DEFAULT_STORE
from protocol import defaults
from protocol.flow import FlowConfig
from protocol.replicas import ReplicaInfo, Unreachable
from replica.serving.actor import ReplicaActor
from replica.serving.loop import DRAIN_HANDOVER_WAIT, ReplicaConfig
from router.actor import ROUTER_ACTOR_NAME, RouterActor
from router.policies import ROUTING_POLICIES
from workloads.capacity import Capacity

REPLICA_PREFIX = "slotserve-replica-"
# The replicas and the router export their live metrics at the rate the dashboards assume,
# whatever export interval the Ray cluster was started with (Ray's default is 10 s).
METRICS_RUNTIME_ENV = {"env_vars": {"RAY_metrics_report_interval_ms": str(EXPORT_INTERVAL_MS)}}
# Handles of the actors this process started and owns (not detached): Ray stops an owned actor
# once its owner holds no handle to it, and the router finds them by name, holding none of ours.
_owned: dict[str, object] = {}
# Seconds from the replicas' start to the router's first passed health check of each: a replica
# converting the default model and building its kernels on first use takes minutes on a busy machine.
READY_TIMEOUT = 600
STOP_TIMEOUT = 30.0  # seconds stop_cluster waits for the actors it killed to be gone


class ClusterSpec(PoolsSpec):
    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(2, gt=0, description="replica actors (each one engine)")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    routing_policy: str = "least_loaded"
    num_cpus_per_replica: float = Field(1.0, gt=0, description="Ray CPUs per replica = torch threads inside it")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="1 puts the model on a GPU")
    store_path: str = str(DEFAULT_STORE)
    seed: int = 0
    replica_max_restarts: int = Field(8, ge=0, description="times Ray restarts a replica that died")
    max_in_flight_per_replica: int = Field(
        defaults.MAX_IN_FLIGHT_PER_REPLICA, gt=0, description="router bound per replica; past it: overloaded"
    )
    max_in_flight: int | None = Field(None, gt=0, description="router bound in all (default: per replica x replicas)")
    health_period: float = Field(1.0, gt=0, description="seconds between the router's replica health checks")
    flow: FlowConfig | None = Field(
        None, description="the router's flow control (None: every request dispatched at once)"
    )

    @field_validator("routing_policy")
    @classmethod
    def _known_routing(cls, name: str) -> str:
        return ROUTING_POLICIES.check(name)

    slo: SLO = Field(default_factory=SLO, description="the live goodput's SLO, whose TPOT the router routes within")
    cost_scales: list[float] | None = Field(
        None,
        description="fake replicas of different speeds: replica i's step times x cost_scales[i] "
        "(repeating past the list, for replicas an autoscaler adds)",
    )
    autoscale: AutoscaleConfig | None = Field(
        None, description="grow and shrink the replicas with the traffic (cluster.autoscaler), from num_replicas"
    )
    replica_capacity: Capacity | None = Field(
        None, description="one replica's tokens/s, which the autoscaling policies that price work need"
    )

    def replica_config(self, index: int) -> ReplicaConfig:
        """What replica `replica-{index}` is started with: `replica`, in its role, at its cost scale."""
        r = self.replica
        if self.role(index) != r.role:
            r = r.model_copy(update={"role": self.role(index)})
        if self.cost_scales is None:
            return r
        scale = self.cost_scales[index % len(self.cost_scales)]
        if r.fake_cost is not None:
            return r.model_copy(update={"fake_cost": r.fake_cost.scaled(scale)})
        return r.model_copy(update={"fake_step_seconds": r.fake_step_seconds * scale})

    @model_validator(mode="after")
    def _scales_for_fakes(self) -> ClusterSpec:
        if self.cost_scales is not None and not self.replica.fake:
            raise ValueError(
                "cost_scales sets fake replicas' speeds: give a fake model (fake_cost or fake_step_seconds)"
            )
        if self.cost_scales is not None and (not self.cost_scales or min(self.cost_scales) <= 0):
            raise ValueError(f"cost_scales must be positive numbers, one per replica; got {self.cost_scales}")
        return self

    @model_validator(mode="after")
    def _autoscale_fits(self) -> ClusterSpec:
        a = self.autoscale
        if a is None:
            return self
        if not a.min_replicas <= self.num_replicas <= a.max_replicas:
            raise ValueError(
                f"num_replicas {self.num_replicas} must lie within the autoscaling bounds "
                f"[{a.min_replicas}, {a.max_replicas}]"
            )
        if AUTOSCALING_POLICIES[a.policy].needs_capacity and self.replica_capacity is None:
            raise ValueError(f"autoscaling policy {a.policy!r} prices work: give replica_capacity (one replica's)")
        return self


@dataclass
class Deployment:
    router: object
    replicas: dict[str, object]
    store: object


def ensure_ray(address: str | None, start_local: bool) -> None:
    """Connect to the cluster at `address`; with none given, to the one on this machine, or
    else start one: a persistent `ray start --head` (start_local) or one owned by this process."""
    if ray.is_initialized():
        return
    if address is not None:
        connect(address)
        return
    try:
        connect("auto")
        return
    except ClusterError:
        pass
    if start_local:
        ray_cli = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
        # Loopback: the cluster `up` makes for itself is for this machine only (Ray's own gRPC
        # ports still listen on every interface; its token auth guards them).
        subprocess.run(
            [
                ray_cli,
                "start",
                "--head",
                "--disable-usage-stats",
                "--include-dashboard=false",
                "--node-ip-address=127.0.0.1",
                "--dashboard-host=127.0.0.1",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        connect("auto")
    else:
        use_token_auth(new_cluster=True)
        ray.init(
            address="local", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR", include_dashboard=False
        )


def ray_autoscaler_limits() -> dict[str, float] | None:
    """What Ray's autoscaler may bring up in all (each node type's resources times its max
    count, as Ray tells its libraries), `{}` when an autoscaler runs whose limits Ray does not
    tell, None when none can add nodes (no autoscaling status, or one without node types)."""
    from ray._private import ray_constants
    from ray._private.state import state
    from ray.experimental.internal_kv import _internal_kv_get

    limits = state.get_max_resources_from_cluster_config()
    if limits:
        return {k: float(v) for k, v in limits.items()}
    status = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    if status is None:
        return None
    # Every Ray head runs the autoscaler's monitor; without a cluster config it names each node's
    # type after the node ("node_<id>"). Node types of other names come from a config: an
    # autoscaler that can add nodes.
    report = json.loads(status).get("autoscaler_report") or {}
    types = set(report.get("active_nodes") or {}) | set(report.get("idle_nodes") or {})
    return {} if any(not t.startswith("node_") for t in types) else None


def check_resources(spec: ClusterSpec) -> None:
    """Refuse at once a cluster Ray cannot place (a replica would wait forever as a pending
    actor), naming what was asked and what the Ray cluster has. Where Ray's autoscaler runs,
    the nodes it may add count (`ray_autoscaler_limits`): a replica that fits only there waits
    for Ray to add the node; with no limits told, nothing is refused."""
    total = ray.cluster_resources()
    asked = [
        (resource, per_replica, flag, spec.num_replicas * per_replica)
        for resource, per_replica, flag in (
            ("CPU", spec.num_cpus_per_replica, "--num-cpus"),
            ("GPU", spec.num_gpus_per_replica, "--num-gpus"),
        )
        if per_replica
    ]
    short = [a for a in asked if a[3] > total.get(a[0], 0.0) + 1e-9]
    limits = ray_autoscaler_limits() if short else None
    if limits == {}:
        return
    for resource, per_replica, flag, need in short:
        have = total.get(resource, 0.0) if limits is None else max(total.get(resource, 0.0), limits.get(resource, 0.0))
        if need > have + 1e-9:
            fit = int((have + 1e-9) // per_replica)
            where = (
                "this Ray cluster has" if limits is None else "this Ray cluster with what its autoscaler may add has"
            )
            raise ClusterError(
                f"{spec.num_replicas} replicas x {per_replica:g} {resource} need {need:g} {resource}s; "
                f"{where} {have:g}: use --replicas {fit} or a smaller {flag}, or add nodes"
            )


def _leftovers() -> dict[str, object]:
    """slotserve actors alive on the cluster, by name."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith("slotserve-"):
            try:
                found[entry["name"]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
            except ValueError:
                pass
    return found


def start_cluster(spec: ClusterSpec, detached: bool = False, ready_timeout: float = READY_TIMEOUT) -> Deployment:
    """Start the store, the replicas and the router (and the autoscaling controller), and return
    once the router routes to every replica (each has passed its first health check; the router
    holds a replica `starting` until then) and the controller answers, so a request sent the
    moment this returns is not refused for want of one up, and the controller's delays count
    from about then. A replica not up within `ready_timeout` seconds stops the cluster with an
    error naming it. If a router is already up this is an error; if only its leftovers are (the
    router died for good), they are recovered: the store and each live replica with this
    spec's config are kept, the rest started anew."""
    lifetime = {"lifetime": "detached"} if detached else {}
    leftovers = _leftovers()
    if ROUTER_ACTOR_NAME in leftovers:
        try:
            ray.get(leftovers[ROUTER_ACTOR_NAME].status.remote(), timeout=30)
            raise ClusterError("a slotserve cluster is already running here: `slotserve down` first")
        except ray.exceptions.RayError:
            ray.kill(leftovers.pop(ROUTER_ACTOR_NAME))
    check_resources(spec)
    here = ray.get_runtime_context().get_node_id()
    store = leftovers.pop(STORE_ACTOR_NAME, None) or StoreActor.options(
        name=STORE_ACTOR_NAME,
        namespace=NAMESPACE,
        **lifetime,
        max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(str(Path(spec.store_path).resolve()))
    replicas = {}
    for i in range(spec.num_replicas):
        kept = leftovers.pop(f"{REPLICA_PREFIX}{i}", None)
        if kept is not None and not _same_config(kept, spec, i):
            ray.kill(kept)
            kept = None
        replicas[f"replica-{i}"] = kept or start_replica(spec, i, detached)
    for extra in leftovers.values():  # replicas beyond this spec's count (and an old autoscaler)
        ray.kill(extra)
    router = RouterActor.options(
        name=ROUTER_ACTOR_NAME,
        namespace=NAMESPACE,
        **lifetime,
        max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),  # next to the store, off replica nodes
        runtime_env=METRICS_RUNTIME_ENV,
    ).remote(
        # By name, never by handle: actor handles among an actor's arguments live in the object
        # store, and Ray cannot restart an actor whose arguments are gone with their owner.
        {rid: f"{REPLICA_PREFIX}{rid.removeprefix('replica-')}" for rid in replicas},
        spec.routing_policy,
        spec.seed,
        STORE_ACTOR_NAME,
        max_in_flight_per_replica=spec.max_in_flight_per_replica,
        max_in_flight=spec.max_in_flight,
        health_period=spec.health_period,
        telemetry=router_telemetry(),
        pools=spec.pd_pools(),
        flow=spec.flow,
        tpot_slo=spec.slo.tpot,
    )
    deadline = time.monotonic() + ready_timeout
    try:
        ray.get([r.attach.remote(router, store) for r in replicas.values()], timeout=ready_timeout)
        _wait_until_up(router, list(replicas), deadline, ready_timeout)
    except (ray.exceptions.RayError, ClusterError) as err:
        stop_cluster(drain_timeout=0)
        raise ClusterError(f"replicas failed to start: {err}") from None
    owned = {ROUTER_ACTOR_NAME: router, STORE_ACTOR_NAME: store, **replicas}
    if spec.autoscale is not None:
        owned[AUTOSCALER_ACTOR_NAME] = AutoscalerActor.options(
            name=AUTOSCALER_ACTOR_NAME,
            namespace=NAMESPACE,
            **lifetime,
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
            runtime_env=METRICS_RUNTIME_ENV,
        ).remote(
            spec.autoscale,
            spec.replica_capacity,
            partial(start_replica, spec, detached=detached),
            drain_replicas,
            ROUTER_ACTOR_NAME,
            STORE_ACTOR_NAME,
            REPLICA_PREFIX,
        )
        try:  # up once it answers: its decisions start with its first period, not minutes later
            ray.get(owned[AUTOSCALER_ACTOR_NAME].status.remote(), timeout=ready_timeout)
        except ray.exceptions.RayError as err:
            stop_cluster(drain_timeout=0)
            raise ClusterError(f"the autoscaling controller failed to start: {err}") from None
    if not detached:
        _owned.clear()
        _owned.update(owned)
    return Deployment(router, replicas, store)


def _wait_until_up(router: ActorHandle, replica_ids: list[str], deadline: float, timeout: float) -> None:
    """Until the router routes to every replica (its first health check passed); ClusterError
    naming those still down, and why, at `deadline` (`timeout` seconds from the start)."""
    if waiting := wait_until_up(router, replica_ids, deadline):
        down = ray.get(router.status.remote(), timeout=60)["down"]
        named = ", ".join(f"{r} ({down.get(r, 'up')})" for r in waiting)
        raise ClusterError(f"{named} passed no health check within {timeout:g} s of the start")


def start_replica(spec: ClusterSpec, index: int, detached: bool) -> ActorHandle:
    """Start replica `replica-{index}` (actor `slotserve-replica-{index}`) of `spec`: how
    `start_cluster` starts its replicas and the autoscaler every one it adds. Returns at once:
    the actor answers once placed (a pending one waits for Ray to find or add room) and loaded."""
    return ReplicaActor.options(
        name=f"{REPLICA_PREFIX}{index}",
        namespace=NAMESPACE,
        **({"lifetime": "detached"} if detached else {}),
        num_cpus=spec.num_cpus_per_replica,
        num_gpus=spec.num_gpus_per_replica,
        max_restarts=spec.replica_max_restarts,
        scheduling_strategy="SPREAD",
        runtime_env=METRICS_RUNTIME_ENV,
    ).remote(f"replica-{index}", spec.replica_config(index).model_dump(), replica_telemetry(spec.replica, spec.slo))


def _same_config(replica, spec: ClusterSpec, index: int) -> bool:
    try:
        return ray.get(replica.info.remote(), timeout=30).config == spec.replica_config(index).model_dump()
    except ray.exceptions.RayError:
        return False


def find_cluster() -> Deployment:
    router = router_handle()
    replicas = ray.get(router.replicas.remote(), timeout=60)
    return Deployment(router, replicas, ray.get_actor(STORE_ACTOR_NAME, namespace=NAMESPACE))


def drain_replica(
    deployment: Deployment, replica_id: str, timeout: float = 30.0, move_kv: bool = True
) -> dict[str, int]:
    """Remove one replica gracefully (`drain_replicas`). Returns how many of its requests
    finished, how many moved, and how many of those with their K/V."""
    counts = drain_replicas(deployment.router, {replica_id: deployment.replicas[replica_id]}, timeout, move_kv)
    if replica_id not in counts:
        raise ClusterError(
            f"{replica_id} did not answer its drain within {drain_deadline(timeout, move_kv):g} s; it was stopped"
        )
    return counts[replica_id]


def drain_deadline(timeout: float, move_kv: bool) -> float:
    """Seconds `drain_replicas` waits for a replica's drain: its `timeout`, the wait for its
    hand-overs to be taken (with `move_kv`), and a minute for the calls and the flush."""
    return timeout + (DRAIN_HANDOVER_WAIT if move_kv else 0.0) + 60.0


def drain_replicas(
    router, replicas: dict[str, object], timeout: float, move_kv: bool = True
) -> dict[str, dict[str, int]]:
    """Remove replicas gracefully, all at once: the router (if there is one to tell) sends them
    nothing more, their running requests finish within `timeout` seconds, the rest go back to
    their clients to continue on other replicas; then they stop. With `move_kv` a decoding
    request moves with its K/V, fetched by the replica it moves to instead of computing its
    prompt and output again, and its replica stops only once they are taken or expired
    (`ReplicaConfig.handover_ttl`, DRAIN_HANDOVER_WAIT at most); else every moved request
    computes them again. Returns each replica's counts of finished, moved and K/V-moved
    requests (a dead replica, with nothing to drain, or one that did not answer within the
    longest a drain takes plus a minute, is left out)."""
    if router is not None:
        try:
            ray.get([router.start_drain.remote(replica_id) for replica_id in replicas], timeout=60)
        except (ray.exceptions.RayError, ValueError):
            pass  # no router to tell (or not one that knows these replicas)
    refs = {replica_id: handle.drain.remote(timeout, move_kv) for replica_id, handle in replicas.items()}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=drain_deadline(timeout, move_kv))
    counts = {}
    for replica_id, ref in refs.items():
        try:
            counts[replica_id] = ray.get(ref, timeout=0)
        except ray.exceptions.RayError:
            continue
    if any(c["migrated"] for c in counts.values()):
        time.sleep(0.5)  # the clients' moves reach the router before the replicas' handles go
    for handle in replicas.values():
        ray.kill(handle)
    return counts


def stop_cluster(drain_timeout: float = 0.0) -> list[str]:
    """Stop every slotserve actor; returns the names it found. With `drain_timeout` > 0 the
    replicas are drained first (`drain_replicas`): new requests are refused at once (no replica
    up), and the requests they hold get that long to finish (with no replica left to move to,
    what is still running then ends with an error, and no K/V are kept for a replica to take)."""
    actors = _leftovers()
    if AUTOSCALER_ACTOR_NAME in actors:  # first, so it starts and drains nothing more meanwhile
        ray.kill(actors.pop(AUTOSCALER_ACTOR_NAME))
    replicas = {
        f"replica-{name.removeprefix(REPLICA_PREFIX)}": handle
        for name, handle in actors.items()
        if name.startswith(REPLICA_PREFIX)
    }
    if drain_timeout > 0 and replicas:
        drain_replicas(actors.get(ROUTER_ACTOR_NAME), replicas, drain_timeout, move_kv=False)
    for handle in actors.values():  # a drained replica is stopped already: killing it again does nothing
        ray.kill(handle)
    _wait_gone(set(actors))
    return list(actors)


def _wait_gone(names: set[str], timeout: float = STOP_TIMEOUT) -> None:
    """Wait until no actor of `names` is alive: `ray.kill` returns before the actor is gone, and
    a start (or stop) right after would find it still there as a leftover."""
    deadline = time.monotonic() + timeout
    while names & _leftovers().keys() and time.monotonic() < deadline:
        time.sleep(0.05)


def cluster_status(timeout: float = 10.0) -> dict:
    """The router's status, each replica's info and the autoscaler's status (None when not
    autoscaled); a replica that is dead or does not answer within `timeout` is listed as
    Unreachable instead of failing the whole status."""
    cluster = find_cluster()
    refs = {replica_id: handle.info.remote() for replica_id, handle in cluster.replicas.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    infos: list[ReplicaInfo | Unreachable] = []
    for replica_id, ref in refs.items():
        if ref not in ready:
            infos.append(Unreachable(replica_id, f"no answer within {timeout:g} s", time.time()))
            continue
        try:
            infos.append(ray.get(ref))
        except ray.exceptions.RayError as err:
            why = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            infos.append(Unreachable(replica_id, why, time.time()))
    return {
        "router": ray.get(cluster.router.status.remote(), timeout=60),
        "replicas": infos,
        "autoscaler": autoscaler_status(timeout),
    }
