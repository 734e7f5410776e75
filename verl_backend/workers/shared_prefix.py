"""The shared-prefix forward: GRPO's ``n`` samples of a prompt hold one copy of it in the trainer's packed row.

This is the shared-prefix forward of Prefix Grouper (Liu et al. 2025, "Prefix Grouper: Efficient GRPO Training
through Shared-Prefix Forward", arXiv:2506.05433), which VeRL 0.9.1 names (``actor.use_prefix_grouper``) but wires
only into its legacy actor; here through transformers' 4-D attention masks, no extra package.

The row is exact only if its mask says everything the model's own masks say. :func:`attention_kinds` reads that
from the model (causal or not, sliding windows per layer type, chunked attention, the attention implementation), and
:func:`shared_prefix_inputs` builds one mask per kind of layer; a model whose attention it cannot express gets the
reason back instead, and the engine keeps VeRL's row with a copy of the prompt per sequence (said in one line).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rl_tpu.patches.transformers_internals import attn_implementation

# The layer types transformers (5.x) names in ``config.layer_types`` that a windowed causal mask expresses
_FULL, _SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class AttentionKinds:
    """What the model's attention masks compute, per layer type.

    Attributes:
        windows: layer type -> sliding window in tokens (``None``: full causal attention). One entry when every
            layer masks alike (the mask is passed as one tensor), several when layer types differ (the mask is
            passed as transformers' per-layer-type dict, which those models' forward accepts).
        additive: the attention implementation adds the mask to the scores (``eager``): a float mask of 0 and the
            dtype's lowest value instead of a boolean one.
    """

    windows: dict[str, int | None]
    additive: bool = False


def attention_kinds(model: torch.nn.Module) -> AttentionKinds | str:
    """How the shared-prefix row must mask attention for ``model`` to compute its own numbers, or why it cannot.

    Reads the model's (text) config, not its class name: ``is_causal`` / ``use_bidirectional_attention``,
    ``layer_types`` (``full_attention``, ``sliding_attention``; anything else, e.g. ``chunked_attention``, is
    refused), ``sliding_window`` with ``use_sliding_window`` (Mistral and Qwen2 style), ``attention_chunk_size``,
    and the attention implementation (``sdpa`` and ``eager`` take a 4-D mask; flash attention does not). A model
    whose layer types differ must accept transformers' per-layer-type mask dict in its forward.

    Sliding windows follow transformers' ``masking_utils.sliding_window_overlay``: a query at position ``q``
    attends to a key at ``k`` when ``q - window < k <= q``.

    Returns:
        :class:`AttentionKinds`, or a one-line reason (``str``) why the shared-prefix row would compute other numbers.
    """
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no Hugging Face config to read its attention from"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = attn_implementation(text) or attn_implementation(config) or "eager"
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no 4-D mask"
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        return "bidirectional attention"
    if getattr(text, "attention_chunk_size", None):
        return f"chunked attention (attention_chunk_size={text.attention_chunk_size})"
    window = getattr(text, "sliding_window", None)
    if window is not None and not getattr(text, "use_sliding_window", True):
        window = None  # Qwen2 / Qwen3 keep a sliding_window value they do not use
    types = list(getattr(text, "layer_types", None) or [])
    if types:
        unknown = sorted(set(types) - {_FULL, _SLIDING})
        if unknown:
            return f"layer type(s) {', '.join(unknown)}"
        if _SLIDING in types and not window:
            return "sliding_attention layers without a sliding_window"
        windows = {t: (int(window) if t == _SLIDING else None) for t in dict.fromkeys(types)}
        if len(windows) > 1 and not _accepts_mask_dict(model):
            return f"layer types {', '.join(windows)} need one mask each, and {type(model).__name__} takes one mask"
    else:
        windows = {_FULL: int(window) if window else None}
    return AttentionKinds(windows=windows, additive=impl == "eager")


def _accepts_mask_dict(model: torch.nn.Module) -> bool:
    """Whether the decoder's forward takes ``attention_mask`` as a ``{layer type: mask}`` dict (transformers 5.x
    writes ``if not isinstance(causal_mask_mapping := attention_mask, dict)`` in the models that do)."""
    base = getattr(model, "base_model", model)
    for m in (getattr(base, "language_model", None), base):
        if m is None:
            continue
        try:
            if "causal_mask_mapping := attention_mask, dict" in inspect.getsource(type(m).forward):
                return True
        except (OSError, TypeError):
            continue
    return False


def no_padding_layout(micro_batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(prompt_lens, response_lens, offsets)`` of VeRL 0.9.1's no-padding layout (``(batch,)``, ``(batch,)``,
    ``(batch + 1,)`` int64): jagged ``prompts``/``responses`` whose lengths add up to ``input_ids``'; else ``None``."""
    if not {"prompts", "responses", "input_ids"} <= set(micro_batch.keys()):
        return None
    prompts, responses, input_ids = micro_batch["prompts"], micro_batch["responses"], micro_batch["input_ids"]
    if not (prompts.is_nested and responses.is_nested and input_ids.is_nested):
        return None
    prompt_lens, response_lens, offsets = prompts.offsets().diff(), responses.offsets().diff(), input_ids.offsets()
    if not torch.equal(prompt_lens + response_lens, offsets.diff()):
        return None
    return prompt_lens, response_lens, offsets


