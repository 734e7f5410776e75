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

__all__ = [
    "BACKENDS",
    "DeviceBackend",
    "DeviceError",
    "TPURuntimeConfig",
    "apply_tpu_runtime",
    "detect_backend",
    "get_backend",
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
