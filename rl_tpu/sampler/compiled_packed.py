"""Packed linear layers inside the sampler's compiled CPU graphs (``Sampler(compile=True)`` on a float32 model).

Inductor, without ``freezing``, hands a compiled graph's linear layers to ATen's ``mm``/``addmm``, which on this
project's CPUs is MKL's general ``sgemm`` on the row-major weight: at the decode step's few rows it reaches about
60 GFLOP/s on one AMD EPYC core, where oneDNN's inner product on a copy of the weight reordered once into its blocked
layout reaches about 140 (``benchmarks/bench_eager_ops.py`` prints both). ``freezing`` would let inductor pack the
weights itself, but it bakes them into the graph as constants, so a weight sync would be ignored; and a packed
(opaque oneDNN) tensor cannot be a graph input.

So the packed copies stay outside the graph. :func:`pack_linears` rewrites the graph dynamo captured, before the
backend compiles it: each ``linear(x, weight, bias)`` whose weight is a float32 CPU graph input (a parameter: with
``inline_inbuilt_nn_modules``, dynamo's default, parameters are inputs) becomes a custom op the backend calls as an
external kernel, as it calls ``mm``: ``rl_tpu_kernels::packed_linear(x, weight, bias, cache)`` where rl-tpu's
kernels are built (C++: a call costs ~3 us besides the product, against ~10 for the op written in Python, 211
calls per SmolLM2 decode step), else ``rl_tpu::packed_linear(x, weight, bias)`` (Python, oneDNN). Either looks the
packed copy up in the :class:`PackCache` of the compiled steps (the C++ op by the cache's ``id``, the Python one in
the cache that is running, :meth:`PackCache.active`), keyed by the weight's storage address, shape and strides,
and used only while the weight's version counter is the one packed and its storage is the one packed (a weak
reference), so an in-place copy into a parameter, or a parameter rebound to other storage (shared memory), is packed
again at its next use; copies of freed storage are dropped. A write this process's version counters do not see (another
process through shared memory, or ``param.data.copy_``) must be announced (:meth:`PackCache.release`, which
``Sampler.weights_changed`` calls), as for the eager sampler's packed weights.
For a weight or input that is not float32 either op is ``torch.nn.functional.linear``; so is the Python op outside
an active cache (the C++ op always uses the cache its graph names). Copies of freed weights are dropped at the next
packing in the same cache.

The packed copies and the product are :mod:`rl_tpu.sampler.panel_kernel`'s: rl-tpu's AVX-512 panel kernel (1.35-1.6x
oneDNN at the decode's 16 rows on this project's AMD EPYC hosts), or oneDNN's inner product where that kernel cannot
run. The numbers are float32 as before, summed in the kernel's order: they differ from ``F.linear`` by float32 rounding
(relative ~1e-6), as :mod:`rl_tpu.sampler.packed` does for the eager CPU sampler. The packed copies cost the weights'
size again while they exist.
"""

from __future__ import annotations

import contextvars
import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from rl_tpu.patches import torch_internals
from rl_tpu.sampler import panel_kernel

__all__ = ["PackCache", "pack_linears"]

_ACTIVE: contextvars.ContextVar[PackCache | None] = contextvars.ContextVar("rl_tpu_pack_cache", default=None)
_IDS = itertools.count()


def _native() -> bool:
    """Whether the graphs take the C++ op (rl-tpu's kernels are built and pass their self-check)."""
    return panel_kernel.backend() == "panel"


def _release_native(cache_id: int) -> None:
    if panel_kernel.ready():  # nothing to free (nor to build) if the kernels were never loaded
        torch.ops.rl_tpu_kernels.release_cache(cache_id)


