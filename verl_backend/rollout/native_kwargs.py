"""The native rollout's own keys, ``actor_rollout_ref.rollout.engine_kwargs.native``, as one typed record.

VeRL gives each rollout engine a mapping of its own (``engine_kwargs.vllm``, ``engine_kwargs.sglang``); the native
rollout's is read here into a :class:`NativeEngineKwargs`, the one place its keys are named, typed and checked. The
driver checks it before Ray (:func:`verl_backend.driver.preflight.check_native_rollout`); every reader (the rollout
adapter, the sampler's builder, the weight-sync route, the memory plan) takes the record, never the raw mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

KEY = "actor_rollout_ref.rollout.engine_kwargs.native"
PLACEMENTS = ("server", "worker")
#: the sampler's CPU fast paths: ``None`` (not given) leaves the sampler's per-device default (on for the CPU)
FAST_PATHS = ("packed_prefill", "lean_decode", "packed_weights")


@dataclass(frozen=True)
class NativeEngineKwargs:
    """The native rollout's engine keys.

    Attributes:
        sampler_placement: ``server`` (the rollout server process holds an inference copy of the weights) or
            ``worker`` (each trainer worker samples on its own device: the TPU profile, a worker per chip).
        packed_prefill, lean_decode, packed_weights: the sampler's CPU fast paths
            (:class:`rl_tpu.sampler.Sampler`); ``None`` leaves the sampler's per-device default. The TPU profile sets
            all three ``false`` (the bucketed, padded sampler).
    """

    sampler_placement: str = "server"
    packed_prefill: bool | None = None
    lean_decode: bool | None = None
    packed_weights: bool | None = None

    def fast_paths(self) -> dict[str, bool]:
        """The fast paths the job fixes, ``{name: bool}`` (those left out are not in it)."""
        return {k: getattr(self, k) for k in FAST_PATHS if getattr(self, k) is not None}


def native_engine_kwargs(rollout_config: Any) -> NativeEngineKwargs:
    """Read ``engine_kwargs.native`` of ``rollout_config`` (VeRL's rollout section: an OmegaConf node, a dict or
    VeRL's ``RolloutConfig``); a missing mapping gives the defaults.

    Raises:
        ValueError: the value is not a mapping, a key is not one of :class:`NativeEngineKwargs`' fields, the placement
            is not one of :data:`PLACEMENTS`, or a fast path is not true or false; the message names the key.
    """
    kwargs = (
        rollout_config.get("engine_kwargs", None)
        if isinstance(rollout_config, dict)
        else getattr(rollout_config, "engine_kwargs", None)
    )
    native = (kwargs or {}).get("native", None) if hasattr(kwargs or {}, "get") else None
    if native is None:
        return NativeEngineKwargs()
    if not hasattr(native, "items"):
        raise ValueError(f"{KEY}={native!r}: give a mapping, e.g. '+{KEY}={{sampler_placement:worker}}'")
    known = {f.name for f in fields(NativeEngineKwargs)}
    values = dict(native.items())
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"{KEY}.{unknown[0]}: not a key of the native rollout; its keys are {', '.join(sorted(known))}"
            f" (verl_backend/rollout/native_kwargs.py)"
        )
    placement = values.get("sampler_placement", None)
    placement = "server" if placement is None else str(placement)
    if placement not in PLACEMENTS:
        raise ValueError(f"{KEY}.sampler_placement={placement!r}: choose one of {PLACEMENTS}")
    for key in FAST_PATHS:
        value = values.get(key, None)
        if value is not None and not isinstance(value, bool):
            raise ValueError(
                f"{KEY}.{key}={value!r}: give true or false (or leave it out: on for the CPU, off elsewhere)"
            )
    return NativeEngineKwargs(sampler_placement=placement, **{k: values.get(k, None) for k in FAST_PATHS})
