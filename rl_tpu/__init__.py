"""rl-tpu core: device backends, collectives, slice topology and the native sampler.

Imports nothing else of the project. Submodules load heavy dependencies on use: ``rl_tpu.device`` imports torch
only inside its functions; ``rl_tpu.collectives`` needs torch; ``rl_tpu.sampler`` needs torch and transformers.
"""

from rl_tpu.device import BACKENDS, DeviceBackend, DeviceError, detect_backend, get_backend

__all__ = ["BACKENDS", "DeviceBackend", "DeviceError", "detect_backend", "get_backend"]