class PackCache:
    """Packed copies of the weights one :class:`~rl_tpu.sampler.compiled.CompiledSteps` multiplies by.

    Args:
        batch_hint: the row count oneDNN tunes the packed layout for (the decode batch; other counts give the same
            result).

    Attributes:
        id: this cache's number in the C++ op's table (its copies there are freed with the cache).
    """

    def __init__(self, batch_hint: int = 16) -> None:
        self.batch_hint = max(1, int(batch_hint))
        self.id = next(_IDS)
        # (data_ptr, shape, stride) -> (version, packed copy, weak reference to the weight's storage)
        self._packed: dict[tuple, tuple[int, torch.Tensor, StorageWeakRef]] = {}
        weakref.finalize(self, _release_native, self.id)

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies hold now (float32, the weights' size, panels padded to 16 rows; 0 after
        :meth:`release`)."""
        native = torch.ops.rl_tpu_kernels.cache_bytes(self.id) if panel_kernel.ready() else 0
        return native + sum(4 * key[1][0] * key[1][1] for key in self._packed)

    def release(self) -> None:
        """Drop every packed copy (the weights changed where this process cannot see it, or memory is needed)."""
        self._packed = {}
        _release_native(self.id)

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` ``(out, in)`` float32, packed now if missing, if the weight was written in
        this process since (its version counter moved), or if its storage is not the one packed (freed, and another
        tensor now at its address)."""
        key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()))
        version = torch_internals.version_counter(weight)
        entry = self._packed.get(key)
        if (
            entry is None
            or entry[0] != version
            or entry[2].expired()
            or entry[2].cdata != torch_internals.storage_key(weight)
        ):
            for stale in [k for k, (_, _, ref) in self._packed.items() if ref.expired()]:
                del self._packed[stale]  # weights freed or rebound: their copies go with them
            packed = panel_kernel.pack(weight, self.batch_hint)
            entry = (version, packed, StorageWeakRef(weight.untyped_storage()))
            self._packed[key] = entry
        return entry[1]

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, ``rl_tpu::packed_linear`` multiplies by this cache's packed copies."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


#: ``rl_tpu::packed_linear``, defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: the
#: latter's Python wrapper cost ~13 us per call (211 calls per SmolLM2 decode step), this one's ~4. It has no
#: autograd formula: the sampler's graphs run without gradients.
_LIB = torch.library.Library("rl_tpu", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``: ``x`` ``(..., in)``, ``weight`` ``(out, in)``, ``bias``
    ``(out,)`` or ``None`` -> ``(..., out)``, on the active :class:`PackCache`'s packed copy of ``weight`` when
    there is one and everything is float32 on the CPU."""
    cache = _ACTIVE.get()
    if cache is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    return panel_kernel.linear(x, cache.packed(weight), bias, weight.shape[0])


def _fake_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_LIB.impl("packed_linear", packed_linear, "CPU")
torch.library.register_fake("rl_tpu::packed_linear", _fake_packed_linear, lib=_LIB)


def pack_linears(gm: torch.fx.GraphModule, cache: PackCache | None = None) -> int:
    """Rewrite, in place, the linear layers of a dynamo graph whose weight is a float32 CPU parameter (a graph
    input) into ``rl_tpu_kernels::packed_linear`` on ``cache`` (where rl-tpu's kernels are built and a cache is
    given), else ``rl_tpu::packed_linear``; returns how many were rewritten."""
    native = cache is not None and _native()
    target = torch.ops.rl_tpu_kernels.packed_linear.default if native else torch.ops.rl_tpu.packed_linear.default
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.nn.functional.linear:  # (is torch._C._nn.linear)
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        x, weight = node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        value = getattr(weight, "meta", {}).get("example_value")
        if (
            getattr(weight, "op", None) != "placeholder"
            or not isinstance(value, torch.nn.Parameter)
            or value.dtype != torch.float32
            or value.device.type != "cpu"
            or value.dim() != 2
        ):
            continue  # only a model's own float32 weights: an input that changes each call is not worth packing
        node.target, node.args, node.kwargs = target, (x, weight, bias, *([cache.id] if native else [])), {}
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
