"""`slotserve bench`: the engine against its peers (vLLM's CPU engine, transformers) on this machine."""

from __future__ import annotations

import argparse

from cli.help import RawDescriptionDefaultsHelpFormatter
from peers import engine_speed
from replica.model.loader import DEFAULT_MODEL


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    b = subparsers.add_parser(
        "bench",
        help="slotserve's engine against vLLM and transformers on this machine",
        description=engine_speed.__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    b.add_argument("--model", default=DEFAULT_MODEL, help="model")
    b.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    b.add_argument(
        "--dtypes",
        nargs="+",
        choices=["float32", "bfloat16"],
        help="slotserve's dtypes (default: float32, and bfloat16 on a GPU or a CPU with AVX512_BF16 or AMX)",
    )
    b.add_argument(
        "--int8-rows",
        type=int,
        default=1,
        metavar="N",
        help="also run with weight-only int8 copies for steps of at most N rows (fewer where int8 was measured "
        "slower than the dense product on this machine), on the dtype `auto` picks here (0: not run)",
    )
    b.add_argument("--requests", type=int, default=48, help="saturated requests (48: the standard workload)")
    b.add_argument("--slots", type=int, nargs="+", default=[16, 32, 64], help="slot counts")
    b.add_argument("--policies", nargs="+", default=["continuous", "chunked"], help="slotserve batching policies")
    b.add_argument(
        "--decode-batches",
        type=int,
        nargs="*",
        default=[1, 8, 64],
        help="batch sizes of the decode-step comparison, each dtype, with its host-overhead share "
        "(none: skip it and the prefill step)",
    )
    b.add_argument(
        "--no-peers", dest="peers", action="store_false", help="skip transformers' generate() and continuous batching"
    )
    b.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip vLLM's CPU engine (made by `make peers`)")
    b.add_argument("--json", metavar="PATH", help="write the rows and ratios as JSON")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = engine_speed.run(args)
    print(engine_speed.format_bench(result))
    if args.json:
        engine_speed.write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
