"""Transport ``in_worker`` (route 0): the sampler lives in the worker process that owns the device (the TPU
profile's ``sampler_placement=worker``: the trainer worker, or a rollout slice's ``CheckpointEngineWorker`` fed by the
pool transports); the weights load on its device and nothing crosses a process. Every rank loads its own sampler; the
replica's leader tells the rollout server the version it now serves."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from verl_backend.weight_sync.apply import live, load
from verl_backend.weight_sync.base import ReplicaEnd, SyncReport, Transport, allow_views


class InWorker(Transport):
    """Args: ``sampler`` (this process's :class:`rl_tpu.sampler.Sampler`), ``server`` (the replica's rollout server
    actor handle on the leader, ``None`` on the other ranks)."""

    name = "in_worker"

    def __init__(self, sampler: Any, server: Any = None) -> None:
        self.sampler, self.server = sampler, server

    @classmethod
    def for_replica(cls, end: ReplicaEnd) -> InWorker:
        """This process's sampler; the server told the version on the replica's leader only."""
        return cls(end.sampler, end.server)

    def first_sync_words(self, report: SyncReport, end: ReplicaEnd) -> tuple[str, str]:
        where = "the trainer worker's" if end.colocated else "the rollout worker's own"
        return "in process", f"loaded on {where} device"

    async def send(self, weights: Iterable[tuple[str, Any]], version: int | None) -> SyncReport:
        start = time.perf_counter()
        n = self.receive(weights, version)
        if self.server is not None:
            await self.server.set_global_steps.remote(version)
        return SyncReport(
            version=version,
            transport=self.name,
            bytes=float(n),
            copied_bytes=float(n),
            seconds=time.perf_counter() - start,
        )

    def receive(self, weights: Iterable[tuple[str, Any]], version: int | None) -> int:
        """Load ``weights`` into this process's sampler (seam a), then they are live (seam b); returns the bytes."""
        if self.sampler.device.type == "cpu":  # each tensor is copied as it comes: views suffice (gloo engine)
            allow_views(weights)

        def whole(it):
            for name, t in it:
                yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

        n = load(self.sampler, whole(weights), version)
        live(self.sampler, version, written_elsewhere=False)
        return n
