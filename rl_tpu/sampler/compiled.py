"""Compiled prefill and decode steps for the sampler's bucketed static shapes (``Sampler(compile=True)``).

Each step is the model's own forward over the batch's static KV cache, compiled with ``torch.compile(fullgraph=True,
dynamic=False)`` and the device's compile backend (:data:`rl_tpu.device.BACKENDS`: ``tpu`` on TPU, ``inductor`` on
CPU and CUDA). One graph is compiled per shape:

* prefill: ``(batch_bucket, prompt_bucket)`` token ids against a cache of ``prompt_bucket + gen_bucket`` slots;
* decode: ``(batch_bucket, 1)`` against the same cache.

No Python number that changes from step to step reaches a compiled step (dynamo would specialise on it and compile
again each step): the cache slot a step writes is the static cache's own ``cumulative_length`` tensor, and a decode
step attends over the whole static cache, with unwritten and padding slots hidden by the attention mask (causality
from the cache position, padding from the ``(batch, cache)`` mask), rather than over the slots written so far (the
eager CPU decode's ``rl_tpu_kv_len``, a Python int). A new cache for each batch is not a new graph: the guards are on
shapes and dtypes, not on the tensors' identity, and the model's parameters are graph inputs, so a weight sync (an
in-place copy, or ``param.data`` rebound to shared memory) needs no recompile. Do not turn on inductor's
``freezing``: it bakes the weights into the graph as constants, and a sync would then be ignored.

When a model does not compile as one graph (a graph break under ``fullgraph=True``, an op the backend lacks), or
compiles a second graph for a shape it already has (its step depends on a Python value that changes from call to
call: transformers' sliding-window static cache layers count their length in a Python int, so Gemma3, Mistral or
windowed Qwen2 would compile a decode graph per step), the sampler says so in one line naming the model and the
reason (dynamo's failed guard), and runs its eager forward from then on: the same numbers as without the setting,
never a half-compiled step.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
from collections.abc import Callable

import torch

from rl_tpu.patches import torch_internals  # Dynamo's private settings, errors and records, version-checked
from rl_tpu.sampler import panel_kernel
from rl_tpu.sampler.compiled_packed import PackCache, pack_linears
from rl_tpu.sampler.fastpaths import say_once

#: most graphs one step kind (prefill or decode) may compile before dynamo would fall back to eager on its own
#: (its default is 8 per function): batch buckets x prompt buckets x generation buckets stays below it
RECOMPILE_LIMIT = 512

_IDS = itertools.count()


def _attention_ops() -> tuple:
    try:
        packet = torch.ops.rl_tpu_kernels.decode_attention
    except (AttributeError, RuntimeError):  # the kernels' library is not loaded: no graph has the op
        return ()
    return packet, packet.default


def model_logits(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache, **extra
) -> torch.Tensor:
    """The model's forward over the static ``cache``: ``ids``/``pos`` ``(batch, q)`` int64, ``mask`` ``(batch,
    cache_len)`` int64 (1 = a real token) -> last-position logits ``(batch, vocab)`` in the model's dtype. Writes the
    ``q`` tokens' keys and values at the cache's next slots (its ``cumulative_length``)."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **extra,
    )
    return out.logits[:, -1, :]


def compile_backend_for(device: torch.device | str) -> str:
    """The ``torch.compile`` backend of a device type (``tpu`` -> ``"tpu"``, ``cpu``/``cuda`` -> ``"inductor"``)."""
    from rl_tpu.device import BACKENDS

    kind = torch.device(device).type
    return BACKENDS[kind].compile_backend if kind in BACKENDS else "inductor"


