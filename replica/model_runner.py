"""Runs one scheduler step on the real model: lays the step's rows out as one flat batch
(decode tokens, prefill chunks and static-batch padding rows together), runs one forward
pass over it, and samples a token for every sequence whose pending tokens are all in."""

from __future__ import annotations

import torch

from replica.attention import AttentionMetadata, build_group
from replica.kv_cache import SlotKVCache
from replica.model import Decoder
from replica.model_loader import load_hf_model
from replica.sampler import Sampler
from replica.scheduler import SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(device: str) -> str:
    """"auto" takes the GPU when there is one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class ModelRunner:
    def __init__(self, model: str, num_slots: int, max_seq_len: int, dtype: str = "float32",
                 device: str = "auto", seed: int = 0):
        self.device = pick_device(device)
        hf, self.tokenizer = load_hf_model(model, seed=seed)
        self.model = Decoder.from_hf(hf, DTYPES[dtype], self.device)
        shape = self.model.shape
        self.vocab_size, self.max_model_len = shape.vocab_size, shape.max_positions
        eos = hf.generation_config.eos_token_id if hf.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {t for t in (*eos, self.tokenizer.eos_token_id) if t is not None}
        del hf
        self.cache = SlotKVCache(shape.num_layers, num_slots, max_seq_len, shape.num_kv_heads, shape.head_dim,
                                 DTYPES[dtype], self.device)
        self.sampler = Sampler(seed)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def execute(self, out: SchedulerOutput) -> list[int]:
        """One forward pass; returns one token per chunk with `samples`, in chunk order."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        single: list[bool] = []  # the row is its sequence's only one this step (a decode, say)
        logit_rows: list[int] = []
        for chunk in out.chunks:
            r = chunk.request
            ids += r.token_ids(chunk.start, chunk.start + chunk.num_tokens)
            positions += range(chunk.start, chunk.start + chunk.num_tokens)
            slots += [r.slot] * chunk.num_tokens
            offsets += range(chunk.num_tokens)
            single += [chunk.num_tokens == 1] * chunk.num_tokens
            if chunk.samples:
                logit_rows.append(len(ids) - 1)
        for held in out.held_rows:
            # Padding: recompute the row's last token in place (same K/V, same value), as a
            # padded static batch would, and throw the result away.
            last = held.num_computed_tokens - 1
            if last >= 0:
                ids += held.token_ids(last, last + 1)
                positions.append(last)
                slots.append(held.slot)
                offsets.append(0)
                single.append(True)
        # Two attention groups, so single-token rows are not padded to a long prefill chunk.
        q_per_kv = self.model.shape.num_heads // self.model.shape.num_kv_heads
        groups = [
            build_group(rows, [slots[i] for i in rows], [offsets[i] for i in rows], [positions[i] for i in rows],
                        q_per_kv, self.device)
            for flag in (True, False) if (rows := [i for i, s in enumerate(single) if s is flag])
        ]
        meta = AttentionMetadata(self._tensor(slots), groups, q_per_kv)
        logits = self.model.forward(self._tensor(ids), self._tensor(positions), meta, self.cache,
                                    self._tensor(logit_rows))
        return self.sampler.sample(logits, [c.request for c in out.chunks if c.samples])
