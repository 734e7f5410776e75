"""Response-only logits: the trainer's LM head runs only where a response token is predicted.

VeRL's losses and metrics read log-probs (and entropy) only at response positions (``response_mask``); computing
the ``(tokens, vocab)`` logits at every prompt position too, with their log-softmax and its backward, is most of
the LM head's cost on short-response RL batches. These functions find the positions (VeRL 0.9.1's no-padding layout)
and turn logits kept there, through Hugging Face's ``logits_to_keep``, into the jagged per-token outputs VeRL's engine
returns (``verl.utils.torch_functional.logprobs_from_logits`` / ``entropy_from_logits``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from verl.utils.torch_functional import logprobs_from_logits

from verl_backend.workers.shared_prefix import no_padding_layout


def first_response_logit_position(micro_batch: TensorDict) -> int | None:
    """First position (in the packed, right-padded micro batch) whose logits predict a response token.

    In VeRL 0.9.1's no-padding layout sequence ``i`` of ``input_ids`` is its ``p_i`` prompt tokens followed by its
    ``r_i`` response tokens, and ``prompts`` / ``responses`` hold them as jagged nested tensors. The log-prob of
    response token ``p_i`` comes from the logits at position ``p_i - 1``, so this returns ``min_i p_i - 1`` (>= 0).
    Returns ``None`` (use VeRL's own path) when the micro batch does not have that layout.
    """
    layout = no_padding_layout(micro_batch)
    if layout is None:
        return None
    return max(int(layout[0].min().item()) - 1, 0)


def response_logit_indices(micro_batch: TensorDict) -> torch.Tensor | None:
    """Positions in the packed (remove-padding) row whose logits predict a response token.

    In VeRL 0.9.1's no-padding layout the micro batch packs to one row of ``total_nnz`` tokens, sequence ``i`` at
    ``offsets[i]`` with ``p_i`` prompt then ``r_i`` response tokens. Its response tokens are predicted at
    ``offsets[i] + p_i - 1 ... offsets[i] + p_i + r_i - 2``. Returns those positions, ascending, as a ``(sum r_i,)``
    int64 tensor, or ``None`` when the micro batch has another layout (or a sequence without prompt tokens).
    """
    layout = no_padding_layout(micro_batch)
    if layout is None or bool((layout[0] < 1).any()):
        return None
    prompt_lens, response_lens, offsets = layout
    starts = offsets[:-1] + prompt_lens - 1  # (batch,) position predicting each sequence's first response token
    run_start = torch.cumsum(response_lens, 0) - response_lens  # (batch,) where each sequence's run begins
    within = torch.arange(int(response_lens.sum())) - torch.repeat_interleave(run_start, response_lens)
    return torch.repeat_interleave(starts, response_lens) + within


def packed_response_log_probs(
    logits: torch.Tensor,
    labels_rolled: torch.Tensor,
    temperature: torch.Tensor,
    keep: torch.Tensor,
    offsets: torch.Tensor,
    entropy: bool | str = False,
) -> dict[str, torch.Tensor]:
    """Per-token log-probs (and entropy) as VeRL's remove-padding path returns them, from logits kept at ``keep``.

    Args:
        logits: ``(1, K, vocab)`` float, the model's logits predicting the ``K`` response tokens, in the order of
            ``keep`` (from VeRL's packed row, or from a :func:`shared_prefix_inputs` row).
        labels_rolled: ``(total_nnz,)`` int64, the packed tokens shifted left by one (VeRL's
            ``input_ids_rmpad_rolled``): the label of position ``t`` is token ``t + 1``.
        temperature: ``(total_nnz,)`` float, the sampling temperature of each position's sequence
            (VeRL's ``temperature_rmpad``); logits are divided by it.
        keep: ``(K,)`` int64 positions (:func:`response_logit_indices`).
        offsets: ``(batch + 1,)`` int64 sequence offsets of the packed row (the nested ``input_ids``').
        entropy: also return the entropy of ``softmax(logits / temperature)``; ``"checkpointed"`` recomputes it in
            the backward pass (VeRL's ``entropy_checkpointing``).

    Returns:
        ``{"log_probs": ..., "entropy": ...}``, each ``(batch, j1)`` jagged nested float
        (``verl.utils.torch_functional.logprobs_from_logits`` / ``entropy_from_logits`` at the kept positions, 0
        elsewhere: VeRL's losses and metrics read only the response positions, ``response_mask``).
    """
    from torch.distributed.tensor import DTensor
    from verl.utils.torch_functional import entropy_from_logits

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logits = logits.squeeze(0)  # (K, vocab)
    temp = temperature[keep].clamp(min=1e-8).to(logits.dtype).unsqueeze(-1)  # (K, 1)
    if not bool((temp == 1).all()):
        logits = logits / temp
    total = labels_rolled.shape[0]

    def pack(per_kept: torch.Tensor) -> torch.Tensor:  # (K,) -> (batch, j1) nested, zeros off the kept positions
        full = per_kept.new_zeros(total).scatter(0, keep, per_kept)
        return torch.nested.nested_tensor_from_jagged(full, offsets)

    out = {"log_probs": pack(logprobs_from_logits(logits=logits, labels=labels_rolled[keep]))}
    if entropy == "checkpointed":
        out["entropy"] = pack(torch.utils.checkpoint.checkpoint(entropy_from_logits, logits, use_reentrant=False))
    elif entropy:
        out["entropy"] = pack(entropy_from_logits(logits))
    return out


def response_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, first: int, temperature: torch.Tensor, entropy: bool | str = False
) -> dict[str, torch.Tensor]:
    """Per-token log-probs (and entropy) as VeRL's engine returns them, from logits kept at positions ``first..``.

    Args:
        logits: ``(batch, seq_len - first, vocab)`` float, the model's logits at positions ``first..seq_len-1``
            of the right-padded micro batch (``seq_len`` = its longest sequence).
        input_ids: ``(batch, j1)`` int64 jagged nested tensor (VeRL's no-padding layout: prompt + response).
        first: position of the first kept logits (:func:`first_response_logit_position`).
        temperature: ``(batch,)`` sampling temperature per sequence; logits are divided by it (as VeRL does).
        entropy: also return the entropy of ``softmax(logits / temperature)``; ``"checkpointed"`` recomputes it in
            the backward pass (VeRL's ``entropy_checkpointing``).

    Returns:
        ``{"log_probs": ..., "entropy": ...}``, each ``(batch, j1)`` jagged nested float: at position ``t`` the
        log-prob of token ``t + 1`` (``verl.utils.torch_functional.logprobs_from_logits``) and the entropy
        (``verl.utils.torch_functional.entropy_from_logits``); 0 at the prompt positions before ``first``, which
        VeRL's losses and metrics mask out (``response_mask``).
    """
    from torch.distributed.tensor import DTensor
    from verl.utils.torch_functional import entropy_from_logits

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    batch, kept = logits.shape[0], logits.shape[1]
    seq_len = first + kept
    offsets = input_ids.offsets()
    ids = torch.nested.to_padded_tensor(input_ids, padding=0, output_size=(batch, seq_len + 1))
    labels = ids[:, first + 1 : first + 1 + kept]
    temperature = temperature.reshape(batch, 1, 1).clamp(min=1e-8).to(logits.dtype)
    if not bool((temperature == 1).all()):
        logits = logits / temperature
    valid = torch.arange(seq_len, device=logits.device).unsqueeze(0) < offsets.diff().to(logits.device).unsqueeze(1)

    def pack(per_position: torch.Tensor) -> torch.Tensor:  # (batch, kept) -> (batch, j1) nested, zeros before first
        full = torch.cat([per_position.new_zeros(batch, first), per_position], dim=1) if first else per_position
        return torch.nested.nested_tensor_from_jagged(full[valid], offsets)

    out = {"log_probs": pack(logprobs_from_logits(logits=logits, labels=labels))}
    if entropy == "checkpointed":
        out["entropy"] = pack(torch.utils.checkpoint.checkpoint(entropy_from_logits, logits, use_reentrant=False))
    elif entropy:
        out["entropy"] = pack(entropy_from_logits(logits))
    return out
