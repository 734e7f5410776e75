"""Next-token choice: temperature, top-k, top-p, and the log-prob of the chosen token.

Log-prob convention (documented because VeRL compares it with its own recomputation): the returned log-prob is
``log_softmax(logits / temperature)`` at the chosen token, over the *full* vocabulary, before top-k/top-p
truncation. That is the quantity VeRL's actor computes for old/ref log-probs (it divides logits by the rollout
temperature and takes a full-vocabulary log-softmax), so rollout and trainer log-probs agree up to numerics.
For greedy decoding (``temperature == 0``) the temperature is taken as 1.

Sampling uses the exponential-race form of the Gumbel-max trick: ``argmax(p_i / q_i)`` with ``q_i ~ Exp(1)``
draws index ``i`` with probability ``p_i / sum(p)`` (the same as ``torch.multinomial``, one pass, no sort).
"""

from __future__ import annotations

import torch

# Top-p without top-k first looks for the nucleus among this many most likely tokens (one partial sort) and
# falls back to a full sort only for rows whose nucleus is larger. Exact either way.
TOP_P_CANDIDATES = 1024


def choose_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    Args:
        logits: ``(batch, vocab)`` next-token logits, any float dtype (computed in float32).
        temperature: ``0`` for greedy, else the divisor of the logits.
        top_k: keep the ``top_k`` largest; ``-1``/``0`` keeps all.
        top_p: nucleus mass in ``(0, 1]``; ``1`` keeps all.
        generator: random generator on ``logits.device`` (``None``: torch's global one).

    Returns:
        ``(token_ids, logprobs)``: ``(batch,)`` int64 and ``(batch,)`` float32, the log-prob as in the module doc.
    """
    logits = logits.float()  # (batch, vocab)
    vocab = logits.shape[-1]
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # (batch, vocab)
        tokens = logp.argmax(dim=-1)  # (batch,)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    logp = torch.log_softmax(logits / temperature, dim=-1)  # (batch, vocab)
    use_k = 0 < top_k < vocab
    use_p = top_p < 1.0
    if not use_k and not use_p:
        tokens = _race(logp.exp(), generator)  # (batch,)
    else:
        cand_logp, cand_ids = _truncate(logp, top_k if use_k else 0, top_p if use_p else 1.0)  # (batch, k)
        tokens = cand_ids.gather(-1, _race(cand_logp.exp(), generator)[:, None]).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``(batch, k)`` non-negative weights -> ``(batch,)`` index drawn with probability proportional to weight."""
    q = torch.empty_like(weights).exponential_(generator=generator)  # (batch, k), Exp(1)
    return (weights / q).argmax(dim=-1)


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p on full-vocabulary log-probs.

    Returns ``(cand_logp, cand_ids)``, each ``(batch, k)`` sorted by decreasing probability, with ``-inf`` at the
    dropped candidates; ``cand_logp`` may be unnormalised (only ratios matter for the draw).
    """
    vocab = logp.shape[-1]
    if top_k > 0:
        cand_logp, cand_ids = logp.topk(top_k, dim=-1)  # (batch, k), sorted
        if top_p >= 1.0:
            return cand_logp, cand_ids
        probs = torch.softmax(cand_logp, dim=-1)  # renormalised over the top-k, as HF and vLLM do
    else:
        k = min(vocab, TOP_P_CANDIDATES)
        cand_logp, cand_ids = logp.topk(k, dim=-1)  # (batch, k), sorted
        probs = cand_logp.exp()  # full-vocabulary probabilities
        if k < vocab and bool((probs.sum(-1) < top_p).any()):
            cand_logp, cand_ids = logp.sort(dim=-1, descending=True)  # (batch, vocab): some nucleus is wider
            probs = cand_logp.exp()
    mass_before = probs.cumsum(dim=-1) - probs  # (batch, k), mass of the strictly more likely candidates
    drop = mass_before >= top_p  # the most likely token always stays (mass_before == 0 < top_p)
    return cand_logp.masked_fill(drop, float("-inf")), cand_ids
