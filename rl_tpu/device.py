"""Device backends: what a run needs to know about the accelerator it runs on.

One table, :data:`BACKENDS`, says for each backend (``tpu``, ``cpu``, ``cuda``) which torch device type,
``torch.distributed`` backend, ``torch.compile`` backend, Ray resource name and visible-devices variable to use.

TPU facts (TorchTPU, ``torch-tpu==0.2.0``): device ``"tpu"``, process-group backend ``"tpu_dist"``, compile backend
``"tpu"``, eager modes under ``torch.tpu.EagerMode``. With no chip, starting the TPU runtime either hangs on the cloud
metadata server or aborts the process, so a probe for a chip always runs in a child process
(:func:`tpu_chip_available`), never in the caller.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BACKENDS",
    "DeviceBackend",
    "DeviceError",
    "TPURuntimeConfig",
    "apply_tpu_runtime",
    "detect_backend",
    "freeze_long_lived_objects",
    "get_backend",
    "maybe_compile",
    "require_tpu",
    "set_num_threads",
    "torch_tpu_installed",
    "tpu_chip_available",
]



class DeviceError(ValueError):
    """A device choice that cannot work here; the message is one line naming the input and the fix."""


@dataclass(frozen=True)
class DeviceBackend:
    """How to use one kind of accelerator.

    Attributes:
        name: backend name a user types: ``"tpu"``, ``"cpu"`` or ``"cuda"``.
        torch_device: torch device type (``torch.device(torch_device)``).
        dist_backend: ``torch.distributed`` backend: ``"tpu_dist"`` (TorchTPU), ``"gloo"`` or ``"nccl"``.
        compile_backend: ``torch.compile(backend=...)`` for this device.
        ray_resource: Ray resource name that counts devices (``"TPU"``, ``"GPU"``), ``None`` for plain CPUs.
        visible_devices_env: environment variable that restricts the devices a process sees, ``None`` if none.
    """

    name: str
    torch_device: str
    dist_backend: str
    compile_backend: str
    ray_resource: str | None
    visible_devices_env: str | None


BACKENDS: dict[str, DeviceBackend] = {
    "tpu": DeviceBackend(
        name="tpu",
        torch_device="tpu",
        dist_backend="tpu_dist",
        compile_backend="tpu",
        ray_resource="TPU",
        # Ray sets TPU_VISIBLE_CHIPS for actors that ask for {"TPU": n} (ray/_private/accelerators/tpu.py).
        visible_devices_env="TPU_VISIBLE_CHIPS",
    ),
    "cpu": DeviceBackend(
        name="cpu",
        torch_device="cpu",
        dist_backend="gloo",
        compile_backend="inductor",
        ray_resource=None,
        visible_devices_env=None,
    ),
    "cuda": DeviceBackend(
        name="cuda",
        torch_device="cuda",
        dist_backend="nccl",
        compile_backend="inductor",
        ray_resource="GPU",
        visible_devices_env="CUDA_VISIBLE_DEVICES",
    ),
}


def get_backend(name: str | DeviceBackend) -> DeviceBackend:
    """Return the backend called ``name`` (case-insensitive); a :class:`DeviceBackend` is returned as is.

    Raises:
        DeviceError: ``name`` is not one of :data:`BACKENDS`.
    """
    if isinstance(name, DeviceBackend):
        return name
    key = str(name).strip().lower()
    if key not in BACKENDS:
        raise DeviceError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[key]


def detect_backend() -> DeviceBackend:
    """The backend of the accelerator torch reports in this process, ``cpu`` when there is none.

    Uses ``torch.accelerator.current_accelerator()``, which only asks registered device modules whether a device
    is present; on a machine with TorchTPU installed but no chip it returns ``None`` without starting libtpu.
    """
    import torch

    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return BACKENDS["cpu"]
    return BACKENDS.get(acc.type, BACKENDS["cpu"])


def torch_tpu_installed() -> bool:
    """Whether the ``torch_tpu`` package (TorchTPU) can be imported; does not import it."""
    return importlib.util.find_spec("torch_tpu") is not None


# Runs in a child process: any hang or abort of the TPU runtime stays there.
_PROBE = """
import torch
acc = torch.accelerator.current_accelerator()
if acc is None or acc.type != "tpu":
    print("RL_TPU_PROBE none")
else:
    torch.ones(1, device="tpu").sum().item()
    print("RL_TPU_PROBE chip", torch.accelerator.device_count())
