"""``sampler_placement=worker``: the sampler runs inside the worker process that owns the device.

On TPU a worker process owns its chip (whole chips; one process per chip), so a separate rollout-server process
cannot sample on it. In this placement the :class:`~verl_backend.rollout.adapter.NativeServerAdapter` builds the
sampler in the worker process and registers it here (:func:`set_worker_sampler`): the trainer worker (hybrid
replicas) or, on a rollout slice, VeRL's ``CheckpointEngineWorker`` holding the chip (standalone replicas). The
rollout server (which VeRL's agent loop talks to) holds no model and forwards each batch to that worker through
VeRL's own ``execute_checkpoint_engine`` actor method, served by :class:`verl_backend.worker_sampler.InWorkerGenerate`
on the worker's engine (:class:`NativeCheckpointEngine`, or
:class:`verl_backend.weight_sync.gloo_engine.GlooCheckpointEngine` between pools). Weight sync then loads on the device.
"""

from __future__ import annotations

from typing import Any

from verl.checkpoint_engine.base import (
    CheckpointEngineRegistry,
    ColocatedCheckpointEngine,
)

from verl_backend.worker_sampler import InWorkerGenerate, serve_worker_sampler


def set_worker_sampler(sampler: Any, threads: int = 0) -> None:
    """Register the sampler of this worker process and the torch threads it samples with (``threads``: the
    adapter's :attr:`verl_backend.settings.RolloutSettings.threads`; 0: the process's count); called by the
    adapter. Each batch then runs :func:`verl_backend.rollout.sampling.run_sampler` on it."""

    def generate(prompts: list[list[int]], key, seeds: list[int] | None = None):
        from verl_backend.rollout.sampling import run_sampler

        return run_sampler(sampler, prompts, key, seeds, threads=int(threads))

    serve_worker_sampler(sampler, generate)


@CheckpointEngineRegistry.register("native")
class NativeCheckpointEngine(InWorkerGenerate, ColocatedCheckpointEngine):
    """VeRL's colocated (``naive``) weight sync, plus ``native_generate`` for the in-worker sampler."""
