"""The HTTP ingress as Ray actors, several per cluster, as Ray Serve runs a proxy on every
node: each is a process of its own serving the OpenAI API on the same port (SO_REUSEPORT: the
kernel spreads connections over the ingresses of a node), with its own Python client, so no
one process is every request's front door. Tokens stream from each replica to the ingress that
holds the caller's connection; nothing on the token path goes through the router.

Ray restarts an ingress that dies (`max_restarts`): its callers see their connections close
(never a partial answer passed off as whole: a non-streamed answer is written at once, a
stream ends without its `[DONE]`), their requests are aborted on the replicas as their event
streams close, and callers of the other ingresses see nothing. The command that started them
(`slotserve serve`) opens and closes the run every ingress records into."""

from __future__ import annotations

import asyncio
import os
import threading

import ray
from pydantic import BaseModel

from cluster.client import Client
from cluster.connection import NAMESPACE
from cluster.deploy import find_cluster
from cluster.http.ingress import Ingress
from cluster.http.recorder import RunRecorder
from cluster.http.server import http_server, listening_socket, replica_info, serve_http, served_model

INGRESS_ACTOR_PREFIX = "slotserve-ingress"
START_TIMEOUT = 120.0  # seconds an ingress gets to load its tokenizer and listen


class IngressConfig(BaseModel):
    """What every ingress of a cluster serves with: where it listens, the model name clients
    send, the API key, the run it records into, and how its client routes."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    api_key: str | None = None
    tenant_keys: dict[str, str] = {}  # API keys of flow control's tenants -> tenant
    run_id: int
    routing: str = "actor"


class IngressStatus(BaseModel):
    name: str
    node_id: str
    pid: int
    recorded: int
    restarted: bool  # Ray restarted this ingress after it died


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class IngressActor:
    """One ingress process: uvicorn on its own thread and event loop (uvloop), serving the app
    of `cluster.http.app` over a client of the cluster."""

    def __init__(self, name: str, config: IngressConfig):
        import uvloop

        self.name = name
        deployment = find_cluster()
        model = served_model(replica_info(deployment), config.served_name)
        recorder = RunRecorder(deployment.store, [], config.run_id)
        self.ingress = Ingress(Client(routing=config.routing), model, recorder)
        self.server = http_server(self.ingress, config.host, config.port, config.api_key, config.tenant_keys)
        sock = listening_socket(config.host, config.port, reuse_port=True)
        self._thread = threading.Thread(
            target=uvloop.run, args=(serve_http(self.ingress, self.server, sock, end_run=False),), daemon=True
        )
        self._thread.start()

    def status(self) -> IngressStatus:
        """Once it listens: which process it is and what it has recorded."""
        context = ray.get_runtime_context()
        return IngressStatus(
            name=self.name,
            node_id=context.get_node_id(),
            pid=os.getpid(),
            recorded=self.ingress.recorder.recorded,
            restarted=context.was_current_actor_reconstructed,
        )

    async def wait_started(self) -> bool:
        while not self.server.started:
            if not self._thread.is_alive():
                return False
            await asyncio.sleep(0.05)
        return True

    def stop(self) -> int:
        """Stop serving (open requests finish first), send the rows recorded; returns their count."""
        self.server.should_exit = True
        self._thread.join(timeout=60)
        return self.ingress.recorder.recorded


def ingress_nodes(count: int | None) -> list[str]:
    """The node of each ingress: one per alive node (None), or `count` on this node."""
    if count is None:
        return [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    return [ray.get_runtime_context().get_node_id()] * count


def start_ingresses(config: IngressConfig, count: int | None = None) -> dict[str, object]:
    """Start the ingresses (one per node, or `count` on this one) and wait until each listens."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actors = {}
    for i, node in enumerate(ingress_nodes(count)):
        name = f"{INGRESS_ACTOR_PREFIX}-{i}"
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        actors[name] = IngressActor.options(name=name, namespace=NAMESPACE, scheduling_strategy=strategy).remote(
            name, config
        )
    started = ray.get([a.wait_started.remote() for a in actors.values()], timeout=START_TIMEOUT)
    if not all(started):
        failed = [name for name, ok in zip(actors, started) if not ok]
        stop_ingresses(actors)
        raise RuntimeError(f"ingress {', '.join(failed)} could not listen on {config.host}:{config.port}")
    return actors


def stop_ingresses(actors: dict[str, object]) -> int:
    """Stop every ingress (their rows sent), then their actors; returns the requests recorded."""
    recorded = 0
    for count in ray.get([a.stop.remote() for a in actors.values()], timeout=120):
        recorded += count
    for actor in actors.values():
        ray.kill(actor, no_restart=True)
    return recorded
