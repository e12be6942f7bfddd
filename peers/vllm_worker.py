"""Runs inside vLLM's own virtual environment (`make peers`), as a script: it imports nothing of
slotserve's, since that environment pins its own torch and transformers.

Reads one JSON job on stdin and prints one JSON result line (prefixed `RESULT `) on stdout,
from one engine:

- throughput: every prompt (token ids) with its own max_tokens, greedy, EOS ignored, in one
  `LLM.generate` call after a short warm-up; useful tokens/s over the call, and the token ids;
- single-stream decode: one prompt alone, generated to two lengths (best of a few tries each);
  tokens/s is the difference in tokens over the difference in time, so prefill and the call's
  own overhead cancel.

The thread binding (VLLM_CPU_OMP_THREADS_BIND) and the preloaded libraries come in the
environment the parent sets; the result echoes what vLLM saw.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _llm(job: dict):
    from vllm import LLM

    return LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        seed=0,
        disable_log_stats=True,
        kv_cache_memory_bytes=job["kv_cache_bytes"],
    )


def _generate(llm, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    job = json.loads(sys.stdin.read())
    import torch
    import vllm

    t = time.perf_counter()
    llm = _llm(job)
    startup = time.perf_counter() - t
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    _generate(llm, prompts[:2], [2, 2])  # warm-up, not timed
    result = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "startup_s": startup,
        "env": {
            k: os.environ.get(k, "") for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
        },
    }
    seconds, tokens = _generate(llm, prompts, max_tokens)
    useful = sum(map(len, tokens))
    result.update(seconds=seconds, useful_tokens=useful, tokens_per_s=useful / seconds, outputs=tokens)
    short, long = job["decode_lens"]
    one = [job["decode_prompt"]]
    times = {n: min(_generate(llm, one, [n])[0] for _ in range(job["repeats"])) for n in (short, long)}
    result["decode1_tokens_per_s"] = (long - short) / (times[long] - times[short])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
