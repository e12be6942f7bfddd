"""The `slotserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from replica.errors import SlotServeError
from replica.policies import POLICIES

DEFAULT_OUT = Path("results")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in model (smollm2-135m, gpt2-small-random) or a local Hugging Face directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="auto", help='"auto" takes cuda when present')
    p.add_argument("--slots", type=int, default=8, help="K/V cache slots = most requests running at once")


def cmd_generate(args: argparse.Namespace) -> int:
    from replica.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=args.model, policy=args.policy, num_slots=args.slots, dtype=args.dtype,
                                 device=args.device, max_seq_len=args.max_seq_len))
    prompts = args.prompts
    if args.chat:
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                   for p in prompts]
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "seed": args.seed, "stop": args.stop or [], "ignore_eos": args.ignore_eos}
    for shown, done in zip(args.prompts, engine.generate(prompts, params)):
        if args.json:
            print(json.dumps({"prompt": shown, "token_ids": done.token_ids, "text": done.text,
                              "finish_reason": done.finish_reason.value, "num_prompt_tokens": len(done.prompt_token_ids)}))
        else:
            print(f"--- {shown!r} ({done.finish_reason.value}, {len(done.token_ids)} tokens)\n{done.text}")
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
    _engine_args(g)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SlotServeError as err:
        print(f"slotserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
