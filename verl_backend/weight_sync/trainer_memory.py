"""Transport ``trainer_memory`` (route 1): the actor's parameters live in a shared-memory file
(:func:`verl_backend.workers.engine.share_fsdp_parameters`, handed over with :func:`verl_backend.weight_sync.hand_over`)
and the rollout server on the same host computes on that file, mapped read-only (its ``attach_trainer_weights``). The
optimizer step is the sync: :meth:`TrainerMemory.send` holds generation, checks each tensor is its slot (copying one
that is not), and tags the new version. The default CPU job's route: zero copy."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from verl_backend.weight_sync.base import ReplicaEnd, SyncReport, Transport, full_cpu


class TrainerMemory(Transport):
    """Args: ``server`` (the rollout server actor handle), ``attached`` (the trainer's
    :class:`rl_tpu.shared_weights.SharedWeights` the server computes on)."""

    name = "trainer_memory"

    def __init__(self, server: Any = None, attached: Any = None) -> None:
        self.server, self.attached = server, attached

    @classmethod
    def for_replica(cls, end: ReplicaEnd) -> TrainerMemory:
        return cls(end.server, end.attached)

    def describe(self) -> str:
        return "shared memory"

    def first_sync_words(self, report: SyncReport, end: ReplicaEnd) -> tuple[str, str]:
        return "shared memory", (
            f"in place: the rollout computes on the trainer's parameters, {report.copied_bytes / 1e6:.0f} MB copied"
        )

    async def send(self, weights: Iterable[tuple[str, Any]], version: int | None) -> SyncReport:
        start = time.perf_counter()
        await self.server.begin_weight_update.remote()
        try:
            in_place, copied = self.attached.publish(full_cpu(weights))
        finally:
            await self.server.end_weight_update.remote([], version)
        return SyncReport(
            version=version,
            transport=self.name,
            bytes=float(in_place + copied),
            copied_bytes=float(copied),
            seconds=time.perf_counter() - start,
        )

    def receive(self, server: Any, version: int | None) -> None:
        """Rollout side (the server's ``end_weight_update``): nothing arrived but the version; the weights written in
        another process are live."""
        server.weights_live(version, written_elsewhere=True)
