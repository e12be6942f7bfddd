"""The `slotserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from replica.errors import SlotServeError
from replica.policies import POLICIES

DEFAULT_OUT = Path("results")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in model (smollm2-135m, gpt2-small-random) or a local Hugging Face directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="auto", help='"auto" takes cuda when present')
    p.add_argument("--slots", type=int, default=8, help="K/V cache slots = most requests running at once")


def _cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache", choices=["slot", "paged"], default="slot",
                   help="slot: each request reserves a max-seq-len row; paged: 16-token blocks taken as it grows")
    p.add_argument("--prefix-caching", action="store_true",
                   help="paged: requests share the K/V blocks of identical prompt prefixes")


def _cache_args(args: argparse.Namespace) -> dict:
    """The engine's K/V cache fields from the command line."""
    return {"kv_cache": args.kv_cache, "prefix_caching": args.prefix_caching}


def _running_cluster(address: str | None) -> bool:
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


def cmd_generate(args: argparse.Namespace) -> int:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "seed": args.seed, "stop": args.stop or [], "ignore_eos": args.ignore_eos}
    if not args.local and _running_cluster(args.address):
        if args.chat:
            raise SlotServeError("--chat needs the tokenizer: use it with --local")
        from cluster.client import Client

        client = Client(args.address)
        results = [client.generate(p, **params) for p in args.prompts]
        rows = [(p, None, r.token_ids, r.text, r.finish_reason, r.replica_id) for p, r in zip(args.prompts, results)]
    else:
        from replica.engine import Engine, EngineConfig

        engine = Engine(EngineConfig(model=args.model, policy=args.policy, num_slots=args.slots, dtype=args.dtype,
                                     device=args.device, max_seq_len=args.max_seq_len, **_cache_args(args)))
        prompts = args.prompts
        if args.chat:
            tok = engine.tokenizer
            prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in prompts]
        done = engine.generate(prompts, params)
        rows = [(p, len(d.prompt_token_ids), d.token_ids, d.text, d.finish_reason.value, "local")
                for p, d in zip(args.prompts, done)]
    for prompt, num_prompt_tokens, token_ids, text, reason, where in rows:
        if args.json:
            print(json.dumps({"prompt": prompt, "token_ids": token_ids, "text": text, "finish_reason": reason,
                              "num_prompt_tokens": num_prompt_tokens, "replica": where}))
        else:
            print(f"--- {prompt!r} ({reason}, {len(token_ids)} tokens, {where})\n{text}")
    return 0


def _cluster_spec(args: argparse.Namespace):
    from cluster.deploy import ClusterSpec
    from replica.engine import EngineConfig
    from replica.serving import ReplicaConfig

    engine = EngineConfig(model=args.model, policy=args.policy, num_slots=args.slots, dtype=args.dtype,
                          device="cuda" if args.num_gpus else args.device, max_seq_len=args.max_seq_len,
                          **_cache_args(args))
    return ClusterSpec(num_replicas=args.replicas, replica=ReplicaConfig(engine=engine, fake_step_seconds=args.fake_step),
                       routing_policy=args.routing[0], num_cpus_per_replica=args.num_cpus, num_gpus_per_replica=args.num_gpus,
                       store_path=str(args.store), seed=args.seed)