def shared_prefix_inputs(
    micro_batch: TensorDict, kinds: AttentionKinds, dtype: torch.dtype = torch.float32
) -> tuple[dict, torch.Tensor] | None:
    """Model inputs for a packed row that holds each distinct prompt once (GRPO's ``n`` samples share it).

    Sequences of the micro batch with the same prompt tokens become one segment: the prompt, then each of their
    responses. A 4-D attention mask lets a prompt token attend causally within its prompt, and a response token
    attend to its whole prompt and causally to its own response, never to a sibling response; positions restart at
    ``p`` for every response (RoPE sees what it sees with the prompt repeated), and sliding windows are measured in
    those positions. So every response token's logits, log-prob and gradient are the ones it has with its own copy
    of the prompt (up to float rounding: the shared prompt activations receive the sum of the siblings' gradients,
    which is what the copies' gradients add up to), while the prompt's forward and backward run once instead of
    ``n`` times.

    Args:
        micro_batch: VeRL 0.9.1's no-padding micro batch (jagged ``prompts``, ``responses``, ``input_ids``, and
            optionally ``position_ids``).
        kinds: the model's masking (:func:`attention_kinds`; ``AttentionKinds({"full_attention": None})`` for
            plain causal attention with a boolean mask).
        dtype: the float dtype of an additive mask (``kinds.additive``), the model's compute dtype.

    Returns:
        ``(inputs, keep)``: ``inputs`` = ``input_ids`` ``(1, T)`` int64, ``position_ids`` ``(1, T)`` int64,
        ``attention_mask`` ``(1, 1, T, T)`` (bool, True = attend; or ``dtype`` 0 / lowest when additive), or a dict
        of such masks by layer type; ``keep`` ``(sum r_i,)`` int64, the row positions whose logits predict the
        response tokens, in the order of VeRL's packed layout (sequence, then token). ``None`` when no two
        sequences share a prompt, the layout is not VeRL's no-padding one, or its position ids are not
        ``0..len-1`` per sequence (e.g. multimodal rope).
    """
    layout = no_padding_layout(micro_batch)
    if layout is None or bool((layout[0] < 1).any()):
        return None
    if not _plain_positions(micro_batch, layout[2]):
        return None
    prompts = [t.cpu() for t in micro_batch["prompts"].unbind()]
    responses = [t.cpu() for t in micro_batch["responses"].unbind()]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt.tolist()), []).append(i)
    if len(groups) == len(prompts):
        return None
    ids, pos_t, group_t, member_t, keep_of = _pack_segments(prompts, responses, groups)
    masks = _segment_masks(group_t, member_t, pos_t, kinds, dtype)
    keep = torch.cat([keep_of[i] for i in range(len(prompts))])
    inputs = {
        "input_ids": ids.unsqueeze(0),
        "position_ids": pos_t.unsqueeze(0),
        "attention_mask": next(iter(masks.values())) if len(masks) == 1 else masks,
    }
    return inputs, keep


