"""`slotserve up`: start the store, the replicas and the router on a Ray cluster (and, with
`--autoscale POLICY`, the controller that grows and shrinks the replicas with the traffic)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import common
from protocol import defaults
from protocol.errors import SlotServeError


def run(args: argparse.Namespace) -> int:
    from cluster.deploy import ensure_ray, start_cluster
    from metrics.definitions import SLO

    spec = common.cluster_spec(args).model_copy(update={"slo": SLO(args.slo_ttft, args.slo_tpot)})
    if args.autoscale is not None:
        spec = autoscaled(spec, args)
    if args.prefill_replicas or args.decode_replicas:
        spec = disaggregated(spec, args)
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
    if spec.prefill_replicas:
        print(
            f"  {spec.prefill_replicas} prefill and {spec.decode_replicas} decode replicas; "
            f"P/D decider {spec.pd_decider} (threshold {spec.pd_threshold} uncached prompt tokens, "
            f"K/V priced at {spec.kv_link.bandwidth_bytes_per_s:.3g} B/s + {spec.kv_link.latency_s:g} s)",
            flush=True,
        )
    start_cluster(spec, detached=True)
    if spec.autoscale is not None:
        a = spec.autoscale
        print(f"autoscaling: {a.policy} between {a.min_replicas} and {a.max_replicas} replicas, every {a.period_s:g} s")
    print(f"slotserve is up; metrics store: {Path(spec.store_path).resolve()}")
    print_metrics_hint()
    return 0


def autoscaled(spec, args: argparse.Namespace):
    """The spec with its autoscaler, starting at --min-replicas (checked as a whole: bounds,
    the policy's parameters, the capacity a policy that prices work needs)."""
    from pydantic import ValidationError

    from autoscaling.policies import AutoscaleConfig
    from cluster.deploy import ClusterSpec
    from workloads.capacity import Capacity

    params = {}
    for item in args.autoscale_param:
        key, sep, value = item.partition("=")
        try:
            params[key] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"--autoscale-param takes KEY=NUMBER, got {item!r}")
    capacity = None
    if args.replica_capacity:
        if len(args.replica_capacity) > 2:
            raise SystemExit("--replica-capacity takes DECODE_TOKENS_PER_S [PREFILL_TOKENS_PER_S]")
        capacity = Capacity(*args.replica_capacity)
    try:
        autoscale = AutoscaleConfig(
            policy=args.autoscale,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            cooldown_s=args.cooldown,
            period_s=args.autoscale_period,
            drain_timeout_s=args.drain_timeout,
            params=params,
        )
        return ClusterSpec(
            **{**dict(spec), "num_replicas": args.min_replicas, "autoscale": autoscale, "replica_capacity": capacity}
        )
    except (ValidationError, TypeError) as err:
        raise SystemExit(f"--autoscale: {err}") from None


def disaggregated(spec, args: argparse.Namespace):
    """The spec with prefill and decode pools (--prefill-replicas P --decode-replicas D: P + D
    replicas in all, in place of --replicas), the decider pricing hand-overs on --kv-link."""
    from pydantic import ValidationError

    from cluster.deploy import ClusterSpec
    from sim.disaggregation import KV_LINKS

    pools = {"prefill_replicas": args.prefill_replicas, "decode_replicas": args.decode_replicas}
    try:
        return ClusterSpec(
            **{
                **dict(spec),
                **pools,
                "num_replicas": max(1, sum(pools.values())),
                "pd_decider": args.pd_decider,
                "pd_threshold": args.pd_threshold,
                "kv_link": KV_LINKS[args.kv_link],
            }
        )
    except ValidationError as err:
        raise SystemExit(f"--prefill-replicas/--decode-replicas: {err}") from None


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
    u.add_argument(
        "--slo-tpot",
        type=float,
        default=defaults.TPOT_SLO,
        help="SLO for live goodput, and the one predicted_latency routes within: seconds per output token",
    )
    autoscaling_args(u)
    disaggregation_args(u)
    u.set_defaults(func=run)


def disaggregation_args(p: argparse.ArgumentParser) -> None:
    from cluster.deploy import ClusterSpec
    from router.pd_decider import PD_DECIDERS
    from sim.disaggregation import KV_LINKS

    fields = ClusterSpec.model_fields
    d = p.add_argument_group("prefill/decode disaggregation (the cluster has P + D replicas, in place of --replicas)")
    d.add_argument("--prefill-replicas", type=int, default=0, metavar="P", help="replicas that only prefill")
    d.add_argument("--decode-replicas", type=int, default=0, metavar="D", help="replicas that decode")
    d.add_argument(
        "--pd-decider",
        choices=list(PD_DECIDERS),
        default=fields["pd_decider"].default,
        metavar="NAME",
        help=f"which requests are prefilled on the prefill pool: {', '.join(PD_DECIDERS)}",
    )
    d.add_argument(
        "--pd-threshold",
        type=int,
        default=fields["pd_threshold"].default,
        help="uncached prompt tokens from which a request is disaggregated",
    )
    d.add_argument(
        "--kv-link",
        choices=list(KV_LINKS),
        default=next(name for name, link in KV_LINKS.items() if link == fields["kv_link"].default),
        metavar="LINK",
        help=f"{', '.join(KV_LINKS)}: the link the queue_aware decider prices a hand-over's K/V on "
        "(as an experiment's kv_link)",
    )


def autoscaling_args(p: argparse.ArgumentParser) -> None:
    from autoscaling.policies import AUTOSCALING_POLICIES, AutoscaleConfig

    fields = AutoscaleConfig.model_fields
    a = p.add_argument_group("autoscaling (with --autoscale; the cluster starts at --min-replicas)")
    a.add_argument(
        "--autoscale",
        choices=list(AUTOSCALING_POLICIES),
        default=None,
        metavar="POLICY",
        help=f"grow and shrink the replicas with the traffic by this policy: {', '.join(AUTOSCALING_POLICIES)}",
    )
    a.add_argument("--min-replicas", type=int, default=fields["min_replicas"].default, help="never fewer replicas")
    a.add_argument("--max-replicas", type=int, default=fields["max_replicas"].default, help="never more replicas")
    a.add_argument(
        "--cooldown", type=float, default=fields["cooldown_s"].default, help="seconds after a change with no scale-down"
    )
    a.add_argument(
        "--autoscale-period", type=float, default=fields["period_s"].default, help="seconds between two decisions"
    )
    a.add_argument(
        "--drain-timeout",
        type=float,
        default=fields["drain_timeout_s"].default,
        help="seconds a drained replica's running requests get to finish before they move",
    )
    a.add_argument(
        "--autoscale-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of the policy's own parameters (e.g. target_ongoing_requests=4); repeat for more",
    )
    a.add_argument(
        "--replica-capacity",
        type=float,
        nargs="+",
        default=None,
        metavar="TOKENS_PER_S",
        help="one replica's decode [and prefill] tokens/s at saturation (queue_slo and predictive price work by it)",
    )
