"""Options several commands share (engine, cache, cluster, address), one definition each."""

from __future__ import annotations

import argparse
from pathlib import Path

from metrics.store import DEFAULT_STORE
from replica.scheduling.policies import POLICIES


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="built-in model (smollm2-135m, gpt2-small-random) or a local Hugging Face directory",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto (default): bfloat16 on a GPU or a CPU with AVX512_BF16/AMX, else float32",
    )
    p.add_argument("--device", default="auto", help='"auto" takes cuda when present')
    p.add_argument("--slots", type=int, default=8, help="K/V cache slots = most requests running at once")


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


def cache_args(args: argparse.Namespace) -> dict:
    """The engine's K/V cache fields from the command line."""
    return {"kv_cache": args.kv_cache, "prefix_caching": args.prefix_caching}


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
    from replica.config import EngineConfig
    from replica.serving.loop import ReplicaConfig

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
        replica=ReplicaConfig(engine=engine, fake_step_seconds=args.fake_step, max_queue=args.max_queue),
        routing_policy=args.routing[0],
        num_cpus_per_replica=args.num_cpus,
        num_gpus_per_replica=args.num_gpus,
        store_path=str(args.store),
        seed=args.seed,
        max_in_flight_per_replica=args.max_in_flight,
    )


def cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="replica actors")
    p.add_argument("--policy", choices=list(POLICIES), default="continuous", help="batching policy of every replica")
    p.add_argument(
        "--routing",
        nargs="+",
        default=["least_loaded"],
        metavar="POLICY",
        help="routing policy (run: one run per policy, same traffic)",
    )
    p.add_argument("--max-seq-len", type=int, default=640, help="K/V tokens per slot")
    p.add_argument(
        "--fake-step",
        type=float,
        default=None,
        metavar="SECONDS",
        help="serve the flat-cost fake model (each step this long) instead of --model",
    )
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica (= its torch threads)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs per replica (1 = model on cuda)")
    p.add_argument("--store", type=Path, default=DEFAULT_STORE, help="metrics store file (SQLite)")
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests a replica holds waiting for a slot; past it: overloaded"
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=512,
        help="requests the router keeps in flight per replica; past it on every replica: overloaded",
    )
    p.add_argument("--seed", type=int, default=0)
    engine_args(p)
    cache_flags(p)


def address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster HOST:PORT (default: the one `ray start` made on this machine, if any)",
    )
