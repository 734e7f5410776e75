"""The rollout's interface for ``sampler_placement=worker``: the sampler of a worker process that owns its device,
served to the rollout server through a checkpoint engine.

On TPU a worker process owns its chip, so the rollout server (which VeRL's agent loop talks to) holds no model and
forwards each batch to the worker through VeRL's ``execute_checkpoint_engine`` actor method. The worker's checkpoint
engine answers with :meth:`InWorkerGenerate.native_generate`: the ``native`` engine (the trainer worker,
:mod:`verl_backend.rollout.inworker`) and the ``gloo`` engine between pools (a rollout slice's
``CheckpointEngineWorker``, :mod:`verl_backend.weight_sync.gloo_engine`). The rollout's adapter registers the sampler
and how it samples (:func:`serve_worker_sampler`) when it builds it.

This module sits below both the rollout and the weight sync (it imports nothing of ours), so the weight-sync package
depends on this interface, not on the rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``generate(prompts, key, seeds) -> [(token ids, log-probs or None)]``: one response per prompt (see
#: :meth:`InWorkerGenerate.native_generate`)
Generate = Callable[[list[list[int]], Any, "list[int] | None"], list[tuple[list[int], "list[float] | None"]]]

_SAMPLER: Any = None  # the sampler of this worker process (its ``.device`` is named in the first batch's line)
_GENERATE: Generate | None = None


def serve_worker_sampler(sampler: Any, generate: Generate) -> None:
    """Register this worker process's sampler (an :class:`rl_tpu.sampler.Sampler`) and ``generate``, the rollout's
    way of sampling with it (its torch threads included); called by the rollout's adapter once it built the
    sampler."""
    global _SAMPLER, _GENERATE
    _SAMPLER, _GENERATE = sampler, generate


class InWorkerGenerate:
    """``native_generate`` for a checkpoint engine whose worker process holds the sampler: the trainer worker's
    (``native``, hybrid) or a standalone rollout worker's (``gloo``, VeRL's ``CheckpointEngineWorker`` on a rollout
    slice). The rollout server reaches it through the worker's ``execute_checkpoint_engine`` actor method."""

    def native_generate(
        self, prompts: list[list[int]], key, seeds: list[int] | None = None
    ) -> list[tuple[list[int], list[float] | None]]:
        """Sample one response per prompt with ``key`` (:class:`rl_tpu.sampler.SamplingParams`, built from VeRL's
        request by :func:`verl_backend.rollout.sampling.sampling_params_from_request`), each from its stream
        ``seeds`` (the rollout server's per-sample seeds). Returns ``(token ids, log-probs or None)`` per prompt.

        Raises:
            RuntimeError: no sampler in this worker (``sampler_placement`` is not ``worker``).
        """
        if _GENERATE is None:
            raise RuntimeError(
                "native_generate: this worker has no sampler; set "
                "actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement=worker"
            )
        if not getattr(self, "_said_where", False):
            self._said_where = True
            print(
                f"[rl-tpu] rollout samples in {type(self).__name__}'s worker process, on {_SAMPLER.device}", flush=True
            )
        return _GENERATE(prompts, key, seeds)
