"""What the memory plan needs of a model: its widths and parameter counts, counted on a meta-device instance.

``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` builds the model without memory or weights, so
every family transformers ships (dense, sliding-window, mixture of experts) is counted exactly, not from a formula.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, counted on a meta-device instance (no weights read).

    Attributes:
        name: architecture class (``Qwen3ForCausalLM``).
        params: parameters (tied embeddings counted once).
        layer_params: parameters of the largest decoder block; ``root_params``: parameters outside the blocks.
        lora_linear: ``sum(in + out)`` over the blocks' linear layers (a LoRA adapter of rank r has r times this).
        hidden, layers, heads, kv_heads, head_dim, vocab, intermediate: the config's widths (``intermediate`` is an
            expert's width for a mixture of experts).
        experts, experts_active: routed experts per layer and experts per token (0, 0 for a dense MLP).
        qk_norm: the blocks normalise queries and keys (Qwen3, Gemma3).
        tied: the LM head shares the input embedding's weight.
    """

    name: str
    params: int
    layer_params: int
    root_params: int
    lora_linear: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    experts: int = 0
    experts_active: int = 0
    qk_norm: bool = False
    tied: bool = True

    def block_elements(self, seq_len: int, fused_attention: bool) -> int:
        """Activation elements one block keeps for its backward, per token (Korthikanti et al. 2022, §4.1)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = (self.experts + self.experts_active * (h + 4 * self.intermediate)) if self.experts else 4 * self.intermediate
        n = 4 * h + 2 * q + 2 * kv + mlp + ((q + kv) if self.qk_norm else 0)
        return n + (0 if fused_attention else self.heads * seq_len)


def model_shape(hf_config, trust_remote_code: bool = False) -> ModelShape:
    """Count ``hf_config``'s model (a transformers ``PretrainedConfig``) on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = int(text.num_hidden_layers)
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers),
                 key=lambda m: sum(p.numel() for p in m.parameters()))
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    params = sum(p.numel() for p in model.parameters())
    lora = sum(m.in_features + m.out_features for m in blocks.modules() if isinstance(m, torch.nn.Linear))
    heads = int(text.num_attention_heads)
    experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
    return ModelShape(
        name=type(model).__name__, params=params, layer_params=max(per_block), root_params=params - sum(per_block),
        lora_linear=lora, hidden=int(text.hidden_size), layers=layers, heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads), vocab=int(text.vocab_size),
        intermediate=int((getattr(text, "moe_intermediate_size", None) if experts else None) or text.intermediate_size),
        experts=experts, experts_active=int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
        qk_norm=any(n.endswith("q_norm") for n, _ in model.named_modules()),
        tied=bool(getattr(text, "tie_word_embeddings", getattr(hf_config, "tie_word_embeddings", True))),
    )


@functools.lru_cache(maxsize=8)
def shape_of_path(path: str, trust_remote_code: bool) -> ModelShape:
    """The :class:`ModelShape` of the model folder ``path`` (its ``config.json`` only), cached per path."""
    from transformers import AutoConfig

    return model_shape(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), trust_remote_code)
