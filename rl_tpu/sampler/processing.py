"""Next-token choice: repetition penalty and min tokens, then temperature, top-k, top-p, and the log-prob of the
chosen token.

Log-prob convention (documented because VeRL compares it with its own recomputation): the returned log-prob is
``log_softmax(logits / temperature)`` of the model's logits at the chosen token, over the *full* vocabulary, before
repetition penalty, min tokens and top-k/top-p. That is the quantity VeRL's actor computes for old/ref log-probs (it
divides logits by the rollout temperature and takes a full-vocabulary log-softmax), so rollout and trainer
log-probs agree up to numerics (what ``rollout_correction.bypass_mode`` relies on). vLLM's default
``logprobs_mode=processed_logprobs`` would instead report the penalised, truncated distribution. For greedy
decoding (``temperature == 0``) the temperature is taken as 1.

Order, as HF's ``generate`` and vLLM's sampler apply them: repetition penalty and min tokens on the raw logits
(:class:`LogitsProcessors`), then temperature, top-k, then top-p on the renormalised top-k distribution. Draws are
inverse-CDF (see :func:`_draw`): one uniform per row, which the caller may give (``uniforms``: each row's own stream,
:mod:`rl_tpu.sampler.seeds`, so a row's token does not depend on the other rows of its batch).
"""

from __future__ import annotations

import torch

from rl_tpu.sampler import panel_kernel

# Top-p without top-k looks for each row's nucleus among this many most likely tokens (partial sorts), widening
# step by step and sorting the whole vocabulary only for rows whose nucleus is wider still. Exact either way; a
# full sort of a 49k vocabulary costs ~20 ms per row on one CPU thread, a top-64 a fraction of that.
TOP_P_CANDIDATES = (64, 1024)


def choose_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    logprobs: bool = True,
    kernel: bool = False,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row.

    Args:
        logits: ``(batch, vocab)`` next-token logits, any float dtype (computed in float32).
        temperature: ``0`` for greedy, else the divisor of the logits.
        top_k: keep the ``top_k`` largest; ``-1``/``0`` keeps all.
        top_p: nucleus mass in ``(0, 1]``; ``1`` keeps all.
        generator: a CPU ``torch.Generator`` (``None``: torch's global CPU generator) the step's one uniform per
            row is drawn from when ``uniforms`` is not given; moved to ``logits.device``.
        logprobs: return the chosen tokens' log-probs; ``False`` returns ``None`` for them (greedy then needs no
            log-softmax).
        kernel: greedy rows of float32 CPU logits go through rl-tpu's token kernel (``token_kernel.cpp``: three
            reads of each row from cache and two numbers written, 0.34 ms for 16 rows of SmolLM2's vocabulary on one
            core, against 1.2 for ATen's log_softmax and argmax) where it is built (a CPU fast path: the sampler
            passes it with its packed weights). The same token (the first largest logit); its log-prob differs from
            ``log_softmax``'s by float32 rounding.
        uniforms: ``(batch,)`` uniforms in ``[0, 1)``, row ``i``'s draw for this step (float64 on CPU): the token
            is the first whose cumulative probability exceeds it. Not read when greedy.

    Returns:
        ``(token_ids, logprobs)``: ``(batch,)`` int64 and ``(batch,)`` float32 (or ``None``), the log-prob of
        ``logits`` as in the module doc.
    """
    logits = logits.float()  # (batch, vocab)
    vocab = logits.shape[-1]
    if (
        temperature == 0
        and kernel
        and logits.device.type == "cpu"
        and logits.dim() == 2
        and vocab > 0
        and logits.stride(-1) == 1
        and panel_kernel.ready()
    ):
        tokens, logp = torch.ops.rl_tpu_kernels.greedy_choice(logits)  # (batch,) int64, (batch,) float32
        return tokens, logp if logprobs else None
    if temperature == 0:
        if not logprobs:
            return logits.argmax(dim=-1), None
        tokens = logits.argmax(dim=-1)  # (batch,): of the logits, as HF's greedy search (log_softmax's float32
        # rounding can merge two near-tied logits, and its argmax then takes the first of them)
        logp = torch.log_softmax(logits, dim=-1)  # (batch, vocab)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    if uniforms is None:  # one per row, drawn before any partial draw below so each row keeps its own
        uniforms = torch.rand((logits.shape[0],), dtype=torch.float64, generator=generator)
    uniforms = uniforms.to(logits.device, torch.float64 if logits.device.type == "cpu" else torch.float32)
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (batch, vocab)
    if 0 < top_k < vocab:
        cand_logp, cand_ids = logp.topk(top_k, dim=-1)  # (batch, k), sorted
        if top_p < 1.0:
            cand_logp = _nucleus(torch.log_softmax(cand_logp, dim=-1), top_p)  # renormalised, as HF/vLLM do
        tokens = cand_ids.gather(-1, _draw(cand_logp.exp(), uniforms)[:, None]).squeeze(-1)
    elif top_p < 1.0:
        tokens = _draw_top_p(logp, top_p, uniforms)
    else:
        tokens = _draw(logp.exp(), uniforms)  # (batch,)
    return tokens, (logp.gather(-1, tokens[:, None]).squeeze(-1) if logprobs else None)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` (``temperature`` 0 taken as 1) at ``tokens``: ``(batch, vocab)`` logits,
    ``(batch,)`` int64 tokens -> ``(batch,)`` float32. The model's log-prob when processors changed the logits the
    token was chosen from (module doc)."""
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)  # (batch, vocab)
    return logp.gather(-1, tokens[:, None]).squeeze(-1)


