"""VeRL platforms for devices VeRL 0.9.1 does not support: ``cpu`` (gloo) and ``tpu`` (TorchTPU).

VeRL reaches its device through ``verl.plugin.platform.get_platform()`` and, for many calls, through
``get_torch_device()`` (the platform's ``device_module``), calling ``torch.cuda``-style functions on it
(``empty_cache``, ``manual_seed``, ``memory_allocated``, ``mem_get_info``, ``get_rng_state`` ...). ``torch.cpu``
has few of these, so each platform returns a :class:`DeviceModule` that forwards to the real module and fills
the gaps with host-memory or no-op equivalents.

Ray resources: VeRL asks each worker for ``1 / max_colocate_count`` of a device. Ray refuses fractional TPU
requests, and CPU is not a custom resource, so :meth:`ray_resource_options` is overridden: whole chips on TPU,
a CPU share on CPU.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from rl_tpu.device import get_backend
from verl_backend.host_memory.heap import trim_host_heap


class DeviceModule:
    """A ``torch.cuda``-shaped facade over ``torch.cpu`` / ``torch.tpu`` for VeRL's device-agnostic calls.

    Attributes not defined here are looked up on the wrapped module; memory figures are host RSS (bytes) on
    CPU, where there is no device memory to report.
    """

    def __init__(self, base: ModuleType | None, device_type: str):
        self._base = base
        self._device_type = device_type
        self._peak = 0

    def __getattr__(self, name: str) -> Any:
        if self._base is not None and hasattr(self._base, name):
            return getattr(self._base, name)
        raise AttributeError(f"torch.{self._device_type} has no attribute {name!r} (rl-tpu DeviceModule)")

    # -- device selection -------------------------------------------------
    def is_available(self) -> bool:
        if self._device_type == "cpu":
            return True
        return bool(self._base is not None and self._base.is_available())

    def current_device(self) -> int:
        if self._device_type == "cpu":
            return 0
        return int(self._base.current_device())

    def device_count(self) -> int:
        if self._device_type == "cpu":
            return 1
        return int(self._base.device_count())

    def set_device(self, index: int) -> None:
        if self._device_type != "cpu" and self._base is not None and hasattr(self._base, "set_device"):
            self._base.set_device(index)

    def synchronize(self, device: Any = None) -> None:
        if self._base is not None and hasattr(self._base, "synchronize"):
            self._base.synchronize()

    def get_device_name(self, device: Any = None) -> str:
        return self._device_type

    # -- RNG ------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._device_type == "cpu" or not hasattr(self._base, "manual_seed"):
            torch.manual_seed(seed)
        else:
            self._base.manual_seed(seed)

    manual_seed_all = manual_seed

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        if self._device_type != "cpu" and hasattr(self._base, "get_rng_state"):
            return self._base.get_rng_state()
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        if self._device_type != "cpu" and hasattr(self._base, "set_rng_state"):
            self._base.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    # -- memory (bytes) --------------------------------------------------------
    def _rss(self) -> int:
        import psutil

        rss = psutil.Process().memory_info().rss
        self._peak = max(self._peak, rss)
        return rss

    def empty_cache(self) -> None:
        """On an accelerator its allocator's ``empty_cache``. On CPU: collect garbage, then hand the heap's free
        pages back to the OS (glibc ``malloc_trim``). VeRL calls this between phases (rollout, log-probs,
        update); without the trim, glibc keeps the freed activations of one phase and the next phase's
        allocations fragment around them, so the trainer's RSS ratchets up step after step."""
        if self._device_type != "cpu" and hasattr(self._base, "empty_cache"):
            self._base.empty_cache()
        else:
            gc.collect()
            trim_host_heap()

    def memory_allocated(self, device: Any = None) -> int:
        if self._device_type != "cpu" and hasattr(self._base, "memory_allocated"):
            return self._base.memory_allocated()
        return self._rss()

    memory_reserved = memory_allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        if self._device_type != "cpu" and hasattr(self._base, "max_memory_allocated"):
            return self._base.max_memory_allocated()
        self._rss()
        return self._peak

    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        if self._device_type != "cpu" and hasattr(self._base, "reset_peak_memory_stats"):
            self._base.reset_peak_memory_stats()
        self._peak = 0

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """``(free_bytes, total_bytes)``; host memory on CPU."""
        if self._device_type != "cpu" and hasattr(self._base, "mem_get_info"):
            return self._base.mem_get_info()
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)


