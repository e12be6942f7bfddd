"""One decoder-only transformer for the LLaMA, Qwen2 and GPT-2 families, written for serving:
it runs a flat batch of tokens from many sequences at once (decode tokens and prefill chunks
at different positions) and reads/writes K/V in the slot cache in place.

Weights are taken from a Hugging Face model and re-laid out once: Q, K and V fused into one
matrix, gate and up fused into one, so each layer makes few, large matrix products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replica.kernels import decode_attention
from replica.kernels import fused_ops as fused_kernels
from replica.model.attention import AttentionMetadata, PagedAttentionMetadata, paged_attention, slot_attention
from replica.model.kv_cache import PagedKVCache, SlotKVCache
from replica.model.linear import Linear, gather_skinny_weights

# The weight matrices of a layer (and the LM head) that go through Linear.
_MATRICES = ("qkv", "o", "gate_up", "up", "down", "lm_head")


@dataclass(frozen=True)
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor | None  # GPT-2's LayerNorm; None for RMSNorm


@dataclass(frozen=True)
class Layer:
    """One layer's matrices and norms, gathered once: the forward pass reads them as fields, not
    by name (a name built and looked up per matrix, per layer, per step, is host time)."""

    attn_norm: Norm
    qkv: Linear
    o: Linear
    mlp_norm: Norm
    up: Linear  # gate and up fused (LLaMA), or up alone (GPT-2)
    down: Linear


@dataclass(frozen=True)
class ModelShape:
    family: str  # "llama" (also Qwen2) or "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_positions: int
    rope_theta: float = 10000.0

    @property
    def num_params_per_token(self) -> int:
        """Weights one token multiplies through (matrix products only; 2 FLOPs each)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        mlp = (3 if self.family == "llama" else 2) * h * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * h

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        if config.model_type == "gpt2":
            return cls(
                "gpt2",
                config.vocab_size,
                config.n_embd,
                config.n_layer,
                config.n_head,
                config.n_head,
                config.n_embd // config.n_head,
                config.n_inner or 4 * config.n_embd,
                config.layer_norm_epsilon,
                config.n_positions,
            )
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            "llama",
            config.vocab_size,
            config.hidden_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            config.max_position_embeddings,
            theta,
        )


