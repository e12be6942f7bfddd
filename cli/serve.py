"""`slotserve serve`: the OpenAI-compatible HTTP API in front of a slotserve cluster.

It joins the slotserve cluster running on the Ray cluster (or starts one, owned by this
process, as `slotserve up` would with the same options), opens a run in the metrics store,
and starts the ingress processes (`cluster.http.ingress_actor`: one per node, or
`--ingress-replicas K` on this one, all on the same port) that serve HTTP until Ctrl-C or
SIGTERM, which stops them and closes the run (so `slotserve report` reads the live traffic)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading

from cli import common

API_KEY_ENV = "SLOTSERVE_API_KEY"


def run(args: argparse.Namespace) -> int:
    from cluster.deploy import ensure_ray, find_cluster, start_cluster
    from cluster.http.ingress_actor import IngressConfig, start_ingresses, stop_ingresses
    from cluster.http.server import open_run, replica_info

    if args.flow is not None and args.ingress_routing == "local":
        raise SystemExit("--flow holds requests at the router actor, so it needs --ingress-routing actor")
    flow = common.flow_config(args.flow)
    ensure_ray(args.address, start_local=False)
    if common.running_cluster(args.address):
        deployment = find_cluster()
        note = "; --flow gives only its tenants' API keys here: the router keeps its own flow control" if flow else ""
        print(f"joined the slotserve cluster running on this Ray cluster{note}", flush=True)
    else:
        spec = common.cluster_spec(args)
        model = common.model_label(spec.replica)
        print(f"starting {spec.num_replicas} replicas ({model}) and the router ({spec.routing_policy}) ...", flush=True)
        deployment = start_cluster(spec)
    info = replica_info(deployment)
    recorder = open_run(deployment, info, args.run_name, {"host": args.host, "port": args.port})
    config = IngressConfig(
        host=args.host,
        port=args.port,
        served_name=args.served_model_name,
        api_key=args.api_key,
        tenant_keys={} if flow is None else flow.tenant_keys(),
        run_id=recorder.run_id,
        routing=args.ingress_routing,
    )
    ingresses = start_ingresses(config, args.ingress_replicas)
    print(
        f"serving the OpenAI API of model `{args.served_model_name or info.model}` at "
        f"http://{args.host}:{args.port}/v1 from {len(ingresses)} ingress process(es) "
        f"({'API key required' if args.api_key or config.tenant_keys else 'no API key'}); recording run "
        f"{recorder.run_id}; Ctrl-C stops",
        flush=True,
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    recorded = stop_ingresses(ingresses)
    asyncio.run(recorder.close())
    print(f"run {recorder.run_id} closed with {recorded} requests")
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
    s.add_argument(
        "--ingress-replicas",
        type=int,
        default=None,
        metavar="K",
        help="ingress processes on this node, all on --port (SO_REUSEPORT) (default: one on every node)",
    )
    s.add_argument(
        "--ingress-routing",
        choices=["actor", "local"],
        default="actor",
        help="where each ingress routes: ask the router actor, or route itself from the router's view "
        "of every replica's load and K/V events, as each Ray Serve proxy routes",
    )
    common.cluster_args(s)
    s.set_defaults(func=run)
