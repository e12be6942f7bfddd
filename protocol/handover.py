"""A request handed from one replica to another with its K/V (prefill/decode disaggregation):
what the prefill replica exports once it has sampled the first token, and what the decode
replica admits with that K/V written into its own cache, so it decodes on without computing
the prompt again.

The K/V travel as one tensor, token-major whatever the sender's cache layout (a slot row or
paged blocks), so a slot-cache replica and a paged one can hand over to each other; `kv` is
None from a fake model, which has no tensors but still states the bytes a real one would send.
The sampler's state needs no field of its own: a seeded request's generator is seeded by
(seed, output position) (`replica.model.sampler`), so its `sampling` seed and the output tokens
so far are the whole of it, and seeded sampling continues exactly on the decode replica."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.records import JsonObject


@dataclass(frozen=True)
class Handover:
    """One request leaving the replica that computed `num_kv_tokens` tokens of K/V for it.

    - `prompt_token_ids`, `output_token_ids`: its tokens so far; the K/V cover all of them but
      the last output token, which the receiver runs first (its next decode row);
    - `text`: the output text already delivered to the caller (text held back because it may
      start a stop string is not in it: the receiver streams it once it is settled);
    - `sampling`: the request's sampling parameters as their fields (the receiver validates them);
    - `kv`: a CPU tensor [2 (K, V), layers, num_kv_tokens, kv_heads, head_dim] of `dtype`, or
      None from a fake model; `nbytes`: its size (a fake's stated size);
    - `block_size`: the sender's K/V block size; `made`: when it was exported (sender's clock)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    sampling: JsonObject
    arrival_time: float
    num_kv_tokens: int
    kv: Any
    dtype: str
    nbytes: int
    block_size: int
    made: float
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass(frozen=True)
class KvFetch:
    """What a receiving replica's fetch of a hand-over came to: `nbytes` of K/V taken in, in
    `seconds` (the call to the sender included), or why it computes them again instead
    (`fallback`: the sender gone, the hand-over expired, K/V this replica cannot use)."""

    nbytes: int
    seconds: float
    fallback: str | None = None


@dataclass(frozen=True)
class KvLink:
    """The price of moving K/V between two replicas: a fixed latency per hand-over plus its
    bytes over the link's bandwidth. The fake replicas, the simulator and a P/D decider price
    a hand-over with it, so an experiment can ask what disaggregation is worth on a network
    (`SAME_NODE`, `CROSS_NODE`, or a link of its own)."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


# Through Ray's object store on one node (shared memory) and across nodes (a 10 Gb/s network):
# rough orders of magnitude, stated so experiments name the link they assume.
SAME_NODE = KvLink(bandwidth_bytes_per_s=5e9, latency_s=0.001)
CROSS_NODE = KvLink(bandwidth_bytes_per_s=1.25e9, latency_s=0.002)

# Why a prefill replica's hand-over moved its request (a migration's `reason`, fetch fallbacks
# appended): a drained replica's moves give the drain's reason, so the two are told apart.
PREFILL_HANDOVER = "handed over with its K/V"
