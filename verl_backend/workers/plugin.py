"""rl-tpu's VeRL plugin, loaded by ``import verl`` through the ``verl.plugins`` entry-point group.

It registers, in every process that imports VeRL (driver, TaskRunner, trainer workers, rollout servers):

- the ``cpu`` and ``tpu`` platforms (:mod:`verl_backend.workers.platforms`);
- the FSDP2 training engine for devices ``cpu`` and ``tpu`` (:mod:`verl_backend.workers.engine`);
- the ``native`` rollout (replica + in-worker adapter, :mod:`verl_backend.rollout`; the adapter's entry in VeRL's
  private rollout table is one of the patches);
- the checkpoint engines ``native`` (the in-worker sampler's weight sync, :mod:`verl_backend.rollout.inworker`)
  and ``gloo`` (weight sync between a trainer pool and a rollout pool, :mod:`verl_backend.weight_sync.gloo_engine`);
- the narrow patches of VeRL 0.9.1 and TransferQueue in :mod:`verl_backend.patches`, after refusing in one line a
  version of either outside the tested range, handing them the features two of them run (the slice pools of
  :mod:`verl_backend.workers.slice_pool`, the step-boundary stop of :mod:`verl_backend.workers.preemption`);
- a filter that lets a VeRL warning repeated per sample through once per process (:class:`RepeatedWarningFilter`).

VeRL swallows plugin import errors at debug level, so failures here are logged as warnings instead.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("rl_tpu.verl_plugin")


def _register_engine(_module) -> None:
    from verl_backend.workers import engine  # noqa: F401  (registration by import)


def _register_replica(module) -> None:
    def _load_native():
        from verl_backend.rollout.replica import NativeReplica

        return NativeReplica

    module.RolloutReplicaRegistry.register("native", _load_native)


def _register_checkpoint_engine(_module) -> None:
    # registers the checkpoint engines "native" (in-worker sampler) and "gloo" (weight sync between pools)
    from verl_backend.rollout import inworker  # noqa: F401
    from verl_backend.weight_sync import gloo_engine  # noqa: F401


def _place_pools_on_slices(manager) -> None:
    # the feature run after VeRL creates its resource pools (imported when a TaskRunner first creates them)
    from verl_backend.workers.slice_pool import place_pools_on_slices

    place_pools_on_slices(manager)


def _at_step_begin(trainer) -> None:
    # the feature run at each step's start (preemption is light: signal handling only)
    from verl_backend.workers.preemption import at_step_begin

    at_step_begin(trainer)


class RepeatedWarningFilter(logging.Filter):
    """Let each distinct message of a logger through once per process; drop the repeats.

    VeRL 0.9.1's agent loop builds a Continuous Token builder for every sample it rolls out
    (``verl/experimental/agent_loop/agent_loop.py``, ``AgentLoopBase.__init__``), and for a model type it has no
    builder for (``llama``: SmolLM2) ``infer_continuous_token_model_family`` warns each time: 208 identical lines in
    the default 12-step job. The first one still says which builder is used.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


REPEATING_LOGGERS = ("verl.utils.tokenizer.continuous_token_wiring",)


def _quiet_repeated_warnings() -> None:
    for name in REPEATING_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, RepeatedWarningFilter) for f in log.filters):
            log.addFilter(RepeatedWarningFilter())


def register() -> None:
    """Register everything above with VeRL's registries (idempotent).

    The platforms are registered now (they are light). The engine, the rollout and the checkpoint engines are
    registered when the process imports the VeRL registry they belong to (post-import hooks): importing VeRL's
    FSDP engine costs ~190 MiB and ~5 s, and most VeRL processes (agent loop, reward loop, load balancer,
    TransferQueue) never need it.
    """
    import wrapt

    from verl_backend import patches

    patches.check_versions()  # before anything of an untested VeRL is touched
    # Platforms first: importing VeRL's FSDP engine resolves the platform at module level.
    from verl_backend.workers import platforms  # noqa: F401  (registration by import)

    wrapt.register_post_import_hook(_register_engine, "verl.workers.engine.fsdp.transformer_impl")
    wrapt.register_post_import_hook(_register_replica, "verl.workers.rollout.replica")
    wrapt.register_post_import_hook(_register_checkpoint_engine, "verl.checkpoint_engine.base")
    patches.apply(features={"resource_pools": _place_pools_on_slices, "step_begin": _at_step_begin})
    _quiet_repeated_warnings()


try:
    register()
except Exception as exc:  # pragma: no cover - shown to the user instead of VeRL's silent debug log
    from verl_backend.patches import UnsupportedVersionError

    if isinstance(exc, UnsupportedVersionError):
        logger.warning("rl-tpu: %s", exc)  # one line; `verl train` refuses with the same line before VeRL runs
    else:
        logger.warning("rl-tpu VeRL plugin failed to load: %s: %s", type(exc).__name__, exc)
    raise