class Decoder:
    """Weights as a flat dict of tensors (no nn.Module: nothing here trains; the constructor takes
    the matrices out of the `state` it is given and copies the rest). `fused_ops` and
    `decode_kernel` ask for the C++ kernels (per-layer steps; decode attention), used where they
    are built for the weights' device; off, torch's operators serve (what benchmarks compare)."""

    def __init__(
        self,
        shape: ModelShape,
        state: dict[str, torch.Tensor],
        pack_weights: bool = True,
        int8_rows: int = 0,
        fused_ops: bool = True,
        decode_kernel: bool = True,
        measure_int8: bool = True,
        skinny_matmul: bool = True,
    ):
        self.shape = shape
        self.dtype = state["embed"].dtype
        # Matrices become Linear (prepacked where that pays, with a plain copy for the skinny kernel
        # where it pays unless skinny_matmul is off, and an int8 copy for steps of at most int8_rows
        # rows, fewer where measured slower here unless measure_int8 is off); norms, embeddings and
        # biases stay plain.
        # Each matrix is taken out of `state` as its Linear is made, so a weight Linear copies
        # (packed, laid out for the skinny kernel) is freed once its copies exist, not when the
        # whole model is built: the copies of every weight and all the originals are never held
        # at once.
        matrices = [k for k in state if k.rsplit(".", 1)[-1] in _MATRICES]
        self.linear = {
            k: Linear(state.pop(k), state.get(k + "_bias"), pack_weights, int8_rows, measure_int8, skinny_matmul)
            for k in matrices
        }
        # Copies of their own: a tensor loaded from a checkpoint may be a view of the file's memory
        # map, which these few (norms, embeddings) would otherwise keep mapped, and resident, for
        # the replica's life.
        self.w = {k: v.clone() for k, v in state.items()}
        self.layers = [self._layer(f"layers.{i}") for i in range(shape.num_layers)]
        # the skinny kernel's copies as one stream, in the order a step reads them
        gather_skinny_weights(
            [m for layer in self.layers for m in (layer.qkv, layer.o, layer.up, layer.down)] + [self.linear["lm_head"]]
        )
        self.final_norm = self._norm_weights("final_norm")
        device = state["embed"].device
        # RMSNorm, RoPE with the cache write, and SiLU-times-up as C++ kernels where they are built (CPU)
        self.fused_ops = fused_ops and fused_kernels.available(device)
        self.decode_kernel = decode_kernel and decode_attention.available(device)
        if shape.family == "llama":
            inv_freq = 1.0 / shape.rope_theta ** (
                torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim
            )
            freqs = torch.outer(torch.arange(shape.max_positions, dtype=torch.float32), inv_freq)
            angles = torch.cat([freqs, freqs], dim=-1)
            self.rope_cos = angles.cos().to(device, self.dtype)
            # rotate_half(x) * sin == roll(x, half) * sin with the first half's sign flipped.
            half = shape.head_dim // 2
            self.rope_sin = (angles.sin() * torch.cat([-torch.ones(half), torch.ones(half)])).to(device, self.dtype)

    # ---- building from Hugging Face ------------------------------------------------------
    @classmethod
    def from_hf(
        cls,
        hf_model,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        pack_weights: bool = True,
        int8_rows: int = 0,
        fused_ops: bool = True,
        decode_kernel: bool = True,
        measure_int8: bool = True,
        skinny_matmul: bool = True,
    ) -> Decoder:
        shape = ModelShape.from_hf_config(hf_model.config)
        sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
        state = _gpt2_state(sd, shape) if shape.family == "gpt2" else _llama_state(sd, shape)
        state = {k: v.to(device, dtype).contiguous() for k, v in state.items()}
        return cls(shape, state, pack_weights, int8_rows, fused_ops, decode_kernel, measure_int8, skinny_matmul)

    def _norm_weights(self, prefix: str) -> Norm:
        return Norm(self.w[prefix + ".weight"], self.w.get(prefix + ".bias"))

    def _layer(self, p: str) -> Layer:
        up = self.linear[p + (".up" if self.shape.family == "gpt2" else ".gate_up")]
        linear = self.linear
        mlp_norm = self._norm_weights(p + ".mlp_norm")
        return Layer(
            self._norm_weights(p + ".attn_norm"),
            linear[p + ".qkv"],
            linear[p + ".o"],
            mlp_norm,
            up,
            linear[p + ".down"],
        )

    # ---- the forward pass ---------------------------------------------------------------
    def _norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        if norm.bias is not None:  # GPT-2
            return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, self.shape.norm_eps)
        if self.fused_ops:
            return fused_kernels.rms_norm(x, norm.weight, self.shape.norm_eps)
        return F.rms_norm(x, (x.shape[-1],), norm.weight, self.shape.norm_eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim], gathered once per step."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def _rope_and_write(
        self,
        layer: int,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: SlotKVCache | PagedKVCache,
        rows: torch.Tensor,
        cols: torch.Tensor,
    ) -> torch.Tensor:
        """Rotates Q and K (LLaMA), writes row t's K and V to the cache at (rows[t], cols[t]),
        returns Q as [T, heads, head_dim]. rope: the fused kernel's whole cos/sin tables, or the
        torch path's rows gathered at `positions` ([T, 1, head_dim]); None for GPT-2."""
        s = self.shape
        num_q, num_kv, d = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.head_dim
        if self.fused_ops:
            tables = rope or (None, None)
            fused_kernels.rope_write(qkv, positions, *tables, cache.k[layer], cache.v[layer], rows, cols, s.num_heads)
            return qkv.as_strided((qkv.shape[0], s.num_heads, d), (qkv.stride(0), d, 1))  # Q's columns: one op
        v = qkv[:, num_q + num_kv :].view(-1, s.num_kv_heads, d)
        if rope is not None:  # Q and K rotated together: one pass over both
            qk = self._rope(qkv[:, : num_q + num_kv].view(-1, s.num_heads + s.num_kv_heads, d), *rope)
            q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        else:
            q = qkv[:, :num_q].view(-1, s.num_heads, d)
            k = qkv[:, num_q : num_q + num_kv].view(-1, s.num_kv_heads, d)
        cache.write(layer, rows, cols, k, v)
        return q

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata | PagedAttentionMetadata,
        cache: SlotKVCache | PagedKVCache,
        logit_rows: torch.Tensor,  # rows of the flat batch whose next-token logits are wanted
    ) -> torch.Tensor:
        s, w = self.shape, self.w
        x = w["embed"][input_ids]
        if s.family == "gpt2":
            x = x + w["pos_embed"][positions]
        # RoPE's cos/sin, once per step: the kernel reads the whole tables at each row's position
        rope = None
        if s.family == "llama" and self.fused_ops:
            rope = (self.rope_cos, self.rope_sin)
        elif s.family == "llama":
            rope = (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
        paged = isinstance(meta, PagedAttentionMetadata)
        # where each row's K/V goes: (slot, position) in the slot cache, (block, offset) in the paged one
        rows, cols = (meta.block_ids, meta.block_offsets) if paged else (meta.slot_ids, positions)
        # One attention output for every layer: each writes all its rows, and the o-projection has
        # read them before the next layer's attention writes again.
        attn = x.new_empty(x.shape[0], s.num_heads * s.head_dim)
        for i, layer in enumerate(self.layers):
            h = layer.qkv(self._norm(x, layer.attn_norm))
            q = self._rope_and_write(i, h, positions, rope, cache, rows, cols)
            if paged:  # read via block tables
                paged_attention(q, cache.k[i], cache.v[i], meta, self.decode_kernel, attn)
            else:
                slot_attention(q, cache.k[i], cache.v[i], meta, self.decode_kernel, attn)
            x = layer.o(attn, residual=x)
            h = self._norm(x, layer.mlp_norm)
            if s.family == "gpt2":
                h = F.gelu(layer.up(h), approximate="tanh")
            elif self.fused_ops:
                h = fused_kernels.silu_mul(layer.up(h))
            else:
                gate, up = layer.up(h).chunk(2, dim=-1)
                h = F.silu(gate) * up
            x = layer.down(h, residual=x)
        x = self._norm(x[logit_rows], self.final_norm)
        # in the weights' dtype: the sampler widens only the rows that draw (widening every row of
        # a big step is a copy of the whole [rows, vocab] block, a few percent of a bf16 step)
        return self.linear["lm_head"](x)


def _llama_state(sd: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"]}
    out["lm_head"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(shape.num_layers):
        src, p = f"model.layers.{i}", f"layers.{i}"
        attn = [sd[f"{src}.self_attn.{n}_proj.weight"] for n in "qkv"]
        out[p + ".qkv"] = torch.cat(attn, dim=0)
        if f"{src}.self_attn.q_proj.bias" in sd:  # Qwen2
            out[p + ".qkv_bias"] = torch.cat([sd[f"{src}.self_attn.{n}_proj.bias"] for n in "qkv"])
        out[p + ".o"] = sd[f"{src}.self_attn.o_proj.weight"]
        out[p + ".gate_up"] = torch.cat([sd[f"{src}.mlp.gate_proj.weight"], sd[f"{src}.mlp.up_proj.weight"]], dim=0)
        out[p + ".down"] = sd[f"{src}.mlp.down_proj.weight"]
        out[p + ".attn_norm.weight"] = sd[f"{src}.input_layernorm.weight"]
        out[p + ".mlp_norm.weight"] = sd[f"{src}.post_attention_layernorm.weight"]
    return out


def _gpt2_state(sd: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    # GPT-2's Conv1D stores weights as [in, out]; F.linear wants [out, in].
    out = {
        "embed": sd["transformer.wte.weight"],
        "pos_embed": sd["transformer.wpe.weight"],
        "final_norm.weight": sd["transformer.ln_f.weight"],
        "final_norm.bias": sd["transformer.ln_f.bias"],
        "lm_head": sd.get("lm_head.weight", sd["transformer.wte.weight"]),
    }
    for i in range(shape.num_layers):
        src, p = f"transformer.h.{i}", f"layers.{i}"
        out[p + ".qkv"], out[p + ".qkv_bias"] = sd[f"{src}.attn.c_attn.weight"].t(), sd[f"{src}.attn.c_attn.bias"]
        out[p + ".o"], out[p + ".o_bias"] = sd[f"{src}.attn.c_proj.weight"].t(), sd[f"{src}.attn.c_proj.bias"]
        out[p + ".up"], out[p + ".up_bias"] = sd[f"{src}.mlp.c_fc.weight"].t(), sd[f"{src}.mlp.c_fc.bias"]
        out[p + ".down"], out[p + ".down_bias"] = sd[f"{src}.mlp.c_proj.weight"].t(), sd[f"{src}.mlp.c_proj.bias"]
        for norm, hf_norm in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{p}.{norm}.weight"] = sd[f"{src}.{hf_norm}.weight"]
            out[f"{p}.{norm}.bias"] = sd[f"{src}.{hf_norm}.bias"]
    return out
