"""The defaults more than one package states: the engine's config (`replica.config`), the
router, the cluster spec, experiment files (`workloads.experiment`) and the command line. Each
is written once here, so `EngineConfig()`, an experiment file that leaves a key out and
`slotserve up` without the flag build the same replica."""

from __future__ import annotations

from typing import Literal, get_args

Dtype = Literal["auto", "float32", "bfloat16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
# bfloat16 where it is fast (a GPU, a CPU with bf16 matrix units), else float32
# (`replica.config.resolve_dtype`): what a user running on this machine wants unless told otherwise.
DTYPE: Dtype = "auto"

NUM_SLOTS = 8  # K/V cache slots of a replica = most requests running at once
# K/V tokens one slot holds: room for the longest request of long-prompts (a 480-token prompt
# and up to 128 output tokens; `slotserve compare`'s default workload) and so of the smaller ones.
MAX_SEQ_LEN = 640
BLOCK_SIZE = 16  # `paged`: K/V tokens per block; also the block a prompt's hashes are chained over
TOKEN_BUDGET = 256  # `chunked`: tokens per step, decodes first, then prefill chunks

# Seconds per output token after the first that a request may take: the SLO reports count
# against unless told another, and the TPOT `predicted_latency` routes within.
TPOT_SLO = 0.25

MAX_IN_FLIGHT_PER_REPLICA = 512  # the router's bound per replica; past it on every replica: overloaded

# Flow control (`protocol.flow`): a request's class when it names none. Priority 0 is the most
# urgent of the default bands (lower is served first, as vLLM's `priority` field); a request
# that names no tenant (no API key's tenant, no `user`) is the default tenant's.
PRIORITY = 0
TENANT = "default"
