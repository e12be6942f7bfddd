"""`slotserve bench`: the engine against its peers on this machine."""

from __future__ import annotations

import argparse

from peers import engine_speed
from replica.model_loader import DEFAULT_MODEL


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    b = subparsers.add_parser(
        "bench",
        help="slotserve's engine against transformers on this machine",
        description=engine_speed.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    b.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    b.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of every row but the bf16-vs-fp32 pair (default float32)",
    )
    b.add_argument("--requests", type=int, default=48, help="saturated requests (default 48, the standard workload)")
    b.add_argument("--slots", type=int, nargs="+", default=[8, 16, 32, 64], help="slot counts (default 8 16 32 64)")
    b.add_argument("--policies", nargs="+", default=["continuous", "chunked"], help="slotserve batching policies")
    b.add_argument(
        "--decode-batches",
        type=int,
        nargs="*",
        default=[8, 16, 32, 64],
        help="batch sizes of the decode-step comparison (none: skip it)",
    )
    b.add_argument(
        "--no-peers", dest="peers", action="store_false", help="skip transformers' generate() and continuous batching"
    )
    b.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bf16 comparison")
    b.add_argument("--bf16-requests", type=int, default=16, help="requests of the bf16 comparison (default 16)")
    b.add_argument("--hardware", default="HARDWARE.md", help="where to read the compute roofline (default HARDWARE.md)")
    b.add_argument("--roofline", type=float, help="compute roofline in tokens/s (overrides --hardware)")
    b.add_argument("--json", metavar="PATH", help="write the rows and ratios as JSON")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = engine_speed.run(args)
    print(engine_speed.format_bench(result))
    if args.json:
        engine_speed.write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