def _plain_positions(micro_batch: TensorDict, offsets: torch.Tensor) -> bool:
    """Whether the micro batch's ``position_ids`` (if any) are ``0..len-1`` per sequence, the only ones the shared
    row reproduces (not e.g. multimodal rope's ``(3, T)``); ``offsets``: ``(batch + 1,)`` int64 of ``input_ids``."""
    position_ids = micro_batch.get("position_ids", None)
    if position_ids is not None:
        if position_ids.dim() != 2 or not position_ids.is_nested:
            return False
        expected = torch.cat([torch.arange(int(n)) for n in offsets.diff()]).to(position_ids.device)
        if not torch.equal(position_ids.values(), expected):
            return False
    return True


def _pack_segments(
    prompts: list[torch.Tensor], responses: list[torch.Tensor], groups: dict[tuple[int, ...], list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Lay out the packed row: per group of sequences with one prompt, the prompt once, then each response.

    Args:
        prompts, responses: per sequence, ``(p_i,)`` and ``(r_i,)`` int64 token ids on the CPU.
        groups: prompt tokens -> the sequences with that prompt, in order.

    Returns:
        ``(ids, pos, group, member, keep_of)`` over the row's ``T`` positions: ``ids`` ``(T,)`` int64 tokens;
        ``pos`` ``(T,)`` int64 position ids (restarting at ``p`` for every response); ``group`` ``(T,)`` int64
        segment index; ``member`` ``(T,)`` float32, 0 for a prompt token, ``j + 1`` for the group's ``j``-th
        response; ``keep_of`` sequence -> ``(r_i,)`` int64 row positions whose logits predict its response tokens.
    """
    ids, pos, group, member = [], [], [], []  # per row position: token, position id, segment, 0 = prompt / j+1
    keep_of: dict[int, torch.Tensor] = {}
    cursor = 0
    for g, seqs in enumerate(groups.values()):
        prompt = prompts[seqs[0]]
        p = prompt.numel()
        (
            ids.append(prompt),
            pos.append(torch.arange(p)),
            group.append(torch.full((p,), g)),
            member.append(torch.zeros(p)),
        )
        start = cursor + p
        for j, i in enumerate(seqs):
            r = responses[i].numel()
            ids.append(responses[i]), pos.append(torch.arange(p, p + r))
            group.append(torch.full((r,), g)), member.append(torch.full((r,), j + 1))
            # token 0 is predicted at the prompt's last position, token t > 0 at response token t - 1
            keep_of[i] = torch.cat([torch.tensor([cursor + p - 1]), torch.arange(start, start + r - 1)])[:r]
            start += r
        cursor = start
    return torch.cat(ids).to(torch.long), torch.cat(pos), torch.cat(group), torch.cat(member), keep_of


def _segment_masks(
    group_t: torch.Tensor, member_t: torch.Tensor, pos_t: torch.Tensor, kinds: AttentionKinds, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The packed row's attention mask per kind of layer (:func:`_pack_segments`' ``(T,)`` ``group``, ``member`` and
    ``pos``): a token attends causally within its segment, to the prompt and its own response only, and within the
    layer kind's sliding window (measured in position ids).

    Returns:
        layer type -> ``(1, 1, T, T)`` mask: bool (True = attend), or ``dtype`` 0 / lowest when ``kinds.additive``.
    """
    idx = torch.arange(group_t.numel())
    mask = (
        (idx[:, None] >= idx[None, :])
        & (group_t[:, None] == group_t[None, :])
        & ((member_t[None, :] == 0) | (member_t[:, None] == member_t[None, :]))
    )  # (T, T) True = attend

    def finish(m: torch.Tensor) -> torch.Tensor:  # (T, T) bool -> (1, 1, T, T) as the implementation takes it
        if kinds.additive:
            m = torch.zeros(m.shape, dtype=dtype).masked_fill_(~m, torch.finfo(dtype).min)
        return m[None, None]

    masks = {}
    for kind, window in kinds.windows.items():
        windowed = mask if window is None else mask & (pos_t[:, None] - pos_t[None, :] < window)
        masks[kind] = finish(windowed)
    return masks
