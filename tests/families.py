"""Tiny random models of the families TPU users train, built offline from transformers' config classes (nothing is
downloaded). Shared by the trainer, sampler and export tests.

- :func:`tiny_config`: a family's tiny config in memory (no tokenizer, no disk); a test that needs other shapes or
  token ids passes them as overrides;
- :func:`build_tiny_model`: a tiny random model of a family with the SmolLM2 tokenizer, written to a folder.
"""

from __future__ import annotations

from pathlib import Path

# family -> (config class name, model class name, family-specific config keys)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",  # sliding window on the second layer only
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # query/key norm
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5, "head_dim": 16}),  # every layer windowed
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",  # sliding and global layers, embedding scale, tied
        {
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "head_dim": 16,
            "num_hidden_layers": 3,
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
}


#: the shape every tiny model shares unless a test overrides it: 2 layers, 64 wide, 4 query heads over 2 key/value heads
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def tiny_config(family: str, vocab_size: int = 128, attn_implementation: str | None = None, **overrides):
    """A tiny ``family`` config (a transformers config object, in memory): :data:`TINY`'s shape, the family's own
    keys (:data:`FAMILIES`), then ``overrides`` (any config key: shapes, token ids, ``tie_word_embeddings``);
    ``attn_implementation``: the attention the model's modules call (``None``: transformers' default)."""
    import transformers

    config_name, _, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{"vocab_size": vocab_size, **TINY, **extra, **overrides})
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def build_tiny_model(
    family: str,
    tokenizer_dir: Path,
    out: Path,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    weight_std: float = 0.2,
    **overrides,
) -> Path:
    """Write a 2-3 layer, 64-wide random ``family`` model with the tokenizer of ``tokenizer_dir`` into ``out``
    (``overrides``: config keys, e.g. a larger shape; matrices drawn with ``weight_std``)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    _, model_name, _ = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = tiny_config(family, vocab_size=len(tok), attn_implementation=attn_implementation, **{**ids, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # random weights far from zero, so masking mistakes show in the numbers
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, weight_std)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