def tpu_runtime_from_settings(eager_mode: str):
    """:class:`rl_tpu.device.TPURuntimeConfig` with ``eager_mode`` (the job's ``rl_tpu.tpu_eager_mode``, handed down
    by the platform's ``set_device``: strict, debug or fused).

    Raises:
        rl_tpu.device.DeviceError: an eager mode other than strict / debug / fused.
    """
    from rl_tpu.device import TPURuntimeConfig

    return TPURuntimeConfig(eager_mode=eager_mode)


class _RlTpuPlatform(PlatformBase):
    """Shared parts of the ``cpu`` and ``tpu`` platforms; ``_backend`` names the rl_tpu device backend."""

    _backend = "cpu"

    @property
    def _dev(self):
        return get_backend(self._backend)

    @property
    def device_name(self) -> str:
        return self._dev.torch_device

    @property
    def device_module(self) -> DeviceModule:
        if not hasattr(self, "_module"):
            self._module = DeviceModule(getattr(torch, self._dev.torch_device, None), self._dev.torch_device)
        return self._module

    def current_device(self) -> int:
        return self.device_module.current_device()

    def device_count(self) -> int:
        return self.device_module.device_count()

    def set_device(self, device_index: int) -> None:
        self.device_module.set_device(device_index)

    def synchronize(self, device_index: Optional[int] = None) -> None:
        self.device_module.synchronize()

    def manual_seed(self, seed: int) -> None:
        self.device_module.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.device_module.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None  # no caching allocator to tune on CPU; TorchTPU manages HBM itself

    def empty_cache(self) -> None:
        self.device_module.empty_cache()

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return self._dev.dist_backend

    @contextmanager
    def nvtx_range(self, msg: str):
        with torch.profiler.record_function(msg):
            yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(_RlTpuPlatform):
    """Plain CPUs with gloo collectives: VeRL's trainer on a laptop or a CPU-only CI machine.

    Each worker process is one "device". Ray accounts for it as a CPU share: the placement-group bundle of a
    worker is ``{"CPU": 1}`` and the worker asks ``num_cpus=1/max_colocate_count`` of it.
    """

    _backend = "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    def is_available(self) -> bool:
        return True

    def current_device(self):  # type: ignore[override]
        """``"cpu"``: VeRL uses this as ``tensor.to(get_device_id())`` / ``device=get_device_id()``, where an
        integer would mean an accelerator index and raise "Cannot access accelerator device"."""
        return "cpu"

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: CPU is chosen explicitly (VERL_PLATFORM=cpu, set by `verl train --backend cpu`).
        return False

    def visible_devices_envvar(self) -> str:
        return "RL_TPU_VISIBLE_CPUS"

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []


@PlatformRegistry.register(platform="tpu")
class PlatformTPU(_RlTpuPlatform):
    """Google TPU chips through TorchTPU (``torch.tpu``, device ``"tpu"``, collectives ``tpu_dist``).

    Workers hold whole chips: Ray's TPU accelerator manager refuses fractional ``{"TPU": x}`` requests, so
    every worker asks for ``{"TPU": 1}`` and VeRL's colocated roles share that process (one process per chip).
    """

    _backend = "tpu"

    @property
    def vendor_name(self) -> str:
        return "google"

    def is_available(self) -> bool:
        acc = torch.accelerator.current_accelerator()
        return acc is not None and acc.type == "tpu"

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Only what torch already registered: never start libtpu here (it hangs without a chip).
        return self.is_available()

    def visible_devices_envvar(self) -> str:
        return self._dev.visible_devices_env

    def set_device(self, device_index: int) -> None:
        """Select the chip, applying the TorchTPU eager mode of ``rl_tpu.tpu_eager_mode`` once per process
        (``verl train --tpu-eager-mode strict|debug|fused``; see :class:`rl_tpu.device.TPURuntimeConfig`).

        The first call is where the platform reads the job's settings record, once per process
        (:func:`verl_backend.settings.current`), for ``rl_tpu.tpu_eager_mode``.

        Raises:
            verl_backend.settings.SettingsMissingError: this process was not started by a ``verl train`` job.
            rl_tpu.device.DeviceError: an eager mode other than strict / debug / fused.
        """
        if not getattr(self, "_runtime_applied", False):
            from rl_tpu.device import apply_tpu_runtime
            from verl_backend.settings import current

            apply_tpu_runtime(tpu_runtime_from_settings(current().tpu_eager_mode))  # the one read of the record
            self._runtime_applied = True
        super().set_device(device_index)

    def ray_resource_name(self) -> str:
        return "TPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        chips = max(1, int(round(num_gpus))) if num_gpus >= 1 else 1
        return {"resources": {"TPU": chips}}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"]

    def rollout_env_vars(self) -> dict[str, str]:
        return {"TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")}
