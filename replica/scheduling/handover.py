"""Moving a running request and its K/V from one engine to another (prefill/decode
disaggregation, `protocol.handover`): the export a prefill replica makes once it has sampled a
request's first token, and the write a decode replica makes when it admits the request.

An imported request waits in the queue like any other, carrying its K/V (`Request.kv_in`); the
scheduler admits it as it would a prefix-cache hit of those tokens (so it needs room for them,
and queues, not recomputes, while there is none), and the engine writes them into its rows
before the step that runs it. Prefix-cache blocks the admission shared are skipped: they hold
the same prefix already, and other requests may be reading them. Pure Python: the tensors are
the runner's cache's business (`kv_cache.KVCache.read_tokens`, `write_tokens`)."""

from __future__ import annotations

from typing import Any, Protocol

from protocol.handover import Handover
from replica.scheduling.request import Request, RequestStatus
from replica.scheduling.slot_table import SlotTable


class KvTensors(Protocol):
    """What the hand-over needs from a runner's K/V cache (the real one; fakes have none)."""

    bytes_per_token: int

    def read_tokens(self, request: Request, num_tokens: int) -> Any: ...

    def write_tokens(self, request: Request, kv: Any, start: int) -> None: ...

    def kv_mismatch(self, kv: Any) -> str | None: ...


def can_export(request: Request) -> bool:
    """Only a decoding request has K/V for everything but its last sampled token, the one
    state a receiver can continue from with a decode row."""
    return request.status is RequestStatus.RUNNING and request.is_decoding


class KvTransfer:
    """One engine's side of hand-overs: exporting its requests, and the hand-overs it took in
    that wait in its queue with their K/V until admitted (`pending`). `cache` is its runner's
    (None for a fake model, whose hand-overs are priced at `fake_bytes_per_token`)."""

    def __init__(self, cache: KvTensors | None, block_size: int, fake_bytes_per_token: int = 0):
        self.cache = cache
        self.block_size = block_size
        self.fake_bytes_per_token = fake_bytes_per_token
        self.pending: dict[str, Request] = {}
        self.tokens_written = 0  # K/V tokens written from hand-overs here, not computed

    def export(self, request: Request, delivered_text: str, now: float) -> Handover:
        """The request's hand-over: its tokens, the text its caller has, and a copy of its K/V,
        taken before its rows are freed, so the sender may free them at once."""
        num_kv = request.num_computed_tokens
        kv = None if self.cache is None else self.cache.read_tokens(request, num_kv)
        return Handover(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            text=delivered_text,
            sampling=request.params.model_dump(),
            arrival_time=request.arrival_time,
            num_kv_tokens=num_kv,
            kv=kv,
            dtype="" if kv is None else str(kv.dtype).removeprefix("torch."),
            nbytes=num_kv * self.fake_bytes_per_token if kv is None else kv.numel() * kv.element_size(),
            block_size=self.block_size,
            made=now,
            token_times=list(request.token_times),
            num_preemptions=request.num_preemptions,
        )

    def unusable(self, handover: Handover) -> str | None:
        """Why this receiver cannot take the hand-over's K/V, so must recompute them (None: it can)."""
        if self.cache is None:
            return None if handover.kv is None else "this replica's fake model keeps no K/V tensors"
        if handover.kv is None:
            return "the hand-over carries no K/V tensors (its sender is a fake model)"
        return self.cache.kv_mismatch(handover.kv)

    def take(self, request: Request, handover: Handover) -> bool:
        """Give a request queued from the hand-over's tokens its K/V, times and preemptions;
        False (it recomputes) where the K/V cannot be used here."""
        request.token_times = list(handover.token_times) or request.token_times
        request.num_preemptions = handover.num_preemptions
        if self.unusable(handover) is not None:
            return False
        request.kv_in = handover
        self.pending[request.request_id] = request
        return True

    def write_admitted(self, slots: SlotTable) -> None:
        """Write the K/V of the pending hand-overs the last schedule admitted into their rows,
        past the prefix-cache blocks their admission shared, before the step runs them."""
        for request_id, request in list(self.pending.items()):
            if request.slot is None:
                continue
            shared = slots.shared_prefix_tokens(request)
            if self.cache is not None:
                self.cache.write_tokens(request, request.kv_in.kv, shared)
            self.tokens_written += request.num_kv_in - shared
            request.kv_in = None
            del self.pending[request_id]
