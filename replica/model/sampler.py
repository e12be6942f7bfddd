"""Turns each sequence's next-token logits into a token, with per-request parameters in one
batch: greedy rows take the argmax; the others get temperature, top-k and top-p applied
together (vectorised over rows) and draw from their own seeded generator."""

from __future__ import annotations

import torch

from replica.kernels import fused_ops
from replica.scheduling.request import Request

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what `fused_ops.argmax` reads


def position_seed(seed: int, position: int) -> int:
    """The generator seed for output position `position` of a request seeded `seed` (an odd
    64-bit multiplier spreads neighbouring positions apart)."""
    return (seed + (position + 1) * 0x9E3779B97F4A7C15) % 2**64


class Sampler:
    def __init__(
        self, seed: int | None = None, eos_token_ids: set[int] | frozenset[int] = frozenset(), kernel: bool = False
    ):
        """kernel: greedy rows take the C++ argmax (`fused_ops.argmax`) where it is built and the
        logits are on the CPU; off, torch's."""
        self._kernel = kernel and fused_ops.available("cpu")
        self._eos = sorted(eos_token_ids)  # masked for a request that has not made its min_tokens yet
        self._shared = torch.Generator()  # for requests that give no seed
        self._shared.manual_seed(seed) if seed is not None else self._shared.seed()
        self._per_request: dict[str, torch.Generator] = {}

    def _generator(self, request: Request) -> torch.Generator:
        """A seeded request draws each token from a generator seeded by (seed, position), so
        the token at a position depends on nothing else: a request resumed on another replica
        after its first one died (it arrives with the tokens already delivered as output)
        continues the very sequence it would have made, as does one re-prefilled after a
        preemption."""
        if request.params.seed is None:
            return self._shared
        gen = self._per_request.get(request.request_id)
        if gen is None:
            gen = self._per_request[request.request_id] = torch.Generator()
        return gen.manual_seed(position_seed(request.params.seed, request.num_output_tokens))

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax: the C++ kernel where it serves (torch's CPU argmax is a scalar loop,
        a large share of a big decode step's sampling), else torch's; the same tokens either way."""
        serves = logits.is_cpu and logits.dtype in _KERNEL_DTYPES and logits.dim() == 2 and logits.stride(-1) == 1
        if self._kernel and serves:
            return fused_ops.argmax(logits)
        return logits.argmax(dim=-1)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [rows, vocab] in the model's dtype, row i for requests[i] (the drawing rows are
        widened to float32 here; greedy rows take the argmax of the values as they are, which is
        the argmax of their float32 copy)."""
        held: list[int] = []  # rows whose request has not made its min_tokens yet
        rows: list[int] = []  # rows that draw (not greedy)
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.params.min_tokens:
                held.append(i)
            if not r.params.greedy:
                rows.append(i)
        if held:  # vLLM's min_tokens: EOS and stop ids may not come yet (a copy: logits may be an inference tensor)
            logits = logits.clone()
            for i in held:
                logits[i, self._eos + requests[i].params.stop_token_ids] = float("-inf")
        tokens = self._greedy(logits).tolist()
        if not rows:
            return tokens
        params = [requests[i].params for i in rows]
        vocab = logits.shape[-1]
        scaled = logits[rows].float().cpu() / torch.tensor([[p.temperature] for p in params])
        ranked, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab)
        top_k = torch.tensor([[p.top_k or vocab] for p in params])
        probs = ranked.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the best token always stays
        drop = (rank >= top_k) | (mass_before >= torch.tensor([[p.top_p] for p in params]))
        probs = ranked.masked_fill(drop, float("-inf")).softmax(dim=-1)
        for j, i in enumerate(rows):
            pick = torch.multinomial(probs[j], 1, generator=self._generator(requests[i]))
            tokens[i] = int(order[j, pick])
        return tokens