class LogitsProcessors:
    """Repetition penalty and min tokens for one batch of rows, applied to raw logits before :func:`choose_tokens`.

    Formulas (float32):

    - repetition penalty ``p``: for every token already in the row (prompt or generated),
      ``logit * p`` if ``logit < 0`` else ``logit / p`` (HF ``RepetitionPenaltyLogitsProcessor``; vLLM's
      ``apply_penalties``, prompt included);
    - min tokens ``m``: while fewer than ``m`` tokens are generated, the stop/EOS tokens' logits are ``-inf``
      (HF ``MinNewTokensLengthLogitsProcessor``; vLLM's ``min_tokens``).

    Built only when one is requested (:meth:`build` returns ``None`` otherwise), so the default path pays nothing.
    Static shapes: the seen-token mask is ``(batch, vocab)`` bool, updated in place.
    """

    def __init__(self, penalty: float, min_tokens: int, stop_ids: torch.Tensor, seen: torch.Tensor | None) -> None:
        self.penalty = float(penalty)
        self.min_tokens = int(min_tokens)
        self.stop_ids = stop_ids  # (stops,) int64
        self.seen = seen  # (batch, vocab) bool: token in the row so far; None without a repetition penalty

    @classmethod
    def build(
        cls,
        repetition_penalty: float,
        min_tokens: int,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        stop_ids: torch.Tensor,
        vocab: int,
    ) -> LogitsProcessors | None:
        """``prompt_ids``/``prompt_mask`` ``(batch, prompt)`` (left-padded ids, 1 = real token); ``stop_ids``
        ``(stops,)`` the EOS and stop tokens; ``vocab`` the logits' width. ``None`` when neither is requested."""
        if repetition_penalty == 1.0 and min_tokens <= 0:
            return None
        seen = None
        if repetition_penalty != 1.0:
            batch = prompt_ids.shape[0]
            ids = prompt_ids.masked_fill(prompt_mask == 0, vocab)  # padding -> a spare column, dropped below
            seen = torch.zeros((batch, vocab + 1), dtype=torch.bool, device=prompt_ids.device)
            seen = seen.scatter_(1, ids, True)[:, :vocab].contiguous()  # (batch, vocab)
        return cls(repetition_penalty, min_tokens, stop_ids, seen)

    def __call__(self, logits: torch.Tensor, generated: int) -> torch.Tensor:
        """``(batch, vocab)`` logits of the step that chooses token number ``generated`` (0-based) ->
        processed float32 logits (a new tensor)."""
        logits = logits.float()
        if self.seen is not None:
            penalised = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = torch.where(self.seen, penalised, logits)
        if generated < self.min_tokens:
            logits = logits.index_fill(-1, self.stop_ids, float("-inf"))
        return logits

    def chose(self, tokens: torch.Tensor) -> None:
        """Record the ``(batch,)`` tokens just chosen (they count for the repetition penalty from now on)."""
        if self.seen is not None:
            self.seen[torch.arange(tokens.shape[0], device=tokens.device), tokens] = True

    def keep(self, rows: torch.Tensor) -> None:
        """The batch shrank to ``rows`` (``(new_batch,)`` indices of the old rows)."""
        if self.seen is not None:
            self.seen = self.seen[rows]


#: :func:`_draw` over more weights than this goes through blocks of this many (two-level inverse CDF).
DRAW_BLOCK = 1024


