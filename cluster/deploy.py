"""Start, find and stop a slotserve cluster on Ray: a metrics store actor (pinned to this
node, where its SQLite file lives), N replica actors spread over the nodes, and the router.

`slotserve up` makes them detached, so they outlive the command; tests and one-shot runs
make them owned by the driver, so they go when it does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.client import NAMESPACE, ClusterError, connect, router_handle
from cluster.store_actor import STORE_ACTOR_NAME, StoreActor
from metrics.store import DEFAULT_STORE
from replica.actor import ReplicaActor
from replica.serving import ReplicaConfig
from router.actor import ROUTER_ACTOR_NAME, RouterActor

REPLICA_PREFIX = "slotserve-replica-"
READY_TIMEOUT = 600  # seconds: a replica converting the default model on first use takes ~40 s


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(2, gt=0, description="replica actors (each one engine)")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    routing_policy: str = "least_loaded"
    num_cpus_per_replica: float = Field(1.0, gt=0, description="Ray CPUs per replica = torch threads inside it")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="1 puts the model on a GPU")
    store_path: str = str(DEFAULT_STORE)
    seed: int = 0


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
        subprocess.run(
            [ray_cli, "start", "--head", "--disable-usage-stats", "--include-dashboard=false"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        connect("auto")
    else:
        ray.init(
            address="local", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR", include_dashboard=False
        )


def start_cluster(spec: ClusterSpec, detached: bool = False) -> Deployment:
    from router.policies import make_routing_policy

    make_routing_policy(spec.routing_policy)  # an unknown name fails here, before any actor starts
    lifetime = {"lifetime": "detached"} if detached else {}
    try:
        ray.get_actor(ROUTER_ACTOR_NAME, namespace=NAMESPACE)
        raise ClusterError("a slotserve cluster is already running here: `slotserve down` first")
    except ValueError:
        pass
    here = ray.get_runtime_context().get_node_id()
    store = StoreActor.options(
        name=STORE_ACTOR_NAME,
        namespace=NAMESPACE,
        **lifetime,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(str(Path(spec.store_path).resolve()))
    replicas = {
        f"replica-{i}": ReplicaActor.options(
            name=f"{REPLICA_PREFIX}{i}",
            namespace=NAMESPACE,
            **lifetime,
            num_cpus=spec.num_cpus_per_replica,
            num_gpus=spec.num_gpus_per_replica,
            scheduling_strategy="SPREAD",
        ).remote(f"replica-{i}", spec.replica.model_dump())
        for i in range(spec.num_replicas)
    }
    router = RouterActor.options(name=ROUTER_ACTOR_NAME, namespace=NAMESPACE, **lifetime).remote(
        replicas, spec.routing_policy, spec.seed, store
    )
    try:
        ray.get([r.attach.remote(router, store) for r in replicas.values()], timeout=READY_TIMEOUT)
    except ray.exceptions.RayError as err:
        stop_cluster()
        raise ClusterError(f"replicas failed to start: {err}") from None
    return Deployment(router, replicas, store)


def find_cluster() -> Deployment:
    router = router_handle()
    replicas = ray.get(router.replicas.remote(), timeout=60)
    return Deployment(router, replicas, ray.get_actor(STORE_ACTOR_NAME, namespace=NAMESPACE))


def stop_cluster() -> list[str]:
    """Kill every slotserve actor; returns the names it found."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith("slotserve-")
    ]
    for name in names:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    return names


def cluster_status() -> dict:
    cluster = find_cluster()
    infos = ray.get([r.info.remote() for r in cluster.replicas.values()], timeout=60)
    return {"router": ray.get(cluster.router.status.remote(), timeout=60), "replicas": infos}
