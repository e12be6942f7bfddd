"""`slotserve up`: start the store, the replicas and the router on a Ray cluster."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import common
from protocol.errors import SlotServeError


def run(args: argparse.Namespace) -> int:
    from cluster.deploy import ensure_ray, start_cluster
    from metrics.definitions import SLO

    spec = common.cluster_spec(args).model_copy(update={"slo": SLO(args.slo_ttft, args.slo_tpot)})
    ensure_ray(args.address, start_local=True)
    if router_answers():
        raise SlotServeError(
            "a slotserve cluster is already running on this Ray cluster (`slotserve status` shows it): "
            "`slotserve down` first"
        )
    model = common.model_label(spec.replica)
    print(
        f"starting {spec.num_replicas} replicas ({model}, "
        f"{spec.replica.engine.policy} batching) and the router ({spec.routing_policy}) ...",
        flush=True,
    )
    start_cluster(spec, detached=True)
    print(f"slotserve is up; metrics store: {Path(spec.store_path).resolve()}")
    print_metrics_hint()
    return 0


def router_answers() -> bool:
    """Whether a slotserve router runs here and answers (one that died for good is recovered by
    `start_cluster`, its live replicas and store kept)."""
    import ray

    from cluster.connection import ClusterError, router_handle

    try:
        ray.get(router_handle().status.remote(), timeout=30)
    except (ClusterError, ray.exceptions.RayError):
        return False
    return True


def print_metrics_hint() -> None:
    """Where live metrics are served, and the commands that start Prometheus and Grafana on them."""
    import ray

    from cluster.prometheus_exporters import write_service_discovery
    from dashboards.build import HERE, prometheus_config

    discovery = write_service_discovery()
    config = discovery.with_name("slotserve_prometheus.yml")
    config.write_text(prometheus_config(str(discovery)))
    ports = ", ".join(
        f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes() if n["Alive"]
    )
    print(f"live metrics (Prometheus format, names ray_slotserve_*): {ports}; service discovery: {discovery}")
    print(
        f"  Prometheus: prometheus --config.file={config} --web.listen-address=:9090 --storage.tsdb.path=results/prom"
    )
    print(
        "  Grafana:    docker run --rm --network host -e SLOTSERVE_DASHBOARDS=/var/lib/grafana/dashboards "
        f"-v {HERE}/provisioning:/etc/grafana/provisioning -v {HERE}/grafana:/var/lib/grafana/dashboards "
        "grafana/grafana"
    )
    print("  (a Grafana of your own: slotserve dashboard push --grafana URL --token TOKEN; neither: slotserve top)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    u = subparsers.add_parser(
        "up",
        help="start a router and N replicas on a Ray cluster",
        description="Start the metrics store, N replica actors and the router on the Ray cluster at "
        "--address, or on this machine (starting `ray start --head` if none runs). "
        "They keep running until `slotserve down`.",
    )
    common.address_arg(u)
    common.cluster_args(u)
    u.add_argument("--slo-ttft", type=float, default=2.0, help="SLO for live goodput: seconds to first token")
    u.add_argument("--slo-tpot", type=float, default=0.25, help="SLO for live goodput: seconds per output token")
    u.set_defaults(func=run)
