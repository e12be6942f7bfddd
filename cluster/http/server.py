"""Serving the HTTP app: an ingress built over a running cluster (its model as the replicas
serve it, a Python client, the run its traffic is recorded under) and the uvicorn server that
answers for it, on a socket of its own or on a port several ingress processes share
(SO_REUSEPORT: the kernel spreads the connections among them, so one address scales out)."""

from __future__ import annotations

import socket
import time

import ray

from cluster.client import Client
from cluster.http.ingress import Ingress, ServedModel
from cluster.http.recorder import RunRecorder
from protocol.replicas import ReplicaInfo


def load_tokenizer(model: str):
    """The served model's tokenizer from its local directory (never a download); the seeded
    random GPT-2 uses the default model's, as its replicas do."""
    from transformers import AutoTokenizer

    from replica.model.loader import default_model_dir, resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model) or default_model_dir())


def replica_info(deployment) -> ReplicaInfo:
    """One replica's answer about itself: every replica of a cluster serves the same model."""
    return ray.get(next(iter(deployment.replicas.values())).info.remote(), timeout=60)


def served_model(info: ReplicaInfo, served_name: str | None = None) -> ServedModel:
    """What clients see of the replicas' model."""
    tokenizer = None if info.fake else load_tokenizer(info.model)
    return ServedModel(served_name or info.model, tokenizer, info.max_request_tokens, int(time.time()))


def open_run(deployment, info: ReplicaInfo, name: str, config: dict) -> RunRecorder:
    """A new run in the store for HTTP traffic, the router and replicas tagging their records
    with it (the caller closes it with `recorder.close()`)."""
    replicas = list(deployment.replicas.values())
    routing = ray.get(deployment.router.status.remote(), timeout=60).get("policy", "unknown")
    run_config = {**config, "ingress": "http", "replica": info.config}
    return RunRecorder.open(deployment.store, deployment.router, replicas, name, run_config, info.policy, routing, 0)


def build_ingress(deployment, served_name: str | None = None, run_name: str = "serve", config: dict | None = None):
    """An ingress of a running cluster in this process, recording a new run (closed by
    `serve_http` when the server stops)."""
    info = replica_info(deployment)
    return Ingress(Client(), served_model(info, served_name), open_run(deployment, info, run_name, config or {}))


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound TCP socket; with `reuse_port` others may bind the same port (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def http_server(ingress: Ingress, host: str, port: int, api_key: str | None, tenant_keys: dict[str, str] | None = None):
    """The uvicorn server of the ingress's app (`server.should_exit = True` stops it);
    `tenant_keys`: the API keys of flow control's tenants (`FlowConfig.tenant_keys`)."""
    import uvicorn

    from cluster.http.app import create_app

    config = uvicorn.Config(
        create_app(ingress, api_key, tenant_keys), host=host, port=port, log_level="warning", lifespan="off"
    )
    return uvicorn.Server(config)


async def serve_http(ingress: Ingress, server, sock: socket.socket | None = None, end_run: bool = True) -> None:
    """Serve until the server is told to stop (SIGINT, SIGTERM), then send the rows recorded
    and, with `end_run`, close the run (an ingress among several leaves that to the command
    that opened it)."""
    ingress.recorder.start()
    try:
        await server.serve(sockets=None if sock is None else [sock])
    finally:
        if end_run:
            await ingress.recorder.close()
        else:
            await ingress.recorder.flush()
        ingress.client.close()
