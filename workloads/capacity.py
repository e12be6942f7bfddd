"""A cluster's capacity for the work requests carry, and a workload's load against it.

A request costs its prefill and its decode. The cluster is measured doing each at saturation
(every slot of every replica busy): `prefill_tokens_per_s` and `decode_tokens_per_s`, as the
engine (or the simulator's cost model) prices them. A request's work is then the cluster time
its tokens take at those rates, `prompt_len / prefill + output_len / decode` seconds, and a
workload's load is its arrival rate times its mean work per request: load 1.0 keeps the
cluster exactly busy. Counting decode alone (the old definition) offered a prefill-heavy trace
many times what the cluster can serve at "load 0.8".

A fleet's rate is its replicas' rates summed, each over its own busy span: a probe fills
every slot at once, so a replica that is four times slower ends the probe long after the
others, and the fleet's tokens over the whole span would price the cluster at the slow
replicas' pace (a load of 2.0 by that measure is about 0.8 of what the replicas serve, each at
its own pace). For identical replicas the two agree. Replicas that share cores are each
counted at the pace it had, which the one left running last, with the cores to itself, may
exceed.

The sum is conservative: a step that mixes decodes and prefill chunks shares its fixed cost,
so mixed traffic is served a little faster than its parts measured apart. Prefix-cache hits
are not subtracted: the work is the request's own, what a router can save by placing it well
is the comparison.

`probe_capacity` is the one measurement: the probes as workloads (every request at t=0) and
the rates from what each request got, whatever runs them: the Ray cluster
(`experiments.backends`), the simulator (`sim.simulator`) or one in-process engine
(`sim.batching_comparison`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from workloads.workload import Workload, WorkloadRequest

PROBE_PROMPT_LEN = 32  # tokens per decode-probe prompt
PROBE_MAX_TOKENS = 24
PREFILL_PROBE_LEN = 256  # tokens per prefill-probe prompt (less when the slots are shorter)
PREFILL_PROBE_ROUNDS = 2  # prefill probes fill every slot this many times
PROBE_SEED = 1_000_000  # probe k's prompts use seed PROBE_SEED + k: none shares a prefix with a run's


@dataclass(frozen=True)
class Capacity:
    decode_tokens_per_s: float
    prefill_tokens_per_s: float = math.inf  # inf: prefill counted free (decode-only capacity)

    def __post_init__(self) -> None:
        if not self.decode_tokens_per_s > 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError(
                f"capacity must be > 0 tokens/s, got decode {self.decode_tokens_per_s}, "
                f"prefill {self.prefill_tokens_per_s}"
            )

    @classmethod
    def of(cls, capacity: Capacity | float) -> Capacity:
        """A Capacity, or a bare number read as decode tokens/s with prefill free."""
        return capacity if isinstance(capacity, Capacity) else cls(float(capacity))

    def work_seconds(self, prompt_len: int, output_len: int) -> float:
        """Cluster seconds one request's tokens take at saturation."""
        return prompt_len / self.prefill_tokens_per_s + output_len / self.decode_tokens_per_s

    def rate_for(self, load: float, lengths: Iterable[tuple[int, int]]) -> float:
        """Requests/s that offer `load` x this capacity for requests of these (prompt_len,
        output_len): load / mean work, written as load x decode rate / (mean output + mean
        prompt in decode-token equivalents), so a decode-only capacity gives exactly the old
        load x capacity / mean output."""
        if load <= 0:
            raise ValueError(f"load must be > 0, got {load}")
        pairs = list(lengths)
        if not pairs:
            raise ValueError("a workload without requests has no work")
        mean_prompt = sum(p for p, _ in pairs) / len(pairs)
        mean_output = sum(o for _, o in pairs) / len(pairs)
        decode = self.decode_tokens_per_s
        return load * decode / (mean_output + mean_prompt * decode / self.prefill_tokens_per_s)

    def as_params(self) -> dict[str, float]:
        """For a run's record (prefill left out when counted free)."""
        params = {"capacity_tokens_per_s": self.decode_tokens_per_s}
        if math.isfinite(self.prefill_tokens_per_s):
            params["capacity_prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return params

    @classmethod
    def from_params(cls, params: dict) -> Capacity:
        """The capacity a run's record holds (`as_params`, read back)."""
        return cls(params["capacity_tokens_per_s"], params.get("capacity_prefill_tokens_per_s", math.inf))


class Served(Protocol):
    """What a probe reads of each request it sent (`metrics.definitions.RequestTrace`): when
    it arrived, when each token came, and the replica that served it (None: one engine)."""

    arrival: float
    token_times: list[float]
    replica: str | None


def _by_replica(served: Iterable[Served]) -> list[list[Served]]:
    groups: dict[str | None, list[Served]] = {}
    for r in served:
        groups.setdefault(r.replica, []).append(r)
    return list(groups.values())


def decode_rate(served: Iterable[Served]) -> float:
    """Output tokens/s of a saturating decode probe: per replica, the tokens after each
    request's first over the time from its first first-token to its last token, summed over
    the replicas."""
    rates = []
    for group in _by_replica(served):
        times = [r.token_times for r in group if r.token_times]
        first = min(t[0] for t in times)
        last = max(t[-1] for t in times)
        rates.append(sum(len(t) - 1 for t in times) / (last - first))
    return sum(rates)


def prefill_rate(prompt_len: int, served: Iterable[Served], start: float) -> float:
    """Prompt tokens/s of a saturating prefill probe (one-token outputs, all sent at `start`):
    per replica, its prompt tokens over the time to its last first token, summed over the
    replicas."""
    return sum(
        prompt_len * len(group) / (max(r.token_times[0] for r in group) - start) for group in _by_replica(served)
    )


def prefill_probe_len(max_seq_len: int) -> int:
    return min(PREFILL_PROBE_LEN, max_seq_len - 2)


ProbeRunner = Callable[[Workload], Sequence[Served]]


def decode_probe(num_slots: int, max_tokens: int = PROBE_MAX_TOKENS, index: int = 0) -> Workload:
    """Every slot decoding: one short prompt per slot, all sent at once."""
    request = WorkloadRequest(0.0, PROBE_PROMPT_LEN, max_tokens)
    return Workload(f"decode-probe-{index}", PROBE_SEED + 2 * index, [request] * num_slots)


def prefill_probe(num_slots: int, max_request_tokens: int, index: int = 0) -> Workload:
    """Every slot prefilling, PREFILL_PROBE_ROUNDS times over: long prompts with one output
    token each, all sent at once. Its prompts share no prefix with another probe's (whose
    prompts a prefix cache may still hold), so every prompt token is computed."""
    request = WorkloadRequest(0.0, prefill_probe_len(max_request_tokens), 1)
    return Workload(
        f"prefill-probe-{index}", PROBE_SEED + 2 * index + 1, [request] * (PREFILL_PROBE_ROUNDS * num_slots)
    )


def probe_capacity(
    run: ProbeRunner, num_slots: int, max_request_tokens: int, probes: int = 1, max_tokens: int = PROBE_MAX_TOKENS
) -> Capacity:
    """The capacity of `num_slots` slots (every slot of every replica) with each busy: decoding
    (output tokens/s) and prefilling (prompt tokens/s), each the median of `probes` saturating
    probes, so one stall on a busy machine does not set the load of a whole experiment (one is
    enough on virtual time). `run` sends a probe's requests (prompts as
    `workloads.workload.request_prompt` makes them with the probe's seed) all at once and
    returns what each got; `max_request_tokens` is the replicas' context limit."""
    decode = statistics.median(decode_rate(run(decode_probe(num_slots, max_tokens, k))) for k in range(probes))
    prefill = []
    for k in range(probes):
        probe = prefill_probe(num_slots, max_request_tokens, k)
        served = run(probe)
        prompt_len = probe.requests[0].prompt_len
        prefill.append(prefill_rate(prompt_len, served, min(r.arrival for r in served)))
    return Capacity(decode, statistics.median(prefill))
