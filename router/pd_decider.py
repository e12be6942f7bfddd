"""Whether one request is served colocated (prefilled and decoded on one decode-pool replica)
or disaggregated (prefilled on a prefill replica, its K/V handed to a decode replica): the P/D
decision a two-pool router makes per request. Pure: it reads a `PdView` of the request and the
two replicas the pools' routing policies picked, and answers, so the simulator and a router
run the same objects.

- `threshold` is llm-d's rule: disaggregate when the prompt's uncached tokens (those the
  prefill replica's prefix cache does not hold) reach a threshold; a short prompt costs its
  decode replica little, and its hand-over would cost more than its prefill.
- `queue_aware` also weighs the decode replica's running decodes, the prefill replica's
  backlog and the transfer (its bytes on the pools' link, `PdCosts.link`): colocated, the
  prompt's prefill delays this request and every decode running beside it; disaggregated, it
  delays only this request, by the prefill replica's backlog and the hand-over. It
  disaggregates past the threshold only when that is the smaller delay, so it does not where
  it does not pay (an idle decode pool, a slow link).

A prefill token is priced at what each replica's steps cost: the `c_prefill` of the
`protocol.cost.StepPricing` on its load reports (a fake replica's cost model, which an
experiment's `cluster.cost_model` or `ClusterSpec.replica.fake_cost` gives it and the simulator
pays too), the decode replica's for a colocated prefill and the prefill replica's for a
disaggregated one, so the comparison uses the prices the replicas pay, each at its own speed.
A real replica reports the prices it measured from its own steps (`replica.pricing`) once it
has run a few dozen; one whose reports carry no pricing yet is priced at
`PdCosts.prefill_seconds_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.handover import SAME_NODE, KvLink
from protocol.registry import Registry


@dataclass(frozen=True)
class PdView:
    """One request and the replicas picked for it: `uncached_tokens` of its prompt not in the
    prefill replica's prefix cache, the K/V bytes a hand-over of its prompt sends, the requests
    on the decode replica (running by its last report, or routed there since: those a colocated
    prefill would stall), the prompt tokens the prefill replica has yet to compute, and the
    seconds a prefill token costs on each replica by its reported pricing (None: it reports
    none)."""

    uncached_tokens: int
    kv_bytes: int
    decode_running: int
    prefill_pending_tokens: int
    decode_seconds_per_token: float | None = None
    prefill_seconds_per_token: float | None = None


@dataclass(frozen=True)
class PdCosts:
    """What the queue-aware rule prices with: the link, and the seconds per prefill token of a
    replica that reports no pricing yet (a rough figure for a real model; the one default)."""

    prefill_seconds_per_token: float = 2e-4
    link: KvLink = SAME_NODE

    def per_token(self, reported: float | None) -> float:
        """A replica's seconds per prefill token: as it reports, else the fallback."""
        return self.prefill_seconds_per_token if reported is None else reported


class ThresholdDecider:
    """llm-d's rule: disaggregate when the uncached prompt reaches `threshold` tokens."""

    name = "threshold"

    def __init__(self, threshold: int = 256, costs: PdCosts | None = None):
        self.threshold = threshold
        self.costs = costs or PdCosts()

    def disaggregate(self, view: PdView) -> bool:
        return view.uncached_tokens >= self.threshold


class QueueAwareDecider(ThresholdDecider):
    """The threshold, and then only when the delay disaggregating adds (the prefill replica's
    backlog and the hand-over, to this request) is less than the one colocating adds (this
    prompt's prefill, to this request and to each decode running beside it)."""

    name = "queue_aware"

    def disaggregate(self, view: PdView) -> bool:
        if not super().disaggregate(view):
            return False
        colocated = view.uncached_tokens * self.costs.per_token(view.decode_seconds_per_token)
        prefill = (view.prefill_pending_tokens + view.uncached_tokens) * self.costs.per_token(
            view.prefill_seconds_per_token
        )
        return prefill + self.costs.link.seconds(view.kv_bytes) < colocated * (1 + view.decode_running)


PD_DECIDERS: Registry[type[ThresholdDecider]] = Registry.of_named("P/D decider", (ThresholdDecider, QueueAwareDecider))
