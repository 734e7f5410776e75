"""A decode step for Llama-architecture models without the Hugging Face module stack.

The sampler's decode step is one new token per row. For SmolLM2-135M at batch 16 on one CPU core the linear
layers take ~70% of a step through ``transformers``' forward and the rest is attention plus per-call overhead:
mask construction every call, the cache's ``update``, output capture, keyword plumbing through 30 layers, and a
norm written as six tensor operations. :class:`LeanDecoder` runs the same computation on the same modules and
weights (its linear layers are the model's own ``nn.Linear`` modules, so the sampler's oneDNN-packed forward
applies) with:

* one boolean mask per step instead of one per layer, sliced to the cache slots written so far;
* ``torch.nn.functional.rms_norm`` for the model's RMSNorm (``x * rsqrt(mean(x^2) + eps) * weight``; Zhang &
  Sennrich 2019, as ``LlamaRMSNorm`` computes it);
* the model's own ``apply_rotary_pos_emb`` and rotary embedding module, so any RoPE scaling the config names
  is the model's;
* keys and values written straight into the static cache's tensors, and single-token attention from
  :func:`rl_tpu.sampler.attention.decode_attention`.

It is built only for a float32 model whose class is one of :data:`SUPPORTED` and whose layers have the plain
Llama structure (no sliding window, no query/key norm, SiLU-gated MLP); :meth:`LeanDecoder.build` returns
``None`` otherwise and the sampler keeps the model's own forward. The tests compare its logits and cache writes
with the model's forward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers import StaticCache

from rl_tpu.sampler.attention import decode_attention

#: causal-LM classes whose decoder layers are Llama's: pre-norm attention (q/k/v/o projections, optional bias)
#: and a SiLU-gated MLP, RMSNorm, RoPE.
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def _rms_eps(norm: torch.nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps) if eps is not None and type(norm).__name__.endswith("RMSNorm") else None


class LeanDecoder:
    """One decode step of a supported model: ``step(tokens, positions, cache, slot, mask) -> logits``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, list(inner.layers), inner.norm, inner.rotary_emb
        self.head = model.lm_head
        first = self.layers[0].self_attn
        self.apply_rotary = sys.modules[type(first).__module__].apply_rotary_pos_emb
        self.head_dim = int(first.head_dim)
        self.hidden = int(model.config.hidden_size)
        self.qkv: list = [None] * len(self.layers)  # per layer: fused q/k/v function, or None

    def use_packed(self, packed) -> None:
        """Compute each layer's query, key and value projections as one product on ``packed``'s fused copy
        (:meth:`rl_tpu.sampler.packed.PackedLinears.fused`; call within its ``applied`` block)."""
        self.qkv = [
            packed.fused((l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)) if packed is not None else None
            for l in self.layers
        ]

    @classmethod
    def build(cls, model: torch.nn.Module) -> LeanDecoder | None:
        """A decoder for ``model``, or ``None`` when its structure is not the one this step computes."""
        cfg = model.config
        inner = getattr(model, "model", None)
        if type(model).__name__ not in SUPPORTED or inner is None or getattr(model, "lm_head", None) is None:
            return None
        if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return None
        if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
            return None
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
            return None
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
            return None  # Mistral reads the window from its config, Qwen2 from use_sliding_window and layer_types
        if next(model.parameters()).dtype != torch.float32 or _rms_eps(inner.norm) is None:
            return None
        mod = sys.modules.get(type(inner.layers[0].self_attn).__module__)
        if mod is None or not hasattr(mod, "apply_rotary_pos_emb"):
            return None
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or getattr(attn, "sliding_window", None) is not None:
                return None
            if not all(isinstance(getattr(attn, p, None), torch.nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
                return None
            if hasattr(attn, "q_norm") or hasattr(attn, "k_norm") or not hasattr(attn, "head_dim"):
                return None
            if not all(isinstance(getattr(mlp, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
                return None
            if _rms_eps(layer.input_layernorm) is None or _rms_eps(layer.post_attention_layernorm) is None:
                return None
        return cls(model)

    def _rms(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden,), norm.weight, norm.variance_epsilon)

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticCache, slot: int, mask: torch.Tensor
    ) -> torch.Tensor:
        """Run one token per row and write its keys and values at cache slot ``slot``.

        Args:
            tokens: ``(batch,)`` int64 token ids.
            positions: ``(batch,)`` int64 position ids (a row's token count before this one).
            cache: the batch's static cache, prefilled; every layer initialised, ``slot`` < its length.
            slot: cache slot of this step's token (the same for every row: rows are left-padded).
            mask: ``(batch, 1, 1, cache_len)`` bool, True where a row's slot holds a real token.

        Returns:
            ``(batch, vocab)`` float32 logits of the next token.
        """
        batch = tokens.shape[0]
        kv_len = slot + 1
        mask = mask[..., :kv_len]
        where = torch.tensor([slot], device=tokens.device)
        h = self.embed(tokens[:, None])  # (batch, 1, hidden)
        cos, sin = self.rotary(h, position_ids=positions[:, None])  # (batch, 1, head_dim) each
        hd = self.head_dim
        for layer, cached, qkv in zip(self.layers, cache.layers, self.qkv):
            attn, mlp = layer.self_attn, layer.mlp
            x = self._rms(h, layer.input_layernorm)
            q, k, v = qkv(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            q = q.view(batch, 1, -1, hd).transpose(1, 2)  # (batch, heads, 1, head_dim)
            k = k.view(batch, 1, -1, hd).transpose(1, 2)  # (batch, kv_heads, 1, head_dim)
            v = v.view(batch, 1, -1, hd).transpose(1, 2)
            q, k = self.apply_rotary(q, k, cos, sin)
            cached.keys.index_copy_(2, where, k)
            cached.values.index_copy_(2, where, v)
            cached.cumulative_length.fill_(kv_len)
            out = decode_attention(q, cached.keys[:, :, :kv_len], cached.values[:, :, :kv_len], mask, attn.scaling)
            h = h + attn.o_proj(out.reshape(batch, 1, -1))
            x = self._rms(h, layer.post_attention_layernorm)
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        h = self._rms(h, self.norm)
        return self.head(h[:, 0])  # (batch, vocab)