def cmd_up(args: argparse.Namespace) -> int:
    from cluster.deploy import ensure_ray, start_cluster

    spec = _cluster_spec(args)
    ensure_ray(args.address, start_local=True)
    print(f"starting {spec.num_replicas} replicas ({spec.replica.engine.model if spec.replica.fake_step_seconds is None else 'fake flat-cost model'}, "
          f"{spec.replica.engine.policy} batching) and the router ({spec.routing_policy}) ...", flush=True)
    start_cluster(spec, detached=True)
    print(f"slotserve is up; metrics store: {Path(spec.store_path).resolve()}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from cluster.client import connect
    from cluster.deploy import stop_cluster

    connect(args.address)
    names = stop_cluster()
    print(f"stopped {len(names)} actors" if names else "no slotserve cluster was running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.client import connect
    from cluster.deploy import cluster_status

    connect(args.address)
    status = cluster_status()
    print(f"router policy: {status['router']['policy']}")
    print(f"{'replica':<12}{'node':<14}{'batching':<12}{'slots':>6}{'queue':>7}{'running':>8}{'free':>6}")
    for r in status["replicas"]:
        load = r["load"]
        print(f"{r['replica_id']:<12}{r['node_id'][:12]:<14}{r['policy']:<12}{r['num_slots']:>6}"
              f"{load['queue_depth']:>7}{load['running']:>8}{load['free_slots']:>6}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import ray

    from cluster.deploy import ensure_ray, find_cluster, start_cluster, stop_cluster
    from cluster.experiment import routing_experiment

    ensure_ray(args.address, start_local=False)
    owned = not _running_cluster(args.address)
    spec = _cluster_spec(args)
    if owned:
        print(f"no cluster running: starting {spec.num_replicas} replicas for this run ...", flush=True)
        deployment = start_cluster(spec)
    else:
        deployment = find_cluster()
    try:
        run_ids = routing_experiment(deployment, args.routing, args.workload, args.requests, args.load, args.seed,
                                     config=spec.model_dump() if owned else {"cluster": "already running"})
    finally:
        if owned:
            stop_cluster()
    ray.shutdown()
    if owned:
        from cluster.plots import plot_cluster_runs
        from cluster.store import MetricsStore

        plot = plot_cluster_runs(MetricsStore(args.store), run_ids,
                                 Path(args.store).parent / f"runs-{run_ids[0]}-{run_ids[-1]}.png")
        print(f"recorded runs {', '.join(map(str, run_ids))} in {Path(args.store).resolve()}; plot: {plot}")
    else:
        print(f"recorded runs {', '.join(map(str, run_ids))} in the running cluster's store")
    if args.report:
        return main(["report", *map(str, run_ids), "--store", str(args.store)])
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from cluster.compare import compare_policies, format_table
    from cluster.metrics import SLO

    out_dir = args.out / time.strftime("compare-%Y%m%d-%H%M%S")
    report = compare_policies(args.policies, args.workload, args.requests, args.load, args.slots, args.max_seq_len,
                              args.token_budget, args.model, args.dtype, args.seed, SLO(args.slo_ttft, args.slo_tpot),
                              out_dir)
    print(format_table(report))
    print(f"traces, steps, summary and plot: {out_dir}/")
    return 0


def _cluster_args(p: argparse.ArgumentParser) -> None:
    from cluster.store import DEFAULT_STORE

    p.add_argument("--replicas", type=int, default=2, help="replica actors")
    p.add_argument("--policy", choices=list(POLICIES), default="continuous", help="batching policy of every replica")
    p.add_argument("--routing", nargs="+", default=["least_loaded"], metavar="POLICY",
                   help="routing policy (run: one run per policy, same traffic)")
    p.add_argument("--max-seq-len", type=int, default=640, help="K/V tokens per slot")
    p.add_argument("--fake-step", type=float, default=None, metavar="SECONDS",
                   help="serve the flat-cost fake model (each step this long) instead of --model")
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica (= its torch threads)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs per replica (1 = model on cuda)")
    p.add_argument("--store", type=Path, default=DEFAULT_STORE, help="metrics store file (SQLite)")
    p.add_argument("--seed", type=int, default=0)
    _engine_args(p)
    _cache_flags(p)


def _address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="Ray cluster HOST:PORT (default: the one `ray start` made on this machine, if any)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description="Serve LLMs with pluggable batching policies and compare them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for prompts with an in-process engine",
                       description="Run the engine in this process on the given prompts and print the results.")
    g.add_argument("prompts", nargs="+", metavar="PROMPT", help="tokenized as it is (see --chat)")
    g.add_argument("--policy", choices=list(POLICIES), default="continuous", help="batching policy")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per line per prompt")
    g.add_argument("--max-seq-len", type=int, default=1024, help="K/V tokens per slot")
    g.add_argument("--local", action="store_true", help="run in this process even when a cluster is up")
    _address_arg(g)
    _engine_args(g)
    _cache_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("compare", help="compare batching policies on one replica, same traffic",
                       description="Replay one seeded workload through each batching policy on one in-process replica "
                                   "of a real model; print a table and write traces, steps, summary and a plot.")
    c.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    c.add_argument("--workload", choices=["long-prompts", "bursty-mix", "saturated"], default="long-prompts")
    c.add_argument("--requests", type=int, default=24, help="requests in the workload")
    c.add_argument("--load", type=float, default=0.8, help="arrival rate as a multiple of measured decode capacity")
    c.add_argument("--token-budget", type=int, default=64, help="per-step token budget of the chunked policy")
    c.add_argument("--max-seq-len", type=int, default=640, help="K/V tokens per slot")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT limit (s) for goodput")
    c.add_argument("--slo-tpot", type=float, default=0.25, help="TPOT limit (s) for goodput")
    c.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for results")
    _engine_args(c)
    c.set_defaults(func=cmd_compare)

    u = sub.add_parser("up", help="start a router and N replicas on a Ray cluster",
                       description="Start the metrics store, N replica actors and the router on the Ray cluster at "
                                   "--address, or on this machine (starting `ray start --head` if none runs). "
                                   "They keep running until `slotserve down`.")
    _address_arg(u)
    _cluster_args(u)
    u.set_defaults(func=cmd_up)

    d = sub.add_parser("down", help="stop the slotserve actors", description="Stop the router, replicas and store.")
    _address_arg(d)
    d.set_defaults(func=cmd_down)

    st = sub.add_parser("status", help="replicas, their load, and the router policy")
    _address_arg(st)
    st.set_defaults(func=cmd_status)

    r = sub.add_parser("run", help="replay a workload through the cluster and record it",
                       description="Measure the cluster's capacity, then replay one seeded workload once per --routing "
                                   "policy, recording every request, token, step and routing decision in the store. "
                                   "Uses the running cluster, or starts one for this run from the options below.")
    _address_arg(r)
    r.add_argument("--workload", choices=["bursty-mix", "long-prompts", "saturated"], default="bursty-mix")
    r.add_argument("--requests", type=int, default=32)
    r.add_argument("--load", type=float, default=0.8, help="arrival rate as a multiple of measured cluster capacity")
    r.add_argument("--report", action="store_true", help="print the report of the runs at the end")
    _cluster_args(r)
    r.set_defaults(func=cmd_run)

    from cluster.bench import add_bench_command
    from cluster.calibrate import add_calibrate_command
    from cluster.experiment import add_experiment_command
    from cluster.report import add_report_command

    add_report_command(sub)
    add_experiment_command(sub)
    add_bench_command(sub)
    add_calibrate_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SlotServeError as err:
        print(f"slotserve: error: {err}", file=sys.stderr)
        return 2
    except ValidationError as err:
        first = err.errors()[0]
        print(f"slotserve: error: invalid {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
