"""The router of a cluster with prefill and decode pools (prefill/decode disaggregation).

Each replica has a role: `prefill` (it computes prompts and hands each request over once its
first token is out), `decode` or `mixed` (it serves a request to the end; a mixed replica is
one of a cluster without roles, or one an autoscaler added). A new request is scored on both
pools, each by its own routing policy from the registry, and the P/D decider
(`router.pd_decider`) sends it to the prefill pool's choice (disaggregated) or to the decode
pool's (colocated: that replica prefills and decodes it). A request moved off a replica (handed
over by a prefill replica, or off a lost or draining one) has its first token already: it goes
to the decode pool only. Pure, like `Router`, so the simulator can run it too."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.handover import SAME_NODE, KvLink
from protocol.routing import RouteRequest
from router.load import ReplicaView
from router.pd_decider import PD_DECIDERS, PdCosts, PdView
from router.policies import DEFAULT_POLICY, RoutingPolicy, make_routing_policy
from router.router import Router

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class PdPools:
    """Which replicas prefill (the rest decode), the P/D decider by name with its threshold,
    the K/V a hand-over sends per prompt token and the link they cross (what the queue-aware
    decider prices a hand-over at: an experiment's `kv_link`, in its simulation and on its Ray
    cluster alike, or `slotserve up --kv-link`)."""

    roles: dict[str, str] = field(default_factory=dict)
    decider: str = "threshold"
    threshold: int = 256
    kv_bytes_per_token: int = 0
    link: KvLink = SAME_NODE

    def role(self, replica_id: str) -> str:
        return self.roles.get(replica_id, "mixed")


class PdRouter(Router):
    """`Router` over two pools: `policy` routes the decode pool, `prefill_policy` the prefill
    pool (the same one by default); both hear every load report and completion."""

    def __init__(self, replica_ids: list[str], pools: PdPools, prefill_policy: str | None = None, **kwargs):
        super().__init__(replica_ids, **kwargs)
        self.pools = pools
        self.decider = PD_DECIDERS[pools.decider](threshold=pools.threshold, costs=PdCosts(link=pools.link))
        self.prefill_policy = self._prefill_policy(prefill_policy or kwargs.get("policy", DEFAULT_POLICY))
        self.disaggregated = self.colocated = 0

    def _prefill_policy(self, name: str) -> RoutingPolicy:
        policy = make_routing_policy(name, self.seed + 1, self.tpot_slo)
        policy.attach_block_index(self.block_index)
        return policy

    def _choose(self, request: RouteRequest, now: float) -> tuple[RoutingPolicy, list[ReplicaView], int, list[float]]:
        views = self.load.routable_views(now)
        decode = [v for v in views if self.pools.role(v.replica_id) != "prefill"]
        prefill = [v for v in views if self.pools.role(v.replica_id) == "prefill"]
        if request.moved_from is not None or not prefill:
            if not decode:  # it waits for a decode replica (the refusal's retry-after)
                raise self._reject("router", 0, "no decode-pool replica is up", 1.0)
            return self.policy, decode, *self.policy.choose(request, decode)
        p_index, p_scores = self.prefill_policy.choose(request, prefill)
        if decode:
            d_index, d_scores = self.policy.choose(request, decode)
            if not self.decider.disaggregate(self._pd_view(request, prefill[p_index], decode[d_index])):
                self.colocated += 1
                return self.policy, decode, d_index, d_scores
        self.disaggregated += 1  # with no decode replica up, it waits for one after its prefill
        return self.prefill_policy, prefill, p_index, p_scores

    def _pd_view(self, request: RouteRequest, prefill: ReplicaView, decode: ReplicaView) -> PdView:
        cached = self.prefill_policy.believed_cached(request, prefill.replica_id) or 0
        return PdView(
            uncached_tokens=max(0, request.prompt_len - cached),
            kv_bytes=request.prompt_len * self.pools.kv_bytes_per_token,
            # The router's own count too: a report taken before requests were routed there
            # (an idle replica reports again only after its next step) would say it is empty.
            decode_running=max(decode.report.running if decode.report is not None else 0, decode.in_flight),
            prefill_pending_tokens=prefill.report.prefill_tokens_pending if prefill.report is not None else 0,
            decode_seconds_per_token=_prefill_price(decode),
            prefill_seconds_per_token=_prefill_price(prefill),
        )

    def set_policy(self, policy: str, tpot_slo: float | None = None) -> None:
        super().set_policy(policy, tpot_slo)
        self.prefill_policy = self._prefill_policy(policy)

    def complete(self, request_id: str, replica_id: str | None = None, output_len: int | None = None) -> bool:
        self.prefill_policy.completed(request_id, output_len)
        return super().complete(request_id, replica_id, output_len)

    def report(self, load) -> bool:
        kept = super().report(load)
        if kept:
            self.prefill_policy.reported(load)
        return kept

    def status(self) -> dict:
        return {
            **super().status(),
            "roles": {r: self.pools.role(r) for r in self.replica_ids},
            "pd_decider": self.decider.name,
            "disaggregated": self.disaggregated,
            "colocated": self.colocated,
        }


def _prefill_price(view: ReplicaView) -> float | None:
    """Seconds per prefill token by the pricing on the replica's last report (None: it has none)."""
    report = view.report
    return None if report is None or report.pricing is None else report.pricing.cost.c_prefill
