"""`slotserve generate`: text for prompts, from the running cluster or an in-process engine."""

from __future__ import annotations

import argparse
import json

from cli import common
from protocol.errors import SlotServeError
from replica.scheduling.policies import POLICIES


def chat_prompts(tokenizer, prompts: list[str]) -> list[str]:
    """Each prompt as one user turn in the model's chat template, ready for the assistant's answer."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise SlotServeError("--chat: this model has no chat template (a fake model has no tokenizer at all)")
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]


def cluster_tokenizer():
    """The tokenizer of the model the running cluster serves, read from its local directory as
    `slotserve serve` reads it (None for a fake model)."""
    import ray

    from cluster.deploy import find_cluster
    from cluster.http.server import load_tokenizer

    replica = next(iter(find_cluster().replicas.values()))
    info = ray.get(replica.info.remote(), timeout=60)
    return None if info.fake else load_tokenizer(info.model)


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
        from cluster.client import Client

        prompts = chat_prompts(cluster_tokenizer(), args.prompts) if args.chat else args.prompts
        with Client(args.address) as client:
            results = [client.generate(p, **params) for p in prompts]
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
        prompts = chat_prompts(engine.tokenizer, args.prompts) if args.chat else args.prompts
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
        help="generate text for prompts, on the running cluster or in this process",
        description="Generate text for each prompt and print it. With a slotserve cluster up (`slotserve up`, "
        "found at --address or on this machine) the prompts go through its router to its replicas and the "
        "engine options below are ignored; with none, or with --local, an engine runs in this process.",
    )
    g.add_argument("prompts", nargs="+", metavar="PROMPT", help="tokenized as it is (see --chat)")
    g.add_argument("--policy", choices=list(POLICIES), default="continuous", help="batching policy (--local)")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 = greedy, as in the Python client (over HTTP the default is 1.0, OpenAI's)",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of this probability")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = off")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template (its tokenizer, read from the local model directory)",
    )
    g.add_argument("--json", action="store_true", help="one JSON object per line per prompt")
    g.add_argument("--max-seq-len", type=int, default=1024, help="K/V tokens per slot (--local)")
    g.add_argument("--local", action="store_true", help="run in this process even when a cluster is up")
    common.address_arg(g)
    common.engine_args(g)
    common.cache_flags(g)
    g.set_defaults(func=run)
