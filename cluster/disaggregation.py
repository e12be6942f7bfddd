"""A cluster's prefill and decode pools (prefill/decode disaggregation): which replica has which
role, and what the router's two pools are (`router.pd_router`). A prefill replica computes each
request's prompt and first token and hands it over with its K/V; the client then places it on
the decode pool, whose replica fetches the K/V from the prefill replica directly
(`ReplicaActor.submit(handover_from=...)`) or computes them again when that fails
(`cluster.placement`)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator

from protocol.handover import SAME_NODE, KvLink
from replica.model.fake import DEFAULT_KV_BYTES_PER_TOKEN
from router.pd_decider import PD_DECIDERS
from router.pd_router import PdPools


class PoolsSpec(BaseModel):
    """The pool fields of `cluster.deploy.ClusterSpec` (its base), which also holds
    `num_replicas` and `autoscale`: with pools, the cluster has prefill_replicas +
    decode_replicas replicas, the prefill ones first."""

    prefill_replicas: int = Field(
        0, ge=0, description="replicas in the prefill role (with decode_replicas: num_replicas is their sum)"
    )
    decode_replicas: int = Field(0, ge=0, description="replicas in the decode role")
    pd_decider: str = Field("threshold", description="P/D decider: which requests are disaggregated")
    pd_threshold: int = Field(
        256, ge=0, description="uncached prompt tokens from which the P/D decider disaggregates a request"
    )
    kv_link: KvLink = Field(
        SAME_NODE,
        description="the link the queue-aware P/D decider prices a hand-over's K/V on (an experiment's "
        "`kv_link`, so its simulation and its Ray cluster decide alike; `slotserve up --kv-link`)",
    )

    @field_validator("pd_decider")
    @classmethod
    def _known_decider(cls, name: str) -> str:
        return PD_DECIDERS.check(name)

    def role(self, index: int) -> str:
        """Replica `replica-{index}`'s role: the first `prefill_replicas` prefill, the next
        `decode_replicas` decode; mixed without pools (and past them)."""
        if index < self.prefill_replicas:
            return "prefill"
        return "decode" if index < self.prefill_replicas + self.decode_replicas else "mixed"

    def pd_pools(self) -> PdPools | None:
        """The router's two pools (None: one pool of mixed replicas)."""
        if not self.prefill_replicas:
            return None
        roles = {f"replica-{i}": self.role(i) for i in range(self.prefill_replicas + self.decode_replicas)}
        # A fake's K/V are priced at the default model's per-token size, and so is a real model's.
        return PdPools(roles, self.pd_decider, self.pd_threshold, DEFAULT_KV_BYTES_PER_TOKEN, self.kv_link)

    @model_validator(mode="after")
    def _pools_fit(self) -> PoolsSpec:
        pools = self.prefill_replicas + self.decode_replicas
        if not pools:
            return self
        if not (self.prefill_replicas and self.decode_replicas):
            raise ValueError(
                f"give both prefill_replicas and decode_replicas, or neither; got {self.prefill_replicas} "
                f"prefill and {self.decode_replicas} decode"
            )
        if "num_replicas" in self.model_fields_set and self.num_replicas != pools:
            raise ValueError(f"num_replicas {self.num_replicas} must be prefill_replicas + decode_replicas = {pools}")
        if self.autoscale is not None:
            raise ValueError("autoscaling scales one pool of mixed replicas: give no prefill/decode replicas with it")
        self.num_replicas = pools
        return self
