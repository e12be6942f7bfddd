"""Options several commands share (engine, cache, cluster, address), one definition each; their
defaults are the config models' own (`EngineConfig`, `ReplicaConfig`, `protocol.defaults`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from metrics.store import DEFAULT_STORE
from protocol import defaults
from replica.config import EngineConfig
from replica.scheduling.policies import POLICIES
from replica.serving.loop import ReplicaConfig


def engine_default(field: str):
    """EngineConfig's default for `field`: a flag left out builds the engine `EngineConfig()` builds."""
    return EngineConfig.model_fields[field].default


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=engine_default("model"),
        help="built-in model (smollm2-135m, gpt2-small-random) or a local Hugging Face directory",
    )
    p.add_argument(
        "--dtype",
        choices=defaults.DTYPES,
        default=engine_default("dtype"),
        help="auto: bfloat16 on a GPU or a CPU with AVX512_BF16/AMX, else float32",
    )
    p.add_argument("--device", default=engine_default("device"), help='"auto" takes cuda when present')
    p.add_argument(
        "--slots",
        type=int,
        default=engine_default("num_slots"),
        help="K/V cache slots = most requests running at once",
    )


def cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache",
        choices=["slot", "paged"],
        default="slot",
        help="slot: each request reserves a max-seq-len row; paged: 16-token blocks taken as it grows",
    )
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="paged: requests share the K/V blocks of identical prompt prefixes",
    )
    p.add_argument("--block-size", type=int, default=engine_default("block_size"), help="paged: K/V tokens per block")
    p.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=engine_default("kv_budget_tokens"),
        metavar="TOKENS",
        help="paged: K/V tokens the replica's block pool holds (default: slots x max-seq-len)",
    )


def cache_args(args: argparse.Namespace) -> dict:
    """The engine's K/V cache fields from the command line."""
    return {
        "kv_cache": args.kv_cache,
        "prefix_caching": args.prefix_caching,
        "block_size": args.block_size,
        "kv_budget_tokens": args.kv_budget_tokens,
    }


def running_cluster(address: str | None) -> bool:
    """Is there a slotserve cluster to send requests to? (Never starts one.)"""
    from cluster.client import ClusterError, connect, router_handle

    try:
        connect(address)
        router_handle()
        return True
    except ClusterError:
        if address is not None:
            raise
        return False


def cluster_spec(args: argparse.Namespace):
    from cluster.deploy import ClusterSpec

    engine = EngineConfig(
        model=args.model,
        policy=args.policy,
        num_slots=args.slots,
        dtype=args.dtype,
        device="cuda" if args.num_gpus else args.device,
        max_seq_len=args.max_seq_len,
        **cache_args(args),
    )
    return ClusterSpec(
        num_replicas=args.replicas,
        replica=ReplicaConfig(
            engine=engine, fake_step_seconds=args.fake_step, fake_cost=fake_cost(args), max_queue=args.max_queue
        ),
        routing_policy=args.routing[0],
        num_cpus_per_replica=args.num_cpus,
        num_gpus_per_replica=args.num_gpus,
        store_path=str(args.store),
        seed=args.seed,
        max_in_flight_per_replica=args.max_in_flight,
        flow=flow_config(args.flow),
    )


def flow_config(path: Path | None):
    """--flow's config, or None; a file that cannot be read or names a bad value stops the command, naming it."""
    if path is None:
        return None
    from protocol.flow import FlowConfig, FlowConfigError

    try:
        return FlowConfig.load(path)
    except FlowConfigError as err:
        raise SystemExit(f"--flow: {err}") from None


def fake_cost(args: argparse.Namespace):
    """The work-priced fake model's step prices: --fake-cost's fitted cost model x --fake-cost-scale
    (None without --fake-cost)."""
    if args.fake_cost is None:
        return None
    if args.fake_step is not None:
        raise SystemExit("give --fake-step (a flat step) or --fake-cost (a step priced by its work), not both")
    from sim.cost_model import FittedCostModel

    try:
        return FittedCostModel.load(args.fake_cost).scaled(args.fake_cost_scale)
    except ValueError as err:  # ConfigError: no file there, or not a cost model
        raise SystemExit(f"--fake-cost: {err}") from None


def model_label(replica: ReplicaConfig) -> str:
    """What the replicas serve, in words: the model, or which fake one."""
    if replica.fake_step_seconds is not None:
        return "fake flat-cost model"
    return "fake work-priced model" if replica.fake_cost is not None else replica.engine.model


def cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="replica actors")
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        default=engine_default("policy"),
        help="batching policy of every replica",
    )
    p.add_argument(
        "--routing",
        nargs="+",
        default=["least_loaded"],
        metavar="POLICY",
        help="routing policy (run: one run per policy, same traffic)",
    )
    max_seq_len_arg(p)
    p.add_argument(
        "--fake-step",
        type=float,
        default=None,
        metavar="SECONDS",
        help="serve the flat-cost fake model (each step this long) instead of --model",
    )
    p.add_argument(
        "--fake-cost",
        type=Path,
        default=None,
        metavar="JSON",
        help="serve the fake model with each step priced by its work: a cost model `slotserve calibrate` wrote",
    )
    p.add_argument(
        "--fake-cost-scale", type=float, default=1.0, metavar="X", help="--fake-cost's step prices times this"
    )
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica (= its torch threads)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs per replica (1 = model on cuda)")
    p.add_argument("--store", type=Path, default=DEFAULT_STORE, help="metrics store file (SQLite)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=ReplicaConfig.model_fields["max_queue"].default,
        help="requests a replica holds waiting for a slot; past it: overloaded",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=defaults.MAX_IN_FLIGHT_PER_REPLICA,
        help="requests the router keeps in flight per replica; past it on every replica: overloaded",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of random routing choices (run: and of the workload)")
    p.add_argument(
        "--flow",
        type=Path,
        default=None,
        metavar="TOML",
        help="the router's flow control: priority bands, tenants' fair shares and limits, shedding "
        "(a FlowConfig file; default: every request dispatched at once)",
    )
    engine_args(p)
    cache_flags(p)


def max_seq_len_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=engine_default("max_seq_len"),
        help="K/V tokens per slot",
    )


def address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster HOST:PORT (default: the one `ray start` made on this machine, if any)",
    )
