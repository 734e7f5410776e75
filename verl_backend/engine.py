"""The training engine for devices ``cpu`` and ``tpu``: VeRL's own FSDP2 engine, registered for them.

VeRL 0.9.1 registers ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` for ``cuda`` and ``npu`` only.
The engine itself is device-agnostic once the platform supplies the device module and the collective backend
(gloo on CPU, ``tpu_dist`` on TPU): FSDP2 ``fully_shard`` over ``init_device_mesh(<device>, ...)``. We register
subclasses for our devices rather than copying the engine.
"""

from __future__ import annotations

from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

DEVICES = ["cpu", "tpu"]


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """FSDP2 actor / reference engine on CPU (gloo) or TPU (TorchTPU)."""


@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithValueHead(FSDPEngineWithValueHead):
    """FSDP2 critic engine on CPU (gloo) or TPU (TorchTPU)."""
