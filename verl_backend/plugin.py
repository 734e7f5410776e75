"""rl-tpu's VeRL plugin, loaded by ``import verl`` through the ``verl.plugins`` entry-point group.

It registers, in every process that imports VeRL (driver, TaskRunner, trainer workers, rollout servers):

- the ``cpu`` and ``tpu`` platforms (:mod:`verl_backend.platforms`);
- the FSDP2 training engine for devices ``cpu`` and ``tpu`` (:mod:`verl_backend.engine`);
- the ``native`` rollout (replica + in-worker adapter, :mod:`verl_backend.rollout`);
- the ``ray_object_store`` checkpoint engine for disaggregated weight sync;
- the narrow VeRL 0.9.1 patches in :mod:`verl_backend.patches`.

VeRL swallows plugin import errors at debug level, so failures here are logged as warnings instead.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("rl_tpu.verl_plugin")


def register() -> None:
    """Register everything above with VeRL's registries (idempotent)."""
    # Platforms first: importing VeRL's FSDP engine resolves the platform at module level.
    from verl_backend import platforms  # noqa: F401  (registration by import)
    from verl_backend import engine, patches  # noqa: F401
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    rollout_base._ROLLOUT_REGISTRY[("native", "async")] = "verl_backend.rollout.adapter.NativeServerAdapter"

    def _load_native():
        from verl_backend.rollout.replica import NativeReplica

        return NativeReplica

    RolloutReplicaRegistry.register("native", _load_native)
    from verl_backend.rollout import inworker  # noqa: F401  (registers the "native" checkpoint engine)

    patches.apply()


try:
    register()
except Exception as exc:  # pragma: no cover - shown to the user instead of VeRL's silent debug log
    logger.warning("rl-tpu VeRL plugin failed to load: %s: %s", type(exc).__name__, exc)
    raise
