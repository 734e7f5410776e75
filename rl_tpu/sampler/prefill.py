"""Packed prefill: a batch's distinct prompts prefilled unpadded as one sequence, their common prefix computed once.

Used by :class:`rl_tpu.sampler.engine.Sampler` on CPU where :mod:`rl_tpu.sampler.fastpaths` finds it exact (plain
causal attention through :func:`rl_tpu.sampler.attention.sdpa_gqa_attention`, which reads the packed mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, StaticCache


def _common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common start of ``a`` and ``b``, at most ``limit``."""
    n = min(limit, len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _pack_groups(rows: list[list[int]], uniq: list[int], max_tokens: int) -> list[tuple[list[int], int]]:
    """Cut the distinct prompts ``rows[j]`` (``j`` in ``uniq``, in order) into packed sequences of at most
    ``max_tokens`` tokens, greedily (a prompt longer than that gets a sequence alone).

    Returns:
        ``(members, prefix length)`` per packed sequence: the ``uniq`` rows it holds and the length of their shared
        prefix, kept shorter than the shortest member so that every prompt has a token of its own.
    """
    groups: list[tuple[list[int], int]] = []  # (members, prefix length)
    for j in uniq:
        if groups:
            members, plen = groups[-1]
            plen = min(_common_prefix_len(rows[members[0]], rows[j], plen), len(rows[j]) - 1)
            if plen + sum(len(rows[k]) - plen for k in members) + len(rows[j]) - plen <= max_tokens:
                groups[-1] = (members + [j], plen)
                continue
        groups.append(([j], len(rows[j]) - 1))
    return groups


def _prefill_group(
    model: torch.nn.Module,
    rows: list[list[int]],
    members: list[int],
    plen: int,
    offset: int,
    token_index: dict[int, list[int]],
    shapes_seen: set,
    dev: torch.device,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Prefill one packed sequence ``prefix + s_1 + ... + s_u`` of the prompts ``rows[k]``, ``k`` in ``members``.

    ``token_index[k]`` receives the places of prompt ``k``'s tokens (its prefix's, then its own) in the sequences
    concatenated, this one starting at ``offset``; ``shapes_seen`` receives ``(1, tokens, tokens)``.

    Returns:
        ``(logits, keys_values, tokens)``: ``(members, vocab)`` logits of each member's last prompt token; per layer
        the sequence's ``(keys, values)``, each ``(kv_heads, tokens, head_dim)`` in the model's dtype; the
        sequence's length in tokens.
    """
    tokens, pos, seg, ends = list(rows[members[0]][:plen]), list(range(plen)), [-1] * plen, []
    for m, k in enumerate(members):
        start = len(tokens)
        tokens += rows[k][plen:]
        pos += range(plen, len(rows[k]))
        seg += [m] * (len(rows[k]) - plen)
        ends.append(len(tokens) - 1)
        token_index[k] = [offset + i for i in (*range(plen), *range(start, len(tokens)))]
    seg_t = torch.tensor(seg, device=dev)
    n = len(tokens)
    causal = torch.ones((n, n), dtype=torch.bool, device=dev).tril()
    allowed = causal & ((seg_t[None, :] == -1) | (seg_t[None, :] == seg_t[:, None]))  # (query, key)
    shapes_seen.add((1, n, n))
    kv = DynamicCache()  # full layers: a sliding one keeps only its window of the packed sequence's keys
    out = model(
        input_ids=torch.tensor([tokens], device=dev),
        attention_mask=allowed[None, None],
        position_ids=torch.tensor([pos], device=dev),
        past_key_values=kv,
        use_cache=True,
        logits_to_keep=torch.tensor(ends, device=dev),
    )
    return out.logits[0], [(layer.keys[0], layer.values[0]) for layer in kv.layers], n  # (kv_heads, n, dim)


def _scatter_prompt_kv(
    cache: StaticCache,
    keys_values: list[list[tuple[torch.Tensor, torch.Tensor]]],
    token_index: dict[int, list[int]],
    rows: list[list[int]],
    src: list[int],
    prompt_len: int,
    dev: torch.device,
) -> None:
    """Write every row's prompt keys and values from the packed sequences into the batch's KV cache, in place.

    Row ``i``'s cache slot ``s`` receives the place ``token_index[src[i]][s - (prompt_len - len_i)]`` of the
    sequences concatenated (``keys_values``: packed sequence -> layer -> ``(keys, values)``, each
    ``(kv_heads, tokens, head_dim)``); its left-padding slots take its first token's (finite values, hidden by the
    attention mask). Each layer's cache ``(batch, kv_heads, cache_len, head_dim)`` is initialised if it is not yet,
    and its slots ``[0, prompt_len)`` are written.
    """
    index = torch.tensor(
        [
            [token_index[src[i]][max(0, s - (prompt_len - len(r)))] for s in range(prompt_len)]
            for i, r in enumerate(rows)
        ],
        device=dev,
    )  # (batch, prompt_len)
    for li, layer in enumerate(cache.layers):
        keys = torch.cat([kvs[li][0] for kvs in keys_values], dim=1)  # (kv_heads, all tokens, dim)
        values = torch.cat([kvs[li][1] for kvs in keys_values], dim=1)
        if not layer.is_initialized:
            layer.lazy_initialization(
                keys[None, :, :1].expand(len(rows), -1, -1, -1), values[None, :, :1].expand(len(rows), -1, -1, -1)
            )
        layer.keys[:, :, :prompt_len] = keys[:, index].transpose(0, 1)  # (batch, kv_heads, prompt_len, dim)
        layer.values[:, :, :prompt_len] = values[:, index].transpose(0, 1)
        layer.cumulative_length.fill_(prompt_len)
        if hasattr(layer, "cumulative_length_int"):  # a sliding layer's own count (transformers' static cache)
            layer.cumulative_length_int = prompt_len


def packed_prefill(
    model: torch.nn.Module,
    rows: list[list[int]],
    src: list[int],
    uniq: list[int],
    prompt_len: int,
    cache: StaticCache,
    *,
    max_tokens: int,
    shapes_seen: set | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Prefill the distinct prompts ``rows[j]`` for ``j`` in ``uniq`` unpadded and write the batch's ``cache``.

    The prompts (in groups of at most ``max_tokens`` tokens) become one sequence ``prefix + s_1 + ... + s_u``:
    ``prefix`` is their longest common prefix (kept shorter than the shortest prompt), ``s_j`` the rest of prompt
    ``j``. Position ids restart per prompt (``prefix`` at ``0..P-1``, ``s_j`` at ``P..``), and a boolean mask lets a
    token of ``s_j`` see ``prefix`` and the earlier tokens of ``s_j``, nothing else: each prompt's keys, values and
    last logits are those of a forward of that prompt alone (RoPE depends only on the position id). Row ``i``'s
    cache slots ``[prompt_len - len_i, prompt_len)`` then receive its prompt's keys and values (the left-padding
    slots get its first token's, hidden by the attention mask).

    Args:
        model: the sampler's model, its attention reading 4-D boolean masks.
        rows: the batch's prompts (left-padded to ``prompt_len`` in the cache).
        src: ``src[i]`` is the first row with row ``i``'s prompt; ``uniq`` the distinct ``src`` values.
        prompt_len: the batch's prompt bucket (cache slots the prompts fill).
        cache: the batch's static cache (full-attention layers, or sliding ones holding all its slots), written in
            place.
        max_tokens: most tokens in one packed sequence.
        shapes_seen: a set that receives each packed forward's ``(1, tokens, tokens)``.
        device: where the inputs go (``None``: the model's).

    Returns:
        ``(batch, vocab)`` logits of each row's last prompt token.
    """
    shapes_seen = shapes_seen if shapes_seen is not None else set()
    dev = next(model.parameters()).device if device is None else device
    last: dict[int, torch.Tensor] = {}  # uniq row -> (vocab,) logits
    token_index: dict[int, list[int]] = {}  # uniq row -> its prompt tokens' places in the concatenated sequences
    keys_values: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # group -> layer -> (keys, values)
    offset = 0  # start of the group's sequence once all groups' keys are concatenated
    for members, plen in _pack_groups(rows, uniq, max_tokens):
        logits, kvs, n = _prefill_group(model, rows, members, plen, offset, token_index, shapes_seen, dev)
        last.update(zip(members, logits))
        keys_values.append(kvs)
        offset += n
    _scatter_prompt_kv(cache, keys_values, token_index, rows, src, prompt_len, dev)
    return torch.stack([last[k] for k in src])  # (batch, vocab)
