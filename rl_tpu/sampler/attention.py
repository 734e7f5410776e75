"""Grouped-query attention for the sampler without copying the KV cache per step.

transformers' ``sdpa`` attention expands grouped key/value heads to the full head count (``repeat_kv``, a copy)
whenever an attention mask is given, and the sampler always gives one (left padding, static cache). With a static
cache that copy covers the whole cache, every layer, every step: for SmolLM2-135M at batch 16 it costs more than
the attention itself. ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` (torch >= 2.5)
reads the grouped heads in place and gives the same result.

:func:`gqa_attention` switches a model to that function for the duration of a ``with`` block, registered under
:data:`ATTN_NAME` with transformers' ``AttentionInterface`` (and its mask builder with ``AttentionMaskInterface``,
reusing the ``sdpa`` mask).

Two more things for decoding (one query token per row) on CPU, both measured on SmolLM2-135M at batch 16 with a
128-slot static cache, where attention was ~14% of a decode step:

* the sampler passes ``rl_tpu_kv_len`` (cache slots written so far) through the model's keyword arguments, and only
  those slots are read: a static cache is allocated for the longest completion, and attending over its unwritten
  tail read 25% more keys and values on average;
* a float32 single-token query is computed as two batched matrix products over the grouped heads
  (``softmax(q k^T * scale + mask) v``, Vaswani et al. 2017), ~12% faster than ``scaled_dot_product_attention``'s
  flash kernel, whose blocking is made for many query tokens;
* where the sampler's CPU fast paths are on and rl-tpu's kernels are built (:mod:`rl_tpu.sampler.panel_kernel`),
  the same formula runs as one kernel per layer (``attention_kernel.cpp``: each key/value head's query heads
  together, keys and values read once) instead of 2 x (rows x key/value heads) small products: 2.0x faster over
  SmolLM2's 30 layers at 16 rows with the cache out of the processor's caches. The sampler asks for it with
  ``rl_tpu_attention_kernel=True`` in the model's keyword arguments (the lean decode, with ``kernel=True``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rl_tpu.patches.transformers_internals import attn_implementation, set_attn_implementation

ATTN_NAME = "rl_tpu_sdpa_gqa"


def sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Same contract as transformers' ``sdpa_attention_forward``.

    Args:
        query: ``(batch, heads, q_len, head_dim)``.
        key, value: ``(batch, kv_heads, kv_len, head_dim)``, ``heads`` a multiple of ``kv_heads``.
        attention_mask: boolean ``(batch, 1, q_len, kv_len)`` (True = attend) or ``None``.

    Returns:
        ``(attn_output (batch, q_len, heads, head_dim), None)``.
    """
    kv_len = kwargs.get("rl_tpu_kv_len")
    if kv_len is not None and kv_len < key.shape[2]:
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
        if attention_mask is not None:
            attention_mask = attention_mask[..., :kv_len]
    if query.shape[2] == 1 and query.device.type == "cpu" and query.dtype == torch.float32 and not dropout:
        kernel = bool(kwargs.get("rl_tpu_attention_kernel"))
        return decode_attention(query, key, value, attention_mask, scaling, kernel=kernel), None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    kernel: bool = False,
) -> torch.Tensor:
    """One query token: ``query (batch, heads, 1, dim)``, ``key``/``value`` ``(batch, kv_heads, kv_len, dim)``,
    ``mask`` boolean (True = attend) or additive, broadcastable to ``(batch, 1, 1, kv_len)``.
    Returns ``(batch, 1, heads, value_dim)``.

    ``kernel``: run rl-tpu's decode attention kernel (the caller checked it is built: ``panel_kernel.backend() ==
    "panel"``) where it applies: float32 CPU, head dim 64, 128 or 256 for keys and values alike, a mask shared by
    all heads; otherwise, and by default, the batched products."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    if kernel and _kernel_applies(query, key, value, mask):
        flat = None if mask is None else mask.expand(batch, 1, 1, key.shape[2])[:, 0, 0]  # (batch, kv_len) view
        out = torch.ops.rl_tpu_kernels.decode_attention(
            query.reshape(batch, heads, dim).contiguous(),
            key,
            value,
            flat,
            scaling if scaling is not None else dim**-0.5,
        )
        return out.view(batch, 1, heads, dim)
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # the query heads that share a key/value head
    scores = torch.matmul(q, key.transpose(-1, -2))  # (batch, kv_heads, group, kv_len)
    scores.mul_(scaling if scaling is not None else dim**-0.5)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    out = torch.matmul(scores.softmax(-1), value)  # (batch, kv_heads, group, value_dim)
    return out.reshape(batch, 1, heads, value.shape[-1])  # value heads may be narrower (DeepSeek's MLA)


def _kernel_applies(query, key, value, mask) -> bool:
    dim = query.shape[-1]
    return (
        query.dtype == key.dtype == value.dtype == torch.float32
        and query.device.type == "cpu"
        and dim in (64, 128, 256)
        and key.shape[-1] == value.shape[-1] == dim
        and key.shape[1] * key.shape[2] > 0
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and (
            mask is None
            or (mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1 and mask.dtype in (torch.bool, torch.float32))
        )
    )


AttentionInterface.register(ATTN_NAME, sdpa_gqa_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


_DISPATCH: dict[type, bool] = {}


def dispatches_through_interface(model: torch.nn.Module) -> bool:
    """Whether every attention module of ``model`` (class name ending in ``Attention``) picks its function from
    ``ALL_ATTENTION_FUNCTIONS`` in its ``forward`` (read from the source once per class); ``False`` when it has
    none or a source cannot be read."""
    import inspect

    classes = {type(m) for m in model.modules() if type(m).__name__.endswith("Attention")}
    for cls in classes:
        if cls not in _DISPATCH:
            try:
                _DISPATCH[cls] = "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
            except (OSError, TypeError):
                _DISPATCH[cls] = False
    return bool(classes) and all(_DISPATCH[c] for c in classes)


@contextmanager
def gqa_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block, run ``model``'s ``sdpa`` attention as :func:`sdpa_gqa_attention`; yields whether it did.

    Models on another attention implementation (eager, flash, ...) are left alone, and so are models whose
    attention modules do not look their function up in transformers' registry (Falcon compares the setting with
    ``"sdpa"`` by name and would take its eager branch). The previous setting is restored on exit, so a model
    shared with other code is only affected while the sampler runs.
    """
    config = model.config
    if attn_implementation(config) != "sdpa" or not dispatches_through_interface(model):
        yield False
        return
    set_attn_implementation(config, ATTN_NAME)
    try:
        yield True
    finally:
        set_attn_implementation(config, "sdpa")
