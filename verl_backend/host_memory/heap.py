"""Host memory of CPU processes whose tensors live on the C heap: glibc malloc settings, heap trims, and a garbage
collector that skips long-lived objects. The CPU host-memory machinery's glibc and ``gc`` code, all of it, here.

Each part is behind a setting of the job (``verl_backend.settings``): ``rl_tpu.compact_malloc``
(:data:`HOST_MALLOC_ENV`, :func:`tune_host_malloc`), ``rl_tpu.trim_backward`` (:class:`BackwardHeapTrim`);
:func:`trim_host_heap` between phases and :func:`freeze_long_lived_objects` once per worker are on every CPU job.
Whether each default pays is measured by ``benchmarks/bench_host_memory.py`` (time and memory, median of 3).
Where there is no glibc every function does nothing and says so by its return value.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "HOST_MALLOC_ENV",
    "BackwardHeapTrim",
    "freeze_long_lived_objects",
    "host_malloc_env",
    "trim_host_heap",
    "tune_host_malloc",
]

_LIBC: Any = None

# Compact glibc malloc settings for a process whose tensors live on the host (``RL_TPU_COMPACT_MALLOC=1`` on
# ``verl train --backend cpu``). ``MALLOC_MMAP_THRESHOLD_``: every allocation of 128 KiB or more (a tensor of 32k
# float32 values) gets its own mmap and goes back to the OS when freed. Left unset, glibc raises the threshold each
# time it frees a mapped block (up to 32 MiB), so activations and gradient buckets come from the heap, whose freed
# gaps are too small or too fragmented for the next phase's sizes. ``MALLOC_ARENA_MAX``: at most two heaps however
# many threads (gRPC, Ray, TransferQueue) allocate. Both are read by glibc when a process starts (mallopt(3)).
# The price is a page fault for every page of every such tensor, each time: on SmolLM2-135M the trainer's peak was
# ~0.45-0.75 GiB lower and its update 1.3-2x slower (benchmarks/bench_grpo_step.py, a plain FSDP2 loop), so it is
# not the default.
HOST_MALLOC_ENV: dict[str, str] = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2"}
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}  # M_MMAP_THRESHOLD, M_ARENA_MAX (malloc.h)


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def host_malloc_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The glibc malloc settings a host-memory process should start with: :data:`HOST_MALLOC_ENV`, each one the
    user already set in ``environ`` (default ``os.environ``) kept as given. Pass the result as environment
    variables to the processes to start (a Ray ``runtime_env``'s ``env_vars``)."""
    environ = os.environ if environ is None else environ
    return {k: environ.get(k, v) for k, v in HOST_MALLOC_ENV.items()}


def tune_host_malloc() -> bool:
    """Apply :func:`host_malloc_env`'s settings to this already running process (glibc ``mallopt``), for the
    process that starts the others and so could not be started with them.

    Returns False where there is no glibc, or a setting is not a whole number or is refused (nothing more is done).
    """
    libc = _libc()
    if not libc:
        return False
    for key, value in host_malloc_env().items():
        try:
            if libc.mallopt(_MALLOPT[key], int(value)) != 1:
                return False
        except (KeyError, ValueError):
            return False
    return True


def trim_host_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``, a few ms).

    CPU tensors live on the C heap; glibc keeps what they free, so a process whose phases allocate differently
    (prefill, decode, a forward/backward) ratchets its resident memory up. Call between phases.
    Returns False where there is no glibc (nothing is done).
    """
    libc = _libc()
    if not libc:
        return False
    libc.malloc_trim(0)
    return True


class BackwardHeapTrim:
    """Return the C heap's free pages to the OS (:func:`trim_host_heap`) after each transformer block's backward.

    Autograd frees a block's saved activations as its backward finishes, but glibc keeps the freed pages in its
    heap, while the gradients and FSDP's reduce-scatter buffers allocated next come partly from new ``mmap`` s. So
    near the end of a host-memory backward the process holds the pages of its freed activations and its gradients at
    once: in the default job's update, up to ~1 GiB of free but resident heap (glibc ``mallinfo2`` against
    ``/proc/self/smaps_rollup``). Trimming once per block keeps the held pages close to what is alive. Measured on
    SmolLM2-135M (30 blocks, FSDP2 on gloo, one thread, 400-token micro batches): peak anonymous memory
    3.91 -> 3.53 GiB, step time about 3-5% longer, the price of faulting the pages in again in the next forward.

    Installs a forward pre-hook on every block (a module whose class, or a base class, is named in the model's
    ``_no_split_modules``, the unit Hugging Face and FSDP wrap); in a forward with grad enabled the hook puts a
    gradient hook on the block's input ``hidden_states`` tensor, which autograd calls when the block's backward is
    done. It returns ``None``, so gradients are unchanged. Forwards under ``torch.no_grad`` (log-probs, the
    reference policy) register nothing.

    Raises:
        rl_tpu.patches.record.UnsupportedVersionError: transformers outside the range its private name
            ``_no_split_modules`` was checked with (:data:`rl_tpu.patches.transformers_internals.NO_SPLIT_MODULES`).

    Attributes:
        blocks: number of blocks hooked (0: the model names no ``_no_split_modules`` block; nothing is done).
        trims: trims done so far (one per block per backward).
    """

    def __init__(self, model: torch.nn.Module):
        from rl_tpu.patches.transformers_internals import no_split_modules  # transformers' private name, recorded

        names = no_split_modules(model)
        self.trims = 0
        self._handles = []
        for m in model.modules():
            if names.intersection(c.__name__ for c in type(m).__mro__):
                self._handles.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        self.blocks = len(self._handles)

    def _trim(self, grad: torch.Tensor) -> None:
        self.trims += 1
        trim_host_heap()

    def _pre_hook(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if getattr(hidden, "requires_grad", False):  # False for every tensor made under torch.no_grad
            hidden.register_hook(self._trim)

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def freeze_long_lived_objects() -> int:
    """Collect garbage once, then move every object alive now out of the cyclic garbage collector's reach
    (``gc.freeze``); returns how many objects are frozen.

    Call once a process has built what it keeps for its whole life (imported modules, the model, the optimizer).
    A process that has imported torch, transformers and VeRL holds about half a million objects, and every full
    ``gc.collect()`` walks them all (about 0.2 s on one core). VeRL's ``empty_cache`` between phases collects
    (``verl_backend.workers.platforms``' CPU device module), several times per step. After the freeze a collection walks
    only what was created since. Frozen objects are never collected: nothing is freed that would not have been kept
    anyway, since only what is alive is frozen (Python's ``gc.freeze`` documentation).
    """
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
