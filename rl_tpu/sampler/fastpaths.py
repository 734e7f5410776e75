"""Which of the sampler's fast paths compute the model's own numbers, decided from what the model does.

The sampler has two paths that replace part of the model's own forward on CPU:

* **packed prefill** (:meth:`rl_tpu.sampler.engine.Sampler._packed_prefill`): a batch's distinct prompts in one
  unpadded sequence with a block-diagonal causal mask. Exact when every layer's attention is plain causal attention
  that reads that mask (:func:`rl_tpu.sampler.attention.sdpa_gqa_attention`), and every other part of a layer acts
  on each token alone (norms, MLPs, and the expert routing of transformers' mixtures of experts, which picks experts
  per token with no capacity limit shared across tokens). Sliding-window layers only while the batch's KV cache fits
  the window (past it their mask and rolling static cache are not the packed sequence's); not chunked layers,
  bidirectional attention, or another attention function.
* **lean decode** (:class:`rl_tpu.sampler.lean.LeanDecoder`): the decode step without transformers' module stack.
  Exact when :func:`rl_tpu.sampler.lean.lean_blocker` finds the model's structure is the one it computes (pre-norm
  RoPE attention with optional query/key norms, Gemma's norms around attention and MLP, any per-token MLP or expert
  block, no soft-capping), one probe step matches the model's own forward (:func:`rl_tpu.sampler.lean.probe_error`),
  and, for sliding-window layers, the batch's KV cache fits the window (:meth:`FastPaths.lean_for`).

When a path cannot compute the same numbers the sampler takes the model's own forward instead, and says so once per
process and reason, in one line (``[rl-tpu] sampler: <path> off for <model> (<reason>): ...``).
"""

from __future__ import annotations

import sys

import torch

from rl_tpu.patches.transformers_internals import attn_implementation
from rl_tpu.sampler.attention import ATTN_NAME
from rl_tpu.sampler.lean import LeanDecoder, lean_blocker, probe_error

#: largest log-prob difference (over the whole vocabulary) the lean step's probe may show against the model's full
#: forward: the project's float32 parity bound. Rounding alone reaches a few 1e-5 on a real model: on SmolLM2-135M the
#: model's own KV-cached decode step differs from its full forward by 3.8e-5 (the lean step by 3.6e-5), at tokens of
#: log-prob near -30; at 1e-5 the default model lost its lean decode to rounding.
LEAN_PROBE_TOLERANCE = 1e-4

_SAID: set[str] = set()


def say_once(message: str) -> None:
    """Print ``[rl-tpu] sampler: <message>`` once per process."""
    if message not in _SAID:
        _SAID.add(message)
        print(f"[rl-tpu] sampler: {message}", file=sys.stderr, flush=True)


def packed_prefill_blocker(config, cache, cache_len: int) -> str | None:
    """Why a packed prefill would compute other numbers than the model's forward for ``config``'s model and the
    batch's static ``cache`` of ``cache_len`` slots, in one line, or ``None``. Call while the sampler's attention is
    in place (the implementation must be :data:`~rl_tpu.sampler.attention.ATTN_NAME`, whose function reads the mask).

    Sliding-window layers pass while the cache fits their window: every prompt token then sees its whole prompt in
    the model's forward too, and their static cache layers hold all ``cache_len`` slots (transformers' sliding layer
    keeps ``min(window, cache_len)``), so the prompt's keys go where the full layers' go."""
    impl = attn_implementation(config)
    if impl != ATTN_NAME:
        return f"attention implementation {impl!r} (only the sampler's sdpa attention reads the packed mask)"
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        return "bidirectional attention"
    if getattr(config, "attention_chunk_size", None):
        return f"chunked attention (attention_chunk_size={config.attention_chunk_size})"
    other = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if other:
        return f"layer types {', '.join(sorted(other))} (the packed mask is one causal mask)"
    short = [layer.max_cache_len for layer in cache.layers if getattr(layer, "is_sliding", False)]
    if short and min(short) < cache_len:  # the layer's static cache holds the window only, and rolls
        return f"a KV cache of {cache_len} slots past the sliding window of {min(short)}"
    return None


class FastPaths:
    """The sampler's per-model verdicts on its fast paths, each decided once (per dtype) and said once.

    Args:
        model: the sampler's Hugging Face causal LM.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._lean: dict[tuple, str | None] = {}  # (dtype, device) -> reason the lean step is off, or None

    def _name(self) -> str:
        return type(self.model).__name__

    def lean(self) -> LeanDecoder | None:
        """A :class:`~rl_tpu.sampler.lean.LeanDecoder` for the model, or ``None`` (said once) when it would compute
        other numbers than the model's forward. Built per call (the model may be cast or resized in between); the
        probe runs once per dtype and device."""
        param = next(self.model.parameters())
        key = (param.dtype, param.device)
        if key not in self._lean:
            reason = lean_blocker(self.model)
            if reason is None:
                err = probe_error(self.model, LeanDecoder(self.model))
                if not err <= LEAN_PROBE_TOLERANCE:
                    reason = f"its step differs from the model's forward by {err:.2g} in log-prob on a probe"
            self._lean[key] = reason
        reason = self._lean[key]
        if reason is not None:
            say_once(f"lean decode off for {self._name()} ({reason}): decode steps run through the model's forward")
            return None
        return LeanDecoder(self.model)

    def packed_prefill(self, cache, cache_len: int) -> bool:
        """Whether the packed prefill computes the model's numbers for this batch's ``cache`` of ``cache_len`` slots
        (said once if not)."""
        reason = packed_prefill_blocker(self.model.config, cache, cache_len)
        if reason is not None:
            say_once(f"packed prefill off for {self._name()} ({reason}): prompts are prefilled padded")
        return reason is None

    def lean_for(self, decoder: LeanDecoder | None, cache_len: int) -> LeanDecoder | None:
        """``decoder`` where it computes the model's step over a KV cache of ``cache_len`` slots (sliding windows:
        :meth:`~rl_tpu.sampler.lean.LeanDecoder.window_blocker`), else ``None``, said once."""
        reason = decoder.window_blocker(cache_len) if decoder is not None else None
        if reason is not None:
            say_once(f"lean decode off for {self._name()} ({reason}): decode steps run through the model's forward")
            return None
        return decoder
