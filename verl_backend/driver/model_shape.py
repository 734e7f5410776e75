"""What the memory plan needs of a model: its widths and parameter counts, counted on a meta-device instance.

``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` builds the model without memory or weights, so
every family transformers ships (dense, sliding-window, mixture of experts) is counted exactly, not from a formula.

:func:`tpu_bytes` sizes one array as a TPU holds it, and :meth:`ModelShape.block_graph`,
:meth:`ModelShape.head_graph` and :meth:`ModelShape.sampler_graph` list what each graph of the TPU job holds
(``verl train --aot-only`` compiles the same graphs, :mod:`verl_backend.driver.aot`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tpu_bytes(shape, itemsize: int) -> int:
    """Bytes of an array of ``shape`` as a TPU holds it in HBM (XLA's default layout for the shape).

    A TPU array is stored in tiles over two of its dimensions, the minor one padded to a multiple of 128 lanes and
    the next one to 8 sublanes (``T(8,128)``; bf16 packs two rows per 32-bit word within that tile, ``(2,1)``, with
    no further padding). The second-minor tile shrinks for short dimensions: a dimension of 4 or fewer is padded to
    the next power of two (at least 2 for 16-bit types: ``T(4,128)``, ``T(2,128)``, ``T(1,128)``). XLA chooses
    *which* two dimensions are minor, and picks the pair that pads least: ``bf16[1,1024,576]`` is laid out
    ``{1,2,0:T(8,128)(2,1)}`` (the 1024 tokens minor, the 576 features next: no padding at all), ``bf16[576,576]``
    pads its 576 to 640 (+11%), a ``(tokens, 1)`` rsqrt of fp32 pads its 1 to ``T(1,128)`` (nothing). A 1-D array
    pads to a tile of the next power of two of its length, between 128 elements (256 for 16-bit types) and 1024.
    Measured with libtpu 0.0.52's compiler for v6e (the argument and output sizes it reports for single-array
    programs, and every output of the 8B block graph: within 128 bytes of its total).

    Args:
        shape: the array's dimensions; ``itemsize``: bytes per element (2 bf16, 4 fp32, 8 int64).
    """
    dims = [int(d) for d in shape]
    if not dims:
        return itemsize
    if len(dims) == 1:
        tile = min(1024, max(256 if itemsize == 2 else 128, _pow2(dims[0])))
        return -(-dims[0] // tile) * tile * itemsize
    floor = 2 if itemsize == 2 else 1
    best = None
    for i, minor in enumerate(dims):
        for j, second in enumerate(dims):
            if i == j:
                continue
            rows = 8 if second > 4 else max(floor, _pow2(second))
            rest = math.prod(d for k, d in enumerate(dims) if k not in (i, j))
            size = -(-minor // 128) * 128 * (-(-second // rows) * rows) * rest
            best = size if best is None else min(best, size)
    return best * itemsize


def arrays_bytes(arrays) -> int:
    """Total :func:`tpu_bytes` of ``[(what, shape, itemsize)]`` rows (what :meth:`ModelShape.block_graph` lists)."""
    return sum(tpu_bytes(shape, size) for _, shape, size in arrays)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, counted on a meta-device instance (no weights read).

    Attributes:
        name: architecture class (``Qwen3ForCausalLM``).
        params: parameters (tied embeddings counted once).
        layer_params: parameters of the largest decoder block; ``root_params``: parameters outside the blocks.
        lora_linear: ``sum(in + out)`` over the blocks' linear layers (a LoRA adapter of rank r has r times this).
        hidden, layers, heads, kv_heads, head_dim, vocab, intermediate: the config's widths (``intermediate`` is an
            expert's width for a mixture of experts).
        experts, experts_active: routed experts per layer and experts per token (0, 0 for a dense MLP).
        qk_norm: the blocks normalise queries and keys (Qwen3, Gemma3).
        tied: the LM head shares the input embedding's weight.
        block_shapes: the largest block's parameter shapes; ``head_shapes``: the LM head graph's (final norm and
            LM head weight, the embedding's when tied); ``param_shapes``: every parameter shape of the model with its
            count, ``((shape, n), ...)``. Empty for a shape made by hand: the TPU graph sizes are then dense.
    """

    name: str
    params: int
    layer_params: int
    root_params: int
    lora_linear: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    experts: int = 0
    experts_active: int = 0
    qk_norm: bool = False
    tied: bool = True
    block_shapes: tuple = ()
    head_shapes: tuple = ()
    param_shapes: tuple = ()

    def _params(self, shapes, count: int, itemsize: int, what: str) -> list[tuple[str, tuple, int]]:
        return [(what, tuple(s), itemsize) for s in shapes] if shapes else [(what, (count,), itemsize)]

    def block_graph(self, batch: int, seq: int, itemsize: int) -> dict[str, list[tuple[str, tuple, int]]]:
        """What one transformer block's compiled training graphs hold on TPU, as ``[(what, shape, itemsize)]`` per
        part (sizes: :func:`arrays_bytes`), for a micro batch of ``batch`` rows padded to ``seq`` tokens in the
        compute dtype (``itemsize``, 2 for VeRL's bf16 ``param_dtype``), with attention as XLA ops (SDPA's math path,
        which computes in fp32), as ``verl train --aot-only`` lowers it:

        - ``arguments`` of the forward: the gathered block's parameters, its input hidden states, the rotary
          ``cos``/``sin`` tables and the additive mask ``(batch, 1, seq, seq)``;
        - ``saved``: the forward's computed outputs, what autograd keeps for each op's backward: the block's output;
          each RMSNorm's output (the next matmul's input) and fp32 ``rsqrt``; the attention's output (``o_proj``'s
          input) and ``o_proj``'s output (the residual sum the second norm's backward recomputes); the MLP's gate,
          up and ``act(gate)·up`` (``down_proj``'s input); and the math attention's operands in fp32: the query, the
          key and value repeated to every query head (grouped-query attention) and the softmax probabilities
          ``(batch, heads, seq, seq)``. With query/key norms (Qwen3) also the query and key projections and their
          fp32 ``rsqrt``. A mixture of experts is estimated as ``E + k(h + 4I)`` per token for its MLP;
        - ``returned``: the inputs the forward returns for the backward (its hidden states, ``cos``, ``sin``, the
          parameters): TorchTPU's graph returns them as results, and XLA copies an argument it returns into an
          output buffer (no donation);
        - ``gradients``: the backward's outputs, the parameters' gradients and the input's, in the compute dtype.
        """
        b, h, H, kvh, d, i = itemsize, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate
        t, q, kv = batch * seq, H * d, kvh * d
        params = self._params(self.block_shapes, self.layer_params, b, "block parameter")
        inputs = [
            ("hidden states", (batch, seq, h), b),
            ("rotary cos", (batch, seq, d), b),
            ("rotary sin", (batch, seq, d), b),
        ]
        saved = [
            ("block output", (batch, seq, h), b),
            ("input norm rsqrt", (batch, seq, 1), 4),
            ("input norm output", (t, h), b),
            ("attention output", (t, q), b),
            ("o_proj output", (t, h), b),
            ("post-attention norm rsqrt", (batch, seq, 1), 4),
            ("post-attention norm output", (t, h), b),
            ("softmax probabilities (fp32)", (batch, H, seq, seq), 4),
            ("query (fp32)", (batch * H, d, seq), 4),
            ("key, repeated (fp32)", (batch * H, d, seq), 4),
            ("value, repeated (fp32)", (batch * H, seq, d), 4),
        ]
        if self.qk_norm:
            saved += [
                ("q_proj output", (t, q), b),
                ("q_norm rsqrt", (batch, seq, H, 1), 4),
                ("k_proj output", (t, kv), b),
                ("k_norm rsqrt", (batch, seq, kvh, 1), 4),
            ]
        if self.experts:
            saved.append(
                ("MoE router and expert inputs (estimate)", (t, self.experts + self.experts_active * (h + 4 * i)), b)
            )
        else:
            saved += [("MLP gate", (t, i), b), ("MLP up", (t, i), b), ("MLP act(gate)*up", (t, i), b)]
        return {
            "arguments": params + inputs + [("attention mask", (batch, 1, seq, seq), b)],
            "saved": saved,
            "returned": inputs + params,
            "gradients": params + [("input gradient", (batch, seq, h), b)],
        }

    def head_graph(self, batch: int, seq: int, itemsize: int) -> dict[str, list[tuple[str, tuple, int]]]:
        """What the compiled LM head graphs hold on TPU (final norm, LM head, log-softmax in fp32 and the labels'
        log-probs), as :meth:`block_graph` lists them: ``arguments`` (the norm and LM head weights, the hidden
        states, the int64 labels), ``saved`` (the log-probs, the norm's rsqrt and output, the labels, the fp32
        log-softmax ``(batch, seq, vocab)`` its backward reads), ``returned`` (hidden states and weights, copied),
        ``temporaries`` (the logits in the compute dtype, before the fp32 cast) and ``gradients``."""
        b, h, v = itemsize, self.hidden, self.vocab
        t = batch * seq
        params = self._params(self.head_shapes, v * h + h, b, "LM head parameter")
        hidden = [("hidden states", (batch, seq, h), b)]
        return {
            "arguments": params + hidden + [("labels", (batch, seq), 8)],
            "saved": [
                ("log-probs (fp32)", (batch, seq), 4),
                ("norm rsqrt", (batch, seq, 1), 4),
                ("norm output", (t, h), b),
                ("labels", (batch, seq, 1), 8),
                ("log-softmax (fp32)", (batch, seq, v), 4),
            ],
            "returned": hidden + params,
            "temporaries": [("logits", (batch, seq, v), b)],
            "gradients": params + [("input gradient", (batch, seq, h), b)],
        }

    def sampler_graph(self, batch: int, tokens: int, cache: int, itemsize: int) -> dict[str, list]:
        """What the sampler's compiled prefill (``tokens`` = the prompt bucket) or decode step (``tokens`` = 1) holds
        on TPU: ``arguments`` (every weight, unsharded, in ``itemsize``; the static KV cache, a key and a value array
        ``(batch, kv_heads, cache, head_dim)`` per layer; the int64 token ids, mask and positions) and ``outputs``
        (the last position's logits in ``itemsize``, and the cache again: the step writes its new keys and values
        into a copy, the cache arguments not being donated)."""
        b, kvh, d = itemsize, self.kv_heads, self.head_dim
        weights = (
            [("weight", tuple(s), b) for s, n in self.param_shapes for _ in range(n)]
            if self.param_shapes
            else [("weights", (self.params,), b)]
        )
        kv = [("KV cache", (batch, kvh, cache, d), b)] * (2 * self.layers)
        steps = [("token ids", (batch, tokens), 8), ("mask", (batch, cache), 8), ("positions", (batch, tokens), 8)]
        return {
            "weights": weights,
            "cache": kv,
            "arguments": weights + kv + steps,
            "outputs": [("logits", (batch, self.vocab), b)] + kv,
        }

    def block_temporaries(self, batch: int, seq: int, itemsize: int) -> list[tuple[str, tuple, int]]:
        """An upper bound on the temporaries of one block's compiled graphs on TPU (the larger of forward and
        backward): the math attention's two fp32 arrays of the scores' size ``(batch, heads, seq, seq)`` (forward:
        the scores and the masked scores the softmax reads; backward: the probabilities' gradient and the scores'),
        the MLP's three ``(tokens, I)`` gradients in the compute dtype and the fp32 gradients of the query, key and
        value. XLA materialises the two score-sized arrays for Qwen3-8B at 2048 tokens and fuses them away for
        SmolLM2 at 1024 (docs/tpu.md): the plan always counts them.

        A mixture of experts runs transformers' ``batched_mm`` on TPU (:mod:`rl_tpu.expert_slices`): each of the
        ``tokens x k`` (token, expert) pairs gathers its expert's ``gate_up`` ``(2I, h)`` and ``down`` ``(h, I)``
        weights, and the backward holds their gradients, the same size again: ``2 x tokens x k x 3 I h`` elements
        (Qwen3-30B-A3B's block at 512 tokens: 77.3 GB against XLA's 61.3, docs/tpu.md)."""
        b, H, d, i, t = itemsize, self.heads, self.head_dim, self.intermediate, batch * seq
        experts = []
        if self.experts:
            pairs = t * max(1, self.experts_active)
            experts = [
                ("experts' gate_up weights gathered per token (batched_mm)", (pairs, 2 * i, self.hidden), b),
                ("experts' down weights gathered per token (batched_mm)", (pairs, self.hidden, i), b),
            ] * 2
        return (
            [("attention scores-sized (fp32)", (batch, H, seq, seq), 4)] * 2
            + [("MLP gradient", (t, i), b)] * 3
            + [("query/key/value gradient (fp32)", (batch * H, seq, d), 4)] * 3
            + experts
        )

    def sampler_temporaries(self, batch: int, tokens: int, cache: int, itemsize: int) -> list[tuple[str, tuple, int]]:
        """An estimate of the temporaries of the sampler's compiled prefill (``tokens`` > 1) or decode step on TPU:
        one layer's math attention at a time, the key and value repeated to every query head in fp32 ``(batch,
        heads, cache, head_dim)`` and, in the prefill, two fp32 arrays of the scores' size ``(batch, heads, tokens,
        cache)`` (scores and probabilities); in the decode step, a copy of one cache array per layer (the step's
        cache arrays are not donated: XLA writes each layer's new key or value into a copy, docs/tpu.md)."""
        H, d, kvh = self.heads, self.head_dim, self.kv_heads
        rows = [("key/value repeated to every head (fp32)", (batch, H, cache, d), 4)] * 2
        if tokens > 1:
            return rows + [("attention scores-sized (fp32)", (batch, H, tokens, cache), 4)] * 2
        return rows + [("KV cache array copy", (batch, kvh, cache, d), itemsize)] * self.layers

    def block_elements(self, seq_len: int, fused_attention: bool) -> int:
        """Activation elements one block keeps for its backward, per token (Korthikanti et al. 2022, §4.1)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = (
            (self.experts + self.experts_active * (h + 4 * self.intermediate))
            if self.experts
            else 4 * self.intermediate
        )
        n = 4 * h + 2 * q + 2 * kv + mlp + ((q + kv) if self.qk_norm else 0)
        return n + (0 if fused_attention else self.heads * seq_len)


def model_shape(hf_config, trust_remote_code: bool = False) -> ModelShape:
    """Count ``hf_config``'s model (a transformers ``PretrainedConfig``) on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = int(text.num_hidden_layers)
    blocks = max(
        (m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers),
        key=lambda m: sum(p.numel() for p in m.parameters()),
    )
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    largest = blocks[per_block.index(max(per_block))]
    in_blocks = {id(p) for p in blocks.parameters()}
    counts: dict[tuple, int] = {}
    for p in model.parameters():
        counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
    norm = getattr(getattr(model, "model", None), "norm", None)
    head = model.get_output_embeddings()
    head_params = [*(norm.parameters() if norm is not None else ()), *(head.parameters() if head is not None else ())]
    params = sum(p.numel() for p in model.parameters())
    lora = sum(m.in_features + m.out_features for m in blocks.modules() if isinstance(m, torch.nn.Linear))
    heads = int(text.num_attention_heads)
    experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
    return ModelShape(
        name=type(model).__name__,
        params=params,
        layer_params=max(per_block),
        root_params=params - sum(per_block),
        lora_linear=lora,
        hidden=int(text.hidden_size),
        layers=layers,
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        vocab=int(text.vocab_size),
        intermediate=int((getattr(text, "moe_intermediate_size", None) if experts else None) or text.intermediate_size),
        experts=experts,
        experts_active=int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
        qk_norm=any(n.endswith("q_norm") for n, _ in model.named_modules()),
        tied=bool(getattr(text, "tie_word_embeddings", getattr(hf_config, "tie_word_embeddings", True))),
        block_shapes=tuple(tuple(p.shape) for p in largest.parameters()),
        head_shapes=tuple(tuple(p.shape) for p in head_params if id(p) not in in_blocks),
        param_shapes=tuple(sorted(counts.items())),
    )


@functools.lru_cache(maxsize=8)
def shape_of_path(path: str, trust_remote_code: bool) -> ModelShape:
    """The :class:`ModelShape` of the model folder ``path`` (its ``config.json`` only), cached per path."""
    from transformers import AutoConfig

    return model_shape(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), trust_remote_code)
