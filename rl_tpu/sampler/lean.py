"""A decode step for pre-norm RoPE decoder models (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Gemma 3, ...) without
the Hugging Face module stack.

The sampler's decode step is one new token per row. For SmolLM2-135M at batch 16 on one CPU core the linear
layers take ~70% of a step through ``transformers``' forward and the rest is attention plus per-call overhead:
mask construction every call, the cache's ``update``, output capture, keyword plumbing through 30 layers, and a
norm written as six tensor operations. :class:`LeanDecoder` runs the same computation on the same modules and
weights (its linear layers are the model's own ``nn.Linear`` modules, so the sampler's oneDNN-packed forward
applies) with:

* one boolean mask per step instead of one per layer, sliced to the cache slots written so far;
* ``torch.nn.functional.rms_norm`` for each RMSNorm that computes ``x * rsqrt(mean(x^2) + eps) * weight`` (Zhang &
  Sennrich 2019; checked on a probe input per norm class), the module itself for any other norm;
* the query/key norms of Qwen3-style attention (per head, before RoPE) when the attention has them;
* the model's own ``apply_rotary_pos_emb`` and rotary embedding module, so any RoPE scaling the config names
  is the model's;
* a SiLU-gated MLP written out, any other MLP (a mixture-of-experts block: routing and experts) run as its module;
* keys and values written straight into the static cache's tensors, and single-token attention from
  :func:`rl_tpu.sampler.attention.decode_attention`;
* Gemma's block where the layer has it: norms after the attention and around the MLP (``h + norm(attn(norm(h)))``,
  ``h + norm(mlp(norm(h)))``), and RoPE per layer type (Gemma 3's local and global bases);
* sliding-window layers while the batch's KV cache holds no more slots than the window: every slot is then inside
  it, so the window's attention is the full one (:meth:`LeanDecoder.window_blocker`; a longer cache keeps the
  model's forward).

Whether a model's decode step is this computation is decided from the model, not its class name:
:func:`lean_blocker` reads its structure (a one-line reason when it is not: chunked attention, soft-capping, a
residual layout of its own, a dtype other than float32, ...), and :func:`probe_error` runs one step against the
model's own forward on a probe input (:mod:`rl_tpu.sampler.fastpaths` refuses the step past ``1e-5`` in log-prob).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import StaticCache

from rl_tpu.patches.record import UnsupportedVersionError
from rl_tpu.patches.transformers_internals import rotary_function
from rl_tpu.sampler.attention import decode_attention

_NORM_IS_RMS: dict[type, bool] = {}  # norm class -> whether F.rms_norm(x, weight, eps) computes its forward


def _eps(norm: torch.nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _computes_rms_norm(norm: torch.nn.Module) -> bool:
    """Whether ``norm(x)`` equals ``F.rms_norm(x, (dim,), norm.weight, eps)`` on a probe input (once per class)."""
    cls = type(norm)
    if cls not in _NORM_IS_RMS:
        w, eps = getattr(norm, "weight", None), _eps(norm)
        ok = isinstance(w, torch.Tensor) and w.dim() == 1 and eps is not None and w.dtype == torch.float32
        if ok:
            x = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device)
            with torch.no_grad():
                ok = torch.allclose(norm(x), F.rms_norm(x, (w.shape[0],), w, eps), rtol=1e-5, atol=1e-6)
        _NORM_IS_RMS[cls] = bool(ok)
    return _NORM_IS_RMS[cls]


def _norm_fn(norm: torch.nn.Module):
    """``x (..., dim) -> (..., dim)``: ``F.rms_norm`` when it is what ``norm`` computes, else the module."""
    if _computes_rms_norm(norm):
        dim, eps = (norm.weight.shape[0],), _eps(norm)
        return lambda x: F.rms_norm(x, dim, norm.weight, eps)
    return norm


def cache_windows(config) -> list[int | None]:
    """Per layer, the sliding window (tokens) of the static KV cache transformers builds for ``config``, or ``None``
    for a full layer: read from such a cache (its layers allocate nothing until written), so it agrees with the
    sampler's caches whatever the family calls its window (``layer_types``, a model-wide ``sliding_window``)."""
    probe = StaticCache(config=config, max_cache_len=1 << 30)
    return [layer.max_cache_len if getattr(layer, "is_sliding", False) else None for layer in probe.layers]


#: the two norms Gemma 2/3 add around the MLP; with them ``post_attention_layernorm`` normalises the attention's
#: output before the residual add (Gemma's "sandwich" block), not the MLP's input
SANDWICH_NORMS = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


