"""`slotserve serve`: the OpenAI-compatible HTTP API in front of a slotserve cluster.

It joins the slotserve cluster running on the Ray cluster (or starts one, owned by this
process, as `slotserve up` would with the same options), opens a run in the metrics store,
and serves HTTP from this process until Ctrl-C or SIGTERM, which closes the run (so
`slotserve report` reads the live traffic) and stops a cluster it started."""

from __future__ import annotations

import argparse
import os
import time

from cli import common

API_KEY_ENV = "SLOTSERVE_API_KEY"


def load_tokenizer(model: str):
    """The served model's tokenizer from its local directory (never a download); the seeded
    random GPT-2 uses the default model's, as its replicas do."""
    from transformers import AutoTokenizer

    from replica.model.loader import default_model_dir, resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model) or default_model_dir())


def build_ingress(deployment, served_name: str | None = None, run_name: str = "serve", config: dict | None = None):
    """The ingress of a running cluster: its model as the replicas serve it, a Python client,
    and a new run in the store (the caller closes it with `ingress.recorder.close()`)."""
    import ray

    from cluster.client import Client
    from cluster.http.ingress import Ingress, ServedModel
    from cluster.http.recorder import RunRecorder

    replicas = list(deployment.replicas.values())
    info = ray.get(replicas[0].info.remote(), timeout=60)
    routing = ray.get(deployment.router.status.remote(), timeout=60).get("policy", "unknown")
    model = ServedModel(
        served_name or info.model,
        None if info.fake else load_tokenizer(info.model),
        info.max_request_tokens,
        int(time.time()),
    )
    run_config = {**(config or {}), "ingress": "http", "replica": info.config}
    recorder = RunRecorder.open(
        deployment.store, deployment.router, replicas, run_name, run_config, info.policy, routing, 0
    )
    return Ingress(Client(), model, recorder)


def http_server(ingress, host: str, port: int, api_key: str | None):
    """The uvicorn server of the ingress's app (`server.should_exit = True` stops it)."""
    import uvicorn

    from cluster.http.app import create_app

    config = uvicorn.Config(create_app(ingress, api_key), host=host, port=port, log_level="warning", lifespan="off")
    return uvicorn.Server(config)


async def serve_http(ingress, server) -> None:
    """Serve until the server is told to stop (SIGINT, SIGTERM), then close the run."""
    ingress.recorder.start()
    try:
        await server.serve()
    finally:
        await ingress.recorder.close()
        ingress.client.close()


def run(args: argparse.Namespace) -> int:
    import uvloop  # uvicorn's fast event loop (its `standard` extra)

    from cluster.deploy import ensure_ray, find_cluster, start_cluster

    ensure_ray(args.address, start_local=False)
    if common.running_cluster(args.address):
        deployment = find_cluster()
        print("joined the slotserve cluster running on this Ray cluster", flush=True)
    else:
        spec = common.cluster_spec(args)
        model = common.model_label(spec.replica)
        print(f"starting {spec.num_replicas} replicas ({model}) and the router ({spec.routing_policy}) ...", flush=True)
        deployment = start_cluster(spec)
    ingress = build_ingress(deployment, args.served_model_name, args.run_name, {"host": args.host, "port": args.port})
    print(
        f"serving the OpenAI API of model `{ingress.model.name}` at http://{args.host}:{args.port}/v1 "
        f"({'API key required' if args.api_key else 'no API key'}); recording run {ingress.recorder.run_id}; "
        "Ctrl-C stops",
        flush=True,
    )
    uvloop.run(serve_http(ingress, http_server(ingress, args.host, args.port, args.api_key)))
    print(f"run {ingress.recorder.run_id} closed with {ingress.recorder.recorded} requests")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API (starting a cluster if none runs)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics over HTTP "
        "in front of the slotserve cluster on the Ray cluster at --address (or this machine's); with none "
        "running, start one from the cluster options below, owned by this command. Every request is recorded "
        "in the metrics store under one run, closed on exit (a refused bad request as `invalid`). Sampling "
        "defaults are OpenAI's: a request without `temperature` samples at 1.0 (the CLI and the Python client "
        "default to 0, greedy).",
    )
    common.address_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer KEY` on every route but /health (default: ${API_KEY_ENV})",
    )
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model's name)")
    s.add_argument("--run-name", default="serve", help="name of the run recorded in the store")
    common.cluster_args(s)
    s.set_defaults(func=run)
