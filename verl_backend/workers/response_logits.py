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


def logits_chunk_tokens(vocab: int, chunk_mib: int) -> int:
    """Tokens per chunk of the chunked LM head: the most whose fp32 logits, ``(tokens, vocab)``, fit in
    ``chunk_mib`` MiB (at least 1). ``chunk_mib`` is ``rl_tpu.logits_chunk_mib``; 0 means no chunking (returns 0)."""
    if chunk_mib <= 0:
        return 0
    return max(1, (chunk_mib << 20) // (4 * vocab))


class ChunkedHeadLogProbs(torch.autograd.Function):
    """Log-probs (and entropy) of ``labels`` under ``softmax(hidden @ weight.T / temperature)``, ``chunk`` tokens
    at a time, the logits never held for more than one chunk: the backward recomputes each chunk's logits.

    The math is VeRL 0.9.1's ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (torch backend): per
    chunk the logits upcast to fp32, the label's log-softmax, the entropy ``-sum(p * log p)``, and in the backward
    ``dlogits = g_lp * (onehot - p) - g_H * p * (log p + H)``. Two things differ, both for memory: VeRL's backward
    allocates a whole ``(vocab, hidden)`` weight gradient per chunk and adds it to another (measured: about three
    copies of Gemma 3's 671 MB embedding at once, ``benchmarks/bench_lm_head_chunks.py``); this one accumulates
    into one buffer in place (``addmm_``, fp32 for a bf16 weight). And the entropy is computed only when asked.

    Inputs: ``hidden`` ``(K, hidden)`` float, ``weight`` ``(vocab, hidden)`` of the same dtype, ``labels`` ``(K,)``
    int64, ``temperature`` > 0, ``chunk`` tokens, ``want_entropy``. Returns ``(log_probs (K,) fp32,
    entropy (K,) fp32 or (0,))``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, chunk: int, want_entropy: bool):
        k, acc = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        log_probs = torch.empty(k, dtype=acc, device=hidden.device)
        entropy = torch.empty(k if want_entropy else 0, dtype=acc, device=hidden.device)
        for lo in range(0, k, chunk):
            hi = min(lo + chunk, k)
            lsm = ((hidden[lo:hi] @ weight.t()) / temperature).to(acc).log_softmax(-1)
            log_probs[lo:hi] = lsm.gather(-1, labels[lo:hi].unsqueeze(-1)).squeeze(-1)
            if want_entropy:
                entropy[lo:hi] = -(lsm.exp() * lsm).sum(-1)
            del lsm
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(*(() if want_entropy else (entropy,)))
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_log_probs, g_entropy):
        hidden, weight, labels = ctx.saved_tensors
        temperature, chunk, k = ctx.temperature, ctx.chunk, hidden.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        d_hidden = torch.empty_like(hidden) if want_h else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        if g_entropy is not None and g_entropy.numel() == 0:
            g_entropy = None
        for lo in range(0, k, chunk):
            hi = min(lo + chunk, k)
            h = hidden[lo:hi]
            lsm = ((h @ weight.t()) / temperature).to(acc).log_softmax(-1)
            p = lsm.exp()
            d_logits = torch.zeros_like(p)
            if g_log_probs is not None:
                g = g_log_probs[lo:hi].to(acc).unsqueeze(-1)
                d_logits.sub_(p * g).scatter_add_(-1, labels[lo:hi].unsqueeze(-1), g)
            if g_entropy is not None:
                ent = -(p * lsm).sum(-1, keepdim=True)
                d_logits.sub_(p * (lsm + ent) * g_entropy[lo:hi].to(acc).unsqueeze(-1))
            del lsm, p
            d_logits.div_(temperature)
            if want_h:
                d_hidden[lo:hi] = (d_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                d_weight.addmm_(d_logits.t(), h.to(acc))
            del d_logits
        if want_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None


def chunked_response_log_probs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels_rolled: torch.Tensor,
    temperature: float,
    keep: torch.Tensor,
    offsets: torch.Tensor,
    chunk_tokens: int,
    entropy: bool = False,
) -> dict[str, torch.Tensor]:
    """:func:`packed_response_log_probs` without the ``(K, vocab)`` logits: the LM head, the log-softmax and the
    entropy run ``chunk_tokens`` tokens at a time (:class:`ChunkedHeadLogProbs`). The peak is one chunk's fp32
    logits (``chunk_tokens x vocab x 4`` bytes) times the few working copies of a softmax, plus the head's weight
    gradient, not the whole micro batch's logits.

    Args:
        hidden: ``(1, K, hidden)`` float, what the model's LM head received at the ``K`` kept positions (the model
            ran with its head passed through: :class:`HeadPassThrough`).
        head_weight: ``(vocab, hidden)`` float, the LM head's weight (the embedding's when tied).
        labels_rolled, keep, offsets: as :func:`packed_response_log_probs`.
        temperature: the one sampling temperature of every kept position (> 0).
        chunk_tokens: tokens a chunk (:func:`logits_chunk_tokens`, >= 1).
        entropy: also return the entropy (fp32).

    Returns:
        ``{"log_probs": ..., "entropy": ...}``, ``(batch, j1)`` jagged nested fp32, as
        :func:`packed_response_log_probs`.
    """
    log_probs, ent = ChunkedHeadLogProbs.apply(
        hidden.squeeze(0), head_weight, labels_rolled[keep], float(temperature), int(chunk_tokens), bool(entropy)
    )
    total = labels_rolled.shape[0]

    def pack(per_kept: torch.Tensor) -> torch.Tensor:  # (K,) -> (batch, j1) nested, zeros off the kept positions
        full = per_kept.new_zeros(total).scatter(0, keep, per_kept)
        return torch.nested.nested_tensor_from_jagged(full, offsets)

    out = {"log_probs": pack(log_probs)}
    if entropy:
        out["entropy"] = pack(ent)
    return out


class HeadPassThrough:
    """The LM head's ``forward`` replaced, for the model's next call only, by the identity: the model's output
    ``logits`` are then the ``(1, K, hidden)`` states its head would have received, which
    :func:`chunked_response_log_probs` turns into log-probs chunk by chunk.

    The replacement is an instance attribute (the module, its parameters and its state dict are untouched) that
    removes itself when called; :meth:`clear` removes one a failed forward left behind. Use only where
    :meth:`exact_for` has shown the model's logits are ``hidden @ head.weight.T`` of what the head receives.
    """

    def __init__(self, head: torch.nn.Module):
        self.head = head

    def arm(self) -> None:
        head = self.head

        def passthrough(h: torch.Tensor) -> torch.Tensor:
            head.__dict__.pop("forward", None)
            return h

        head.forward = passthrough

    def clear(self) -> None:
        self.head.__dict__.pop("forward", None)

    def exact_for(self, model: torch.nn.Module, vocab: int, atol: float = 1e-4) -> str | None:
        """Why the model's logits are not its head's plain linear map of what the head receives, or ``None``.

        Runs the model twice on 4 tokens (no grad, the same RNG seed for both so dropout agrees): once as it is,
        once with the head passed through, then compares the first run's logits with ``hidden @ weight.T``. A
        final-logit soft-cap (Gemma 2), a logit scale (Cohere, Granite), a head bias or an adapter on the head
        shows here, whatever the family.
        """
        weight = getattr(self.head, "weight", None)
        if not isinstance(self.head, torch.nn.Linear) or weight is None:
            return f"the LM head is a {type(self.head).__name__}, not a plain Linear"
        if self.head.bias is not None:
            return "the LM head has a bias"
        ids = torch.arange(4, device=weight.device).unsqueeze(0) % vocab
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            full = model(input_ids=ids, use_cache=False).logits.float()
            torch.manual_seed(0)
            self.arm()
            try:
                hidden = model(input_ids=ids, use_cache=False).logits
            finally:
                self.clear()
            mapped = (hidden @ weight.t()).float()
        if mapped.shape != full.shape:
            return f"the model's logits {tuple(full.shape)} are not its head's output {tuple(mapped.shape)}"
        gap = (mapped - full).abs().max().item()
        if not gap <= atol * max(1.0, full.abs().max().item()):
            return f"the model's logits differ from its head's output by {gap:.3g} (a soft-cap or logit scale)"
        return None