def lean_blocker(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanDecoder` would not compute ``model``'s decode step, in one line, or ``None`` when it would
    (up to :func:`probe_error`). Read from the model's modules and config, not its class name."""
    cfg = model.config
    inner = getattr(model, "model", None)
    if inner is None or getattr(model, "lm_head", None) is None:
        return "no .model decoder with an .lm_head"
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, a)]
    if missing:
        return f"its decoder has no {', '.join(missing)}"
    if next(model.parameters()).dtype != torch.float32:
        return f"{next(model.parameters()).dtype} weights (the lean step is float32)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            return f"soft-capping ({key}={getattr(cfg, key)})"
    if getattr(cfg, "attention_chunk_size", None):
        return "chunked attention"
    other = set(getattr(cfg, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if other:  # sliding layers are full ones while the cache fits the window (LeanDecoder.window_blocker)
        return f"layer types {', '.join(sorted(other))}"
    try:
        rotary = rotary_function(inner.layers[0].self_attn) if len(inner.layers) else None
    except UnsupportedVersionError as exc:  # the lean step reads a transformers name checked with some versions only
        return str(exc)
    if rotary is None:
        return "no RoPE (apply_rotary_pos_emb) beside its attention"
    layer_parts = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    for layer in inner.layers:
        children = {n for n, _ in layer.named_children()}
        if not layer_parts <= children:
            return f"a decoder layer without {', '.join(sorted(layer_parts - children))}"
        if children - layer_parts not in (set(), SANDWICH_NORMS):  # cross-attention, ...: another residual layout
            return f"decoder layers with {', '.join(sorted(children - layer_parts))}"
        attn = layer.self_attn
        if not all(
            isinstance(getattr(attn, p, None), torch.nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        ):
            return "attention without q/k/v/o linear projections"
        if not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
            return "attention without head_dim and scaling"
        extra = {n for n, _ in attn.named_children()} - {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
        if extra:
            return f"attention with {', '.join(sorted(extra))}"
    return None


class LeanDecoder:
    """One decode step of a model :func:`lean_blocker` accepts: ``step(tokens, positions, cache, slot, mask)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        #: attention through rl-tpu's decode attention kernel; the sampler sets it with its packed weights (the CPU fast
        #: paths), where the kernels are built (``panel_kernel.backend() == "panel"``)
        self.attention_kernel = False
        inner = model.model
        self.embed, self.layers, self.rotary = inner.embed_tokens, list(inner.layers), inner.rotary_emb
        self.norm, self.head = _norm_fn(inner.norm), model.lm_head
        first = self.layers[0].self_attn
        self.apply_rotary = rotary_function(first)
        self.head_dim = int(first.head_dim)
        self.qkv: list = [None] * len(self.layers)  # per layer: fused q/k/v function, or None
        self.norms = [(_norm_fn(l.input_layernorm), _norm_fn(l.post_attention_layernorm)) for l in self.layers]
        # Gemma's sandwich: (post-attention norm, pre-MLP norm, post-MLP norm) per layer, else None
        self.sandwich = [
            (self.norms[i][1], _norm_fn(l.pre_feedforward_layernorm), _norm_fn(l.post_feedforward_layernorm))
            if SANDWICH_NORMS <= {n for n, _ in l.named_children()}
            else None
            for i, l in enumerate(self.layers)
        ]
        #: per layer its sliding window (tokens), or None: the step attends to every written slot, which is the
        #: window's computation only while the cache holds no more slots than the window (:meth:`window_blocker`)
        self.windows = cache_windows(model.config)
        # RoPE per layer type where the rotary module computes one per type (Gemma 3: local 10k, global 1M bases)
        types = getattr(model.config, "layer_types", None)
        typed = "layer_type" in inspect.signature(self.rotary.forward).parameters and types is not None
        self.rope_types = list(types) if typed else [None] * len(self.layers)
        self.qk_norms = [
            tuple(_norm_fn(getattr(l.self_attn, n)) if hasattr(l.self_attn, n) else None for n in ("q_norm", "k_norm"))
            for l in self.layers
        ]
        self.mlps = [self._mlp_fn(l.mlp) for l in self.layers]

    @staticmethod
    def _mlp_fn(mlp: torch.nn.Module):
        """The SiLU-gated MLP written out (``down(silu(gate(x)) * up(x))``) when that is the module's computation
        (its three linear layers and a SiLU ``act_fn``), else the module (a mixture of experts, another MLP)."""
        linears = all(isinstance(getattr(mlp, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))
        act = getattr(mlp, "act_fn", None)
        if (
            linears
            and isinstance(act, torch.nn.SiLU)
            and {n for n, _ in mlp.named_children()} <= {"gate_proj", "up_proj", "down_proj", "act_fn"}
        ):
            return lambda x: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return mlp

    def use_packed(self, packed) -> None:
        """Compute each layer's query, key and value projections as one product on ``packed``'s fused copy
        (:meth:`rl_tpu.sampler.packed.PackedLinears.fused`; call within its ``applied`` block)."""
        self.qkv = [
            packed.fused((l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)) if packed is not None else None
            for l in self.layers
        ]

    def window_blocker(self, cache_len: int) -> str | None:
        """Why the step would not compute a sliding layer's attention over a KV cache of ``cache_len`` slots, or
        ``None``. A sliding layer attends to the last ``window`` positions; while the cache holds at most ``window``
        slots that is every written slot, the full attention the step computes (and the static cache does not
        roll). Past that the model's own forward runs the window."""
        windows = [w for w in self.windows if w is not None]
        if windows and cache_len > min(windows):
            return f"a KV cache of {cache_len} slots past the sliding window of {min(windows)}"
        return None

    @classmethod
    def build(cls, model: torch.nn.Module) -> LeanDecoder | None:
        """A decoder for ``model``, or ``None`` when :func:`lean_blocker` names a reason it would differ."""
        return None if lean_blocker(model) is not None else cls(model)

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticCache, slot: int, mask: torch.Tensor
    ) -> torch.Tensor:
        """Run one token per row and write its keys and values at cache slot ``slot``.

        Args:
            tokens: ``(batch,)`` int64 token ids.
            positions: ``(batch,)`` int64 position ids (a row's token count before this one).
            cache: the batch's static cache, prefilled; every layer initialised, ``slot`` < its length.
            slot: cache slot of this step's token (the same for every row: rows are left-padded).
            mask: ``(batch, 1, 1, cache_len)`` bool, True where a row's slot holds a real token.

        Returns:
            ``(batch, vocab)`` float32 logits of the next token.
        """
        batch = tokens.shape[0]
        kv_len = slot + 1
        mask = mask[..., :kv_len]
        where = torch.tensor([slot], device=tokens.device)
        h = self.embed(tokens[:, None])  # (batch, 1, hidden)
        rope = {  # layer type -> (cos, sin), each (batch, 1, head_dim)
            t: self.rotary(h, position_ids=positions[:, None], **({"layer_type": t} if t is not None else {}))
            for t in dict.fromkeys(self.rope_types)
        }
        hd = self.head_dim
        for layer, cached, qkv, (norm1, norm2), (q_norm, k_norm), mlp, sandwich, rope_type in zip(
            self.layers, cache.layers, self.qkv, self.norms, self.qk_norms, self.mlps, self.sandwich, self.rope_types
        ):
            cos, sin = rope[rope_type]
            attn = layer.self_attn
            x = norm1(h)
            q, k, v = qkv(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            q, k = q.view(batch, 1, -1, hd), k.view(batch, 1, -1, hd)  # (batch, 1, heads, head_dim)
            if q_norm is not None:
                q = q_norm(q)
            if k_norm is not None:
                k = k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (batch, heads, 1, head_dim)
            v = v.view(batch, 1, -1, hd).transpose(1, 2)  # (batch, kv_heads, 1, head_dim)
            q, k = self.apply_rotary(q, k, cos, sin)
            cached.keys.index_copy_(2, where, k)
            cached.values.index_copy_(2, where, v)
            cached.cumulative_length.fill_(kv_len)
            if hasattr(cached, "cumulative_length_int"):  # a sliding layer's own count (transformers' static cache)
                cached.cumulative_length_int = kv_len
            out = decode_attention(
                q,
                cached.keys[:, :, :kv_len],
                cached.values[:, :, :kv_len],
                mask,
                attn.scaling,
                kernel=self.attention_kernel,
            )
            if sandwich is None:
                h = h + attn.o_proj(out.reshape(batch, 1, -1))
                h = h + mlp(norm2(h))
            else:  # Gemma: h + norm(attn(norm(h))), then h + norm(mlp(norm(h)))
                post_attn, pre_mlp, post_mlp = sandwich
                h = h + post_attn(attn.o_proj(out.reshape(batch, 1, -1)))
                h = h + post_mlp(mlp(pre_mlp(h)))
        return self.head(self.norm(h)[:, 0])  # (batch, vocab)


@torch.no_grad()
def probe_error(model: torch.nn.Module, decoder: LeanDecoder, prompt_len: int = 9) -> float:
    """Max abs difference in log-probabilities between ``decoder.step`` and the model's own forward for one token
    after a ``prompt_len``-token prompt (fixed random token ids): the check that the lean step is the model's."""
    windows = [w for w in decoder.windows if w is not None]
    prompt_len = max(1, min([prompt_len, *(w - 1 for w in windows)]))  # within every window: the lean step's case
    vocab = int(model.get_input_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, prompt_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
    want = model(input_ids=ids).logits[0, -1].float()  # (vocab,)
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + 1)
    model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True)
    mask = torch.ones((1, 1, 1, prompt_len + 1), dtype=torch.bool, device=device)
    got = decoder.step(ids[:, prompt_len], torch.tensor([prompt_len], device=device), cache, prompt_len, mask)[0]
    return float((want.log_softmax(-1) - got.float().log_softmax(-1)).abs().max())
