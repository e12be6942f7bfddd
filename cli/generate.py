"""`slotserve generate`: text for prompts, from the running cluster or an in-process engine."""

from __future__ import annotations

import argparse
import json

from cli import common
from protocol.errors import SlotServeError
from replica.scheduling.policies import POLICIES


def run(args: argparse.Namespace) -> int:
    from replica.scheduling.request import SamplingParams, validate_prompt

    for prompt in args.prompts:  # before anything starts: undecodable bytes in argv are a clear error
        validate_prompt(prompt)
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or [],
        "ignore_eos": args.ignore_eos,
    }
    SamplingParams.parse(params)
    if not args.local and common.running_cluster(args.address):
        if args.chat:
            raise SlotServeError("--chat needs the tokenizer: use it with --local")
        from cluster.client import Client

        with Client(args.address) as client:
            results = [client.generate(p, **params) for p in args.prompts]
        rows = [(p, None, r.token_ids, r.text, r.finish_reason, r.replica_id) for p, r in zip(args.prompts, results)]
    else:
        from replica.config import EngineConfig
        from replica.engine import Engine

        engine = Engine(
            EngineConfig(
                model=args.model,
                policy=args.policy,
                num_slots=args.slots,
                dtype=args.dtype,
                device=args.device,
                max_seq_len=args.max_seq_len,
                **common.cache_args(args),
            )
        )
        prompts = args.prompts
        if args.chat:
            tok = engine.tokenizer
            prompts = [
                tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in prompts
            ]
        done = engine.generate(prompts, params)
        rows = [
            (p, len(d.prompt_token_ids), d.token_ids, d.text, d.finish_reason.value, "local")
            for p, d in zip(args.prompts, done)
        ]
    for prompt, num_prompt_tokens, token_ids, text, reason, where in rows:
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "token_ids": token_ids,
                        "text": text,
                        "finish_reason": reason,
                        "num_prompt_tokens": num_prompt_tokens,
                        "replica": where,
                    }
                )
            )
        else:
            print(f"--- {prompt!r} ({reason}, {len(token_ids)} tokens, {where})\n{text}")
    return 1 if any(row[4] == "error" for row in rows) else 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser(
        "generate",
        help="generate text for prompts with an in-process engine",
        description="Run the engine in this process on the given prompts and print the results.",
    )
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
    common.address_arg(g)
    common.engine_args(g)
    common.cache_flags(g)
    g.set_defaults(func=run)