def _draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``(batch, k)`` non-negative weights and ``(batch,)`` uniforms in ``[0, 1)`` -> ``(batch,)`` index drawn with
    probability proportional to weight: the first whose running sum exceeds ``uniform * total``.

    Inverse-CDF sampling: one uniform per row against the running sum, accumulated in float64 on CPU so rounding
    over a 50k-token vocabulary stays far below any token's probability; several times cheaper on CPU than
    ``torch.multinomial`` or a Gumbel draw, which need one random number per token. Above ``2 * DRAW_BLOCK``
    weights it is two-level: a block is chosen from the blocks' float64 sums, then a token inside it from that
    block's float64 running sum, so only ``DRAW_BLOCK`` weights per row are converted and summed in float64 (a
    50k vocabulary at batch 16: ~1 ms instead of ~2-6 ms for the full float64 running sum). Zero weights are
    never drawn.
    """
    acc = torch.float64 if weights.device.type == "cpu" else torch.float32  # TPUs have no fast float64
    batch, k = weights.shape
    u = uniforms.to(weights.device, acc)[:, None]  # (batch, 1)
    if k <= 2 * DRAW_BLOCK:
        cdf = weights.to(acc).cumsum(dim=-1)  # (batch, k)
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # first cdf > u: zero weights skipped
        return idx.clamp_(max=k - 1)
    n_blocks = -(-k // DRAW_BLOCK)
    if n_blocks * DRAW_BLOCK != k:
        weights = torch.nn.functional.pad(weights, (0, n_blocks * DRAW_BLOCK - k))  # zero weights: never drawn
    blocks = weights.reshape(batch, n_blocks, DRAW_BLOCK)
    block_mass = blocks.sum(dim=-1, dtype=acc)  # (batch, blocks)
    block_cdf = block_mass.cumsum(dim=-1)
    target = u * block_cdf[:, -1:]  # (batch, 1)
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=n_blocks - 1)  # a block with mass > 0
    rest = target - (block_cdf.gather(-1, b) - block_mass.gather(-1, b))  # mass to go inside block b
    inner = blocks.gather(1, b[:, :, None].expand(batch, 1, DRAW_BLOCK)).squeeze(1).to(acc)  # (batch, block)
    inner_cdf = inner.cumsum(dim=-1)
    # rounding between the two sums must not step past the block's last positive weight, nor below its first
    rest = torch.minimum(rest.clamp_(min=0), inner_cdf[:, -1:] * (1 - 1e-12))
    j = torch.searchsorted(inner_cdf, rest, right=True)  # (batch, 1)
    return (b * DRAW_BLOCK + j).squeeze(-1)


def _nucleus(sorted_logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p on ``(batch, k)`` normalised log-probs sorted in decreasing order: ``-inf`` outside the nucleus.

    Keeps a token when the mass of the strictly more likely tokens is below ``top_p``: the smallest prefix whose
    mass reaches ``top_p`` (the most likely token always stays).
    """
    probs = sorted_logp.exp()
    mass_before = probs.cumsum(dim=-1) - probs  # (batch, k)
    return sorted_logp.masked_fill(mass_before >= top_p, float("-inf"))


def _draw_top_p(logp: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    """Top-p draw from full-vocabulary log-probs ``(batch, vocab)`` with each row's uniform ``(batch,)``, without
    sorting the whole vocabulary.

    Looks for each row's nucleus among its ``TOP_P_CANDIDATES[0]`` most likely tokens, widening to the next
    count (finally a full sort) only for rows whose nucleus is wider. Exact: a row is settled once its candidates
    hold at least ``top_p`` of the mass.
    """
    batch, vocab = logp.shape
    tokens = torch.empty(batch, dtype=torch.long, device=logp.device)
    rows = torch.arange(batch, device=logp.device)
    for k in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        sub = logp[rows]  # (rows, vocab)
        cand_logp, cand_ids = sub.topk(k, dim=-1) if k < vocab else sub.sort(dim=-1, descending=True)
        settled = cand_logp.exp().sum(-1) >= top_p if k < vocab else torch.ones_like(rows, dtype=torch.bool)
        if bool(settled.any()):
            s_logp = _nucleus(cand_logp[settled], top_p)  # (settled, k)
            pick = _draw(s_logp.exp(), uniforms[rows[settled]])
            tokens[rows[settled]] = cand_ids[settled].gather(-1, pick[:, None]).squeeze(-1)
        rows = rows[~settled]
        if rows.numel() == 0:
            break
    return tokens