class CompiledSteps:
    """The sampler's prefill and decode as compiled graphs, one per shape, with an eager fallback.

    Args:
        model: the sampler's Hugging Face causal LM (eval mode).
        backend: a ``torch.compile`` backend name (``"inductor"``, ``"tpu"``, ``"aot_eager"``, ...) or callable.
        packed_weights: the graphs' float32 CPU linear layers multiply by oneDNN-packed copies of their weights, kept
            outside the graph (:mod:`rl_tpu.sampler.compiled_packed`); the copies cost the weights' size again.

    Attributes:
        graphs: ``{"prefill": n, "decode": n}`` graphs compiled so far (one per shape unless something recompiled).
        compile_s: ``{"prefill": s, "decode": s}`` wall seconds of the calls that compiled a graph (tracing, the
            backend's compile, and that one run).
        active: ``False`` once a compile failed or a step compiled a second graph for a shape it had (said once);
            every step then runs eagerly.
        packed_linears: ``{"prefill": n, "decode": n}`` linear layers of the last graph of each kind that run on
            packed weights.
        attention_kernels: ``{"prefill": n, "decode": n}`` attention layers of the last graph of each kind that run
            rl-tpu's decode attention kernel (with ``packed_weights``, where it is built and applies).
        packs: the :class:`~rl_tpu.sampler.compiled_packed.PackCache` of the packed copies (``None`` without
            ``packed_weights``).
    """

    def __init__(
        self, model: torch.nn.Module, backend: str | Callable = "inductor", packed_weights: bool = False
    ) -> None:
        self.model = model
        self.backend = backend
        self.packs = PackCache() if packed_weights else None
        self.packed_linears = {"prefill": 0, "decode": 0}
        self.attention_kernels = {"prefill": 0, "decode": 0}
        self.graphs = {"prefill": 0, "decode": 0}
        self.compile_s = {"prefill": 0.0, "decode": 0.0}
        self.active = True
        self._codes: dict[str, object] = {}  # kind -> the compiled function's code (dynamo's guard failures key)
        self._shapes: dict[str, set] = {"prefill": set(), "decode": set()}
        self._fns = {kind: self._compile(kind) for kind in ("prefill", "decode")}

    def _compile(self, kind: str):
        def backend(gm: torch.fx.GraphModule, example_inputs):
            self.graphs[kind] += 1
            if self.packs is not None:
                self.packed_linears[kind] = pack_linears(gm, self.packs)
            ops = _attention_ops()
            self.attention_kernels[kind] = sum(
                node.op == "call_function" and node.target in ops for node in gm.graph.nodes
            )
            inner = torch_internals.lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
            return inner(gm, example_inputs)

        model = self.model

        # with packed weights (the CPU fast paths) the decode's attention is rl-tpu's kernel, an opaque op in the graph
        extra = (
            {"rl_tpu_attention_kernel": True} if self.packs is not None and panel_kernel.backend() == "panel" else {}
        )

        def step(ids, mask, pos, cache):
            return model_logits(model, ids, mask, pos, cache, **extra)

        # a code object of its own per step kind and sampler: dynamo keeps its graphs, guard failures and recompile
        # limit per code object, so no step checks the guards of another's graphs
        name = f"sampler_{kind}_{next(_IDS)}"
        code = step.__code__.replace(co_name=name, co_qualname=name)
        step = types.FunctionType(code, step.__globals__, name, None, step.__closure__)
        self._codes[kind] = code
        return torch.compile(step, fullgraph=True, dynamic=False, backend=backend)

    @property
    def total_graphs(self) -> int:
        """Graphs compiled so far, both kinds."""
        return sum(self.graphs.values())

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """:func:`model_logits` through the compiled graph of this shape (compiled on first use): a decode step when
        ``ids`` is ``(batch, 1)``, else a prefill. Returns ``(batch, vocab)`` logits."""
        if not self.active:
            return model_logits(self.model, ids, mask, pos, cache)
        kind = "decode" if ids.shape[1] == 1 else "prefill"
        self._shapes[kind].add((tuple(ids.shape), tuple(mask.shape)))
        before, start = self.graphs[kind], time.perf_counter()
        packs = self.packs.active() if self.packs is not None else contextlib.nullcontext()
        try:
            with packs, torch_internals.recompile_limits(RECOMPILE_LIMIT):
                logits = self._fns[kind](ids, mask, pos, cache)
        except torch_internals.dynamo_errors()[0]:  # RecompileError
            raise  # the caller asked to be told (set_stance("fail_on_recompile") raises a RuntimeError or this)
        except torch_internals.dynamo_errors()[1] as exc:  # TorchDynamoException: raised while tracing or compiling
            self._off(f"{type(exc).__name__}: {exc}")
            return model_logits(self.model, ids, mask, pos, cache)
        if self.graphs[kind] != before:
            self.compile_s[kind] += time.perf_counter() - start
            if self.graphs[kind] > len(self._shapes[kind]):  # compiled again for a shape it had: the graph depends
                # on a Python value that changes between calls (transformers' sliding-window static cache counts
                # its length in a Python int), so it would compile at every step
                failed = [
                    r
                    for r in (torch_internals.guard_failures(self._codes[kind]) or ["?"])
                    if "mismatch" not in r.splitlines()[0]
                ] or ["?"]  # not another shape's graph
                self._off(
                    f"its {kind} step compiled again for the same shape, on a guard that changes each call: "
                    f"{failed[-1].splitlines()[0]}"
                )
        return logits

    def weights_changed(self) -> None:
        """Drop the packed copies (rebuilt at the next step); see :meth:`PackCache.release`."""
        if self.packs is not None:
            self.packs.release()

    def _off(self, reason: str) -> None:
        self.active = False
        self.weights_changed()  # the eager steps do not read the packed copies: free them
        say_once(
            f"compiled steps off for {type(self.model).__name__} ({' '.join(reason.split())[:300]}): prefill "
            "and decode run eagerly"
        )
