"""``sampler_placement=worker``: the sampler runs inside the worker process that owns the device.

On TPU a worker process owns its chip (whole chips; one process per chip), so a separate rollout-server process
cannot sample on it. In this placement the :class:`~verl_backend.rollout.adapter.NativeServerAdapter` builds the
sampler in the worker process and registers it here: the trainer worker (hybrid replicas) or, on a rollout slice,
VeRL's ``CheckpointEngineWorker`` holding the chip (standalone replicas). The rollout server (which VeRL's agent loop
talks to) holds no model and forwards each batch to that worker through VeRL's own ``execute_checkpoint_engine``
actor method, served by :class:`InWorkerGenerate` on the worker's engine (:class:`NativeCheckpointEngine`, or
:class:`verl_backend.weight_sync.gloo_engine.GlooCheckpointEngine` between pools). Weight sync then loads on the device.
"""

from __future__ import annotations

from typing import Any

from verl.checkpoint_engine.base import (
    CheckpointEngineRegistry,
    ColocatedCheckpointEngine,
)

_SAMPLER: Any = None


_THREADS = 0  # torch threads it samples with (RolloutSettings.threads of the adapter that built it)


def set_worker_sampler(sampler: Any, threads: int = 0) -> None:
    """Register the sampler of this worker process and the torch threads it samples with (``threads``: the
    adapter's :attr:`verl_backend.settings.RolloutSettings.threads`; 0: the process's count); called by the
    adapter."""
    global _SAMPLER, _THREADS
    _SAMPLER, _THREADS = sampler, int(threads)


class InWorkerGenerate:
    """``native_generate`` for a checkpoint engine whose worker process holds the sampler: the trainer worker's
    (:class:`NativeCheckpointEngine`, hybrid) or a standalone rollout worker's (VeRL's ``CheckpointEngineWorker`` on a
    rollout slice, :class:`verl_backend.weight_sync.gloo_engine.GlooCheckpointEngine`). The rollout server reaches it through
    the worker's ``execute_checkpoint_engine`` actor method."""

    def native_generate(self, prompts: list[list[int]], key,
                        seeds: list[int] | None = None) -> list[tuple[list[int], list[float] | None]]:
        """Sample one response per prompt with ``key`` (:class:`rl_tpu.sampler.SamplingParams`, built from VeRL's
        request by :func:`verl_backend.rollout.sampling.sampling_params_from_request`), each from its stream
        ``seeds`` (the rollout server's per-sample seeds).

        Raises:
            RuntimeError: no sampler in this worker (``sampler_placement`` is not ``worker``).
        """
        from verl_backend.rollout.sampling import run_sampler

        if _SAMPLER is None:
            raise RuntimeError(
                "native_generate: this worker has no sampler; set "
                "actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement=worker"
            )
        if not getattr(self, "_said_where", False):
            self._said_where = True
            print(f"[rl-tpu] rollout samples in {type(self).__name__}'s worker process, on {_SAMPLER.device}",
                  flush=True)
        return run_sampler(_SAMPLER, prompts, key, seeds, threads=_THREADS)


@CheckpointEngineRegistry.register("native")
class NativeCheckpointEngine(InWorkerGenerate, ColocatedCheckpointEngine):
    """VeRL's colocated (``naive``) weight sync, plus ``native_generate`` for the in-worker sampler."""
