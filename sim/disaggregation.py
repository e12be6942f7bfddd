"""Prefill/decode disaggregation in the simulator: the cluster's two pools on virtual time, with
the objects the cluster runs.

The first `prefill_replicas` replicas prefill: a request the two-pool router
(`router.pd_router.PdRouter`, with its P/D decider) sends there is queued with
`Engine.add_request(hand_over=True)`, so once its first token is sampled it ends on that replica
with a `Handover`. The hand-over then travels for `KvLink.seconds(nbytes)` (the fake model's
stated K/V bytes over the link's bandwidth, plus its latency), and on arrival the router places it
on the decode pool as a request moved off the prefill replica, whose engine takes it in with
`Engine.import_request` and decodes it on from its K/V. A decode pool with every replica at its
bound refuses it: it waits the refusal's retry-after and asks again, as the client's placement
does, so no request is lost. What is left out: the decode side's write of the K/V into its cache
costs nothing beyond the link's price."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator

from protocol.errors import OverloadedError
from protocol.handover import CROSS_NODE, SAME_NODE, Handover, KvLink
from protocol.routing import RouteRequest
from replica.engine import StepResult
from replica.errors import ConfigError
from replica.model.fake import DEFAULT_KV_BYTES_PER_TOKEN, CostModel
from router.pd_decider import PD_DECIDERS
from router.pd_router import PdPools, PdRouter
from router.router import Router
from sim.simulator import SimulationConfig, SimulationResult, Simulator, _Replica
from workloads.workload import Workload, WorkloadRequest

# The links an experiment file names (`[cluster] kv_link`).
KV_LINKS = {"same_node": SAME_NODE, "cross_node": CROSS_NODE}

# The shortest wait before a refused hand-over asks the router again (its retry-after may be 0).
MIN_RETRY_SECONDS = 0.01


class SimPools(BaseModel):
    """A simulated cluster's pools: its first `prefill_replicas` replicas prefill, the rest
    decode; the P/D decider and its threshold; and the link a hand-over's K/V cross."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_replicas: PositiveInt
    decider: str = Field("threshold", description="P/D decider (router.pd_decider.PD_DECIDERS)")
    threshold: NonNegativeInt = Field(256, description="uncached prompt tokens from which a request is disaggregated")
    link: KvLink = Field(SAME_NODE, description="what moving a hand-over's K/V costs")

    @field_validator("decider")
    @classmethod
    def _known_decider(cls, name: str) -> str:
        return PD_DECIDERS.check(name)

    def pd_pools(self, replica_ids: list[str]) -> PdPools:
        roles = {rid: "prefill" if i < self.prefill_replicas else "decode" for i, rid in enumerate(replica_ids)}
        return PdPools(roles, self.decider, self.threshold, DEFAULT_KV_BYTES_PER_TOKEN, self.link)


@dataclass(frozen=True)
class Transfer:
    """One hand-over's K/V on the link: from which replica, how many bytes, in how long."""

    request_id: str
    source: str
    nbytes: int
    seconds: float


class PdSimulator(Simulator):
    """`Simulator` over a prefill and a decode pool (see the module docstring); `transfers`
    holds every hand-over, in the order they left their prefill replica."""

    _ONE_ROUTER = True  # a hand-over is routed again by the one router

    def __init__(
        self,
        workload: Workload,
        config: SimulationConfig,
        pools: SimPools,
        cost: CostModel | None = None,
        check_invariants: bool = False,
    ):
        if pools.prefill_replicas >= config.num_replicas:
            raise ConfigError(
                f"{pools.prefill_replicas} prefill replicas of {config.num_replicas} leave no decode replica"
            )
        self.pools = pools  # before the base class makes its router from it
        super().__init__(workload, config, cost, check_invariants)
        self.transfers: list[Transfer] = []
        self._on_link: list[tuple[float, int, Handover, str]] = []  # (arrival, seq, hand-over, source)
        self._routes: dict[str, RouteRequest] = {}

    def _make_router(self, ids: list[str], seed: int) -> Router:
        c = self.config
        return PdRouter(
            ids,
            self.pools.pd_pools(ids),
            policy=c.routing_policy,
            clock=self.clock,
            seed=seed,
            tpot_slo=c.slo.tpot,
            decision_figures=self.keep_records,
            flow=c.flow,  # at the front door: a hand-over to the decode pool is never held
        )

    def _hands_over(self, replica_id: str) -> bool:
        return self.router.pools.role(replica_id) == "prefill"

    def _route_request(self, rid: str, spec: WorkloadRequest, prompt: list[int], sent: float) -> RouteRequest:
        route = super()._route_request(rid, spec, prompt, sent)
        self._routes[rid] = route  # asked again, moved off its prefill replica, when handed over
        return route

    def _end_step(self, replica: _Replica, result: StepResult, now: float) -> None:
        super()._end_step(replica, result, now)
        for output in result.outputs:
            if output.handover is not None:
                seconds = self.pools.link.seconds(output.handover.nbytes)
                self.transfers.append(Transfer(output.request_id, replica.replica_id, output.handover.nbytes, seconds))
                heapq.heappush(self._on_link, (now + seconds, next(self._seq), output.handover, replica.replica_id))

    def _next_time(self) -> float | None:
        soonest = super()._next_time()
        if not self._on_link:
            return soonest
        landing = self._on_link[0][0]
        return max(landing if soonest is None else min(soonest, landing), self.clock.now())

    def _run_timers(self, now: float) -> None:
        super()._run_timers(now)
        while self._on_link and self._on_link[0][0] <= now:
            _, _, handover, source = heapq.heappop(self._on_link)
            self._deliver(handover, source, now)
        self._take_decisions()

    def _deliver(self, handover: Handover, source: str, now: float) -> None:
        """Place a hand-over that reached the decode pool, or queue its retry if it is full."""
        try:
            decision = self.router.route(replace(self._routes[handover.request_id], moved_from=source))
        except OverloadedError as err:
            retry = now + max(err.retry_after, MIN_RETRY_SECONDS)
            heapq.heappush(self._on_link, (retry, next(self._seq), handover, source))
            return
        replica = self._by_id[decision.replica_id]
        replica.engine.import_request(handover)
        self._requests[handover.request_id] = (replica.engine.requests[handover.request_id], replica.replica_id)
        self._dirty.add(replica.index)


def simulate_pools(
    workload: Workload,
    config: SimulationConfig,
    pools: SimPools,
    cost: CostModel | None = None,
    check_invariants: bool = False,
) -> tuple[SimulationResult, list[Transfer]]:
    """Run `workload` on a simulated cluster with prefill and decode pools; its result and its hand-overs."""
    simulator = PdSimulator(workload, config, pools, cost, check_invariants)
    return simulator.run(), simulator.transfers


def transfer_summary(transfers: list[Transfer]) -> dict[str, float | int]:
    """A run's hand-overs as its config records them: how many, their bytes and link seconds."""
    seconds = sorted(t.seconds for t in transfers)
    return {
        "handovers": len(transfers),
        "handover_bytes": sum(t.nbytes for t in transfers),
        "handover_seconds_mean": sum(seconds) / len(seconds) if seconds else 0.0,
        "handover_seconds_max": seconds[-1] if seconds else 0.0,
    }
