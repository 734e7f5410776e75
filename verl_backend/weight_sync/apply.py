"""The rollout side's two seams: where a received weight stream enters a sampler, and the moment right after the new
weights are live. Every transport funnels into them:

- :func:`load` (seam a) — the one place a received ``(name, tensor)`` stream enters a sampler's weights:
  :meth:`verl_backend.rollout.server.NativeRolloutServer.apply` (object store; the pool transports when the sampler
  is on the server) and :class:`verl_backend.weight_sync.in_worker.InWorker` (in-worker sampler: the pool
  transports' receivers on a rollout slice, and the colocated TPU sampler) call it. The shared-memory transport
  writes the stream into the server's mapped file from the sender's process, and passes it through
  :func:`received` first, the same hook; ``trainer_memory`` moves no stream (the rollout computes on the trainer's
  own parameters). An adapter-only LoRA payload is to be turned into merged tensors in :func:`received`.
- :func:`live` (seam b) — called once per sync right after the rollout serves the new weights (the server's
  :meth:`~verl_backend.rollout.server.NativeRolloutServer.weights_live`, the in-worker load): where a verification
  of the sync runs.

Import-light (no VeRL, no Ray).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def received(named_tensors: Iterable[tuple[str, Any]], version: int | None) -> Iterable[tuple[str, Any]]:
    """Seam (a): the received stream of ``version``, as the sampler's weights will take it: an adapter-only LoRA
    payload becomes the merged adapted matrices (:func:`verl_backend.weight_sync.lora.received_stream`), anything else
    is unchanged."""
    from verl_backend.weight_sync.lora import received_stream

    return received_stream(named_tensors)


def load(sampler: Any, named_tensors: Iterable[tuple[str, Any]], version: int | None) -> int:
    """Load a received stream into ``sampler`` (:meth:`rl_tpu.sampler.Sampler.load_state_dict`, in place); returns the
    bytes received (the payload as it arrived: under adapter-only LoRA the adapter's A, B and scalings, not the merged
    matrices :func:`received` makes of them)."""
    n = 0

    def counted(it) -> Iterator[tuple[str, Any]]:
        nonlocal n
        for name, tensor in it:
            n += tensor.numel() * tensor.element_size()
            yield name, tensor

    sampler.load_state_dict(received(counted(named_tensors), version))
    return n


def live(sampler: Any, version: int | None, written_elsewhere: bool) -> None:
    """Seam (b): the rollout serves ``version``'s weights from now on. ``written_elsewhere``: another process wrote
    them (shared memory), so the sampler's packed copies are stale and are dropped (rebuilt at the next batch); a
    load in this process is seen by the tensors' version counters."""
    from verl_backend.weight_sync.lora import end_of_sync

    end_of_sync()  # an adapter-only sync cut short is refused here, naming the matrix
    if written_elsewhere and sampler is not None:
        sampler.weights_changed()