"""


@functools.lru_cache(maxsize=None)
def tpu_chip_available(timeout_s: float = 60) -> bool:
    """Whether a TPU chip is usable here, probed in a subprocess (cached per ``timeout_s``).

    ``False`` at once when TorchTPU is not installed. Otherwise a child Python imports torch with
    ``TPU_SKIP_MDS_QUERY=1`` (so a missing chip aborts instead of waiting on the cloud metadata server), asks
    ``torch.accelerator.current_accelerator()`` and, if it names ``tpu``, allocates one tensor there. A crash,
    non-zero exit or a probe slower than ``timeout_s`` seconds means no chip. Clear the cache with
    ``tpu_chip_available.cache_clear()``.
    """
    if not torch_tpu_installed():
        return False
    env = dict(os.environ)
    env["TPU_SKIP_MDS_QUERY"] = "1"
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)  # the probe needs TorchTPU's registration
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and "RL_TPU_PROBE chip" in proc.stdout


def require_tpu() -> None:
    """Raise :class:`DeviceError` (one line: what is missing, what to do) unless a TPU chip is usable here."""
    if not torch_tpu_installed():
        raise DeviceError(
            "--backend tpu: TorchTPU is not installed and no TPU chip was found; "
            "use --backend cpu, or run on a TPU VM after `pip install rl-tpu[tpu]`"
        )
    if not tpu_chip_available():
        raise DeviceError(
            "--backend tpu: no TPU chip found on this machine (TorchTPU is installed); "
            "use --backend cpu, or run on a TPU VM"
        )


_EAGER_MODES = {
    "strict": "DEFER_NEVER",
    "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING",
    "fused": "DEFER_AND_FUSE",
}


@dataclass
class TPURuntimeConfig:
    """TorchTPU run-time settings.

    Attributes:
        eager_mode: ``"strict"`` (``EagerMode.DEFER_NEVER``, the default: each op runs when called),
            ``"debug"`` (``DEFER_NEVER_AND_LAUNCH_BLOCKING``: also waits for each op, for exact error locations) or
            ``"fused"`` (``DEFER_AND_FUSE``: ops are deferred and fused into larger programs).
        compile: wrap models with ``torch.compile(backend="tpu")``.
    """

    eager_mode: str = "strict"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.eager_mode not in _EAGER_MODES:
            raise DeviceError(
                f"tpu eager_mode {self.eager_mode!r} is not valid: choose one of {', '.join(_EAGER_MODES)}"
            )

    @property
    def eager_mode_enum_name(self) -> str:
        """Name of the ``torch.tpu.EagerMode`` member this setting maps to."""
        return _EAGER_MODES[self.eager_mode]


def apply_tpu_runtime(cfg: TPURuntimeConfig) -> None:
    """Set TorchTPU's eager mode from ``cfg`` (``torch.tpu.set_eager_mode``).

    Raises:
        DeviceError: TorchTPU is not installed or not registered with torch in this process.
    """
    import torch

    tpu = getattr(torch, "tpu", None)
    if tpu is None or not hasattr(tpu, "set_eager_mode"):
        raise DeviceError(
            "TPU runtime settings need TorchTPU: `pip install rl-tpu[tpu]` and leave TORCH_DEVICE_BACKEND_AUTOLOAD "
            "unset, or use --backend cpu"
        )
    tpu.set_eager_mode(getattr(tpu.EagerMode, cfg.eager_mode_enum_name))


def maybe_compile(module: Any, backend: DeviceBackend | str, enabled: bool) -> Any:
    """``torch.compile(module, backend=backend.compile_backend)`` when ``enabled``, else ``module`` unchanged."""
    if not enabled:
        return module
    import torch

    return torch.compile(module, backend=get_backend(backend).compile_backend)


def set_num_threads(n: int) -> int:
    """Set torch's intra-op thread count to ``n`` and return it.

    On a loaded two-core machine one thread can be several times faster than two, hence a setting (rl-tpu's job
    setting ``rl_tpu.num_threads``) rather than a constant.

    Raises:
        DeviceError: ``n`` is not a positive integer.
    """
    import torch

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DeviceError(f"num_threads={n!r} is not valid: give a positive integer number of threads")
    torch.set_num_threads(n)
    return n


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

    Attributes:
        blocks: number of blocks hooked (0: the model names no ``_no_split_modules`` block; nothing is done).
        trims: trims done so far (one per block per backward).
    """

    def __init__(self, model: torch.nn.Module):
        names = set(getattr(model, "_no_split_modules", None) or ())
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
    (``verl_backend.platforms``' CPU device module), several times per step. After the freeze a collection walks only
    what was created since. Frozen objects are never collected: nothing is freed that would not have been kept
    anyway, since only what is alive is frozen (Python's ``gc.freeze`` documentation).
    """
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
