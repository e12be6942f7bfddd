"""`slotserve calibrate`: fit the simulator's cost model to this machine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from replica.errors import ConfigError
from replica.model.loader import DEFAULT_MODEL
from sim.calibration import DEFAULT_OUT, calibrate, calibrate_from_store, format_fit


def run(args: argparse.Namespace) -> int:
    import torch

    for name in ("slots", "threads", "replicas"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}")
    start = time.monotonic()
    if args.from_store:
        model, samples = calibrate_from_store(args.from_store, args.runs)
    else:
        if args.runs:
            raise ConfigError("--runs names recorded runs to fit to: pass --from-store with it")
        torch.set_num_threads(args.threads)
        model, samples = calibrate(
            args.model, args.slots, args.dtype, args.device, args.quick, args.seed, replicas=args.replicas
        )
    model.save(args.out)
    print(format_fit(model, samples))
    print(
        f"{'read' if args.from_store else 'measured'} {len(samples)} steps in {time.monotonic() - start:.0f} s; "
        f"saved {args.out}"
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `slotserve calibrate` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "calibrate",
        help="fit the simulator's cost model to this machine's real step times",
        description="Run the real engine on a grid of decode batch sizes, prefill chunk sizes and context lengths, "
        "fit step time = c0 + c_decode*decode + c_prefill*prefill + c_ctx*context + c_held*padding "
        "(non-negative least squares), print the fit and save it as JSON with this machine's "
        "description. About 1.5 minutes on SmolLM2-135M on 2 CPU cores; --quick under one. "
        "With --from-store and --runs, fit to the steps real runs recorded instead (a cluster's "
        "serving steps, in its own conditions).",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="built-in model (smollm2-135m, gpt2-small-random) or a local Hugging Face directory",
    )
    p.add_argument("--slots", type=int, default=8, help="largest decode batch measured")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the dtype measured")
    p.add_argument("--device", default="auto", help='"auto" takes cuda when present')
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads: a cluster replica runs as many as its Ray num_cpus",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="measure this many replicas side by side, one process each (the step times of an N-replica "
        "cluster sharing this machine)",
    )
    p.add_argument(
        "--from-store",
        type=Path,
        default=None,
        metavar="DB",
        help="fit to the recorded steps of real runs in this metrics store (with --runs); measures nothing",
    )
    p.add_argument("--runs", type=int, nargs="+", default=[], metavar="ID", help="the run ids for --from-store")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="a smaller grid (under a minute; a rougher fit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the measured prompts")
    p.set_defaults(func=run)
