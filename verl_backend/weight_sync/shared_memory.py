"""Transport ``shared_memory`` (route 2): the rollout server keeps its own weights in a shared-memory file on this host
(:class:`rl_tpu.shared_weights.SharedWeights`); the trainer's leader maps it (:class:`SharedWeightsWriter`) and copies
each tensor into its slot between the server's ``begin_weight_update`` and ``end_weight_update``: one memory copy."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from verl_backend.weight_sync.apply import received
from verl_backend.weight_sync.base import ReplicaEnd, SyncReport, Transport, allow_views, full_cpu


class SharedMemory(Transport):
    """Args: ``server`` (the rollout server actor handle), ``writer`` (its weights, mapped here)."""

    name = "shared_memory"

    def __init__(self, server: Any = None, writer: Any = None) -> None:
        self.server, self.writer = server, writer

    @classmethod
    def for_replica(cls, end: ReplicaEnd) -> SharedMemory:
        return cls(end.server, end.writer)

    def describe(self) -> str:
        return "shared memory"

    async def send(self, weights: Iterable[tuple[str, Any]], version: int | None) -> SyncReport:
        start = time.perf_counter()
        allow_views(weights)  # the writer copies each tensor into its slot as it comes
        await self.server.begin_weight_update.remote()
        try:  # seam (a) runs here: the stream is written into the rollout's weights from this process
            written, sent = self.writer.write(received(full_cpu(weights), version))
        except BaseException:
            try:  # resume the server; its own complaint (a half-written model) is not the cause
                await self.server.end_weight_update.remote([], version)
            except Exception:
                pass
            raise
        await self.server.end_weight_update.remote(written, version)  # raises if a released model is partial
        return SyncReport(
            version=version,
            transport=self.name,
            bytes=float(sent),
            copied_bytes=float(sent),
            seconds=time.perf_counter() - start,
        )

    def receive(self, server: Any, written: list[int], version: int | None) -> None:
        """Rollout side (the server's ``end_weight_update``): the slots ``written`` are checked (a released model
        must be whole again), then the weights are live."""
        if server.shared is not None:
            server.shared.mark_written(written)
        server.weights_live(version, written_elsewhere=True)
