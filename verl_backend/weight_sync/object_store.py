"""Transport ``object_store`` (route 3): buckets through Ray's object store, to a rollout server on any host (the
route when nothing cheaper applies: another host, ``rl_tpu.shared_weights=false``, a file that cannot be mapped).

The sending loop: ``(name, tensor)`` pairs packed into buckets and handed on as they
are made, so the trainer holds one bucket at a time, not the export.

VeRL's weight export is a generator, and some of its tensors exist only while they are sent: the merged weights of a
LoRA model (:func:`verl_backend.weight_sync.lora.merged_lora_weights`), gathered ``DTensor`` s, the per-expert copies of
a mixture of experts. :func:`send_buckets` sends each bucket as soon as it is full (a tensor larger than a bucket goes
as its own bytes, not copied into a buffer), then an empty bucket marked last with the count, and keeps at most
``max_in_flight`` buckets sent and not yet loaded.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

import numpy as np
import torch

from rl_tpu.collectives import bucket_layout, iter_buckets, pack_bucket, unpack_bucket
from verl_backend.weight_sync.base import ReplicaEnd, SyncReport, Transport, full_cpu

MAX_BUCKETS_IN_FLIGHT = 2  # buckets sent and not yet loaded: the object store holds at most these

#: send(flat uint8 bytes, metadata, last, total) -> awaitable of the bytes the receiver loaded; it must take the bytes
#: before it returns (``ray.put`` copies them): the buffer is reused. ``total`` (the bucket count, the closing empty
#: one included) comes with the last bucket only, when the streamed sender knows it.
SendBucket = Callable[[np.ndarray, list, bool, "int | None"], Awaitable[int]]


def _bytes_of(bucket: list[tuple[str, torch.Tensor]], bucket_bytes: int, staging: torch.Tensor | None):
    """``(flat uint8, metadata, staging)``: a lone tensor larger than a bucket as a view of its own bytes (no copy),
    anything else packed into the reused staging buffer (made on first use, ``bucket_bytes + 1 MiB``)."""
    if len(bucket) == 1 and bucket[0][1].nbytes > bucket_bytes and bucket[0][1].is_contiguous():
        meta, _ = bucket_layout(bucket)
        return bucket[0][1].detach().reshape(-1).view(torch.uint8), meta, staging
    if sum(t.nbytes for _, t in bucket) > bucket_bytes:  # oversized and not contiguous: a buffer of its own
        flat, meta = pack_bucket(bucket)
        return flat, meta, staging
    if staging is None:
        staging = torch.empty(bucket_bytes + (1 << 20), dtype=torch.uint8)
    flat, meta = pack_bucket(bucket, out=staging)
    return flat, meta, staging


async def send_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, send: SendBucket, max_in_flight: int = 2
) -> tuple[int, int]:
    """Pack ``named_tensors`` (CPU) into buckets of at most ``bucket_bytes`` (a larger tensor gets one of its own)
    and ``send`` each, in order, as soon as it is full; then an empty bucket marked last, with the count.

    Memory: one bucket's tensors (what the export made for it), the next tensor (read to find the bucket full), the
    reused staging buffer of ``bucket_bytes + 1 MiB``, nothing more for a tensor larger than a bucket (sent as its
    own bytes).

    Returns:
        ``(bytes loaded by the receiver, buckets sent)`` (the closing empty bucket included).
    """
    pending, loaded, n, staging = [], 0, 0, None
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        if len(pending) >= max_in_flight:
            loaded += await pending.pop(0)
        flat, meta, staging = _bytes_of(bucket, bucket_bytes, staging)
        # a numpy view goes into Ray's object store zero-copy (plasma); a torch tensor is pickled, ~30x slower
        pending.append(send(flat.numpy(), meta, False, None))
        del flat, bucket
        n += 1
    pending.append(send(np.empty(0, dtype=np.uint8), [], True, n + 1))  # the end, and the count
    for p in pending:
        loaded += await p
    return loaded, n + 1


class ObjectStore(Transport):
    """Args: ``server`` (the rollout server actor handle), ``bucket_bytes``, ``max_in_flight``."""

    name = "object_store"

    def __init__(self, server=None, bucket_bytes: int = 512 << 20, max_in_flight: int = MAX_BUCKETS_IN_FLIGHT):
        self.server, self.bucket_bytes, self.max_in_flight = server, int(bucket_bytes), max_in_flight

    @classmethod
    def for_replica(cls, end: ReplicaEnd) -> ObjectStore:
        """Buckets of ``end.bucket_bytes``, at most :data:`MAX_BUCKETS_IN_FLIGHT` sent and not yet loaded."""
        return cls(end.server, end.bucket_bytes, MAX_BUCKETS_IN_FLIGHT)

    def describe(self) -> str:
        return "object store"

    def first_sync_words(self, report: SyncReport, end: ReplicaEnd) -> tuple[str, str]:
        return "object store", "" if end.shared_weights else "rl_tpu.shared_weights=false"

    async def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None) -> SyncReport:
        import ray

        start, server = time.perf_counter(), self.server

        def send(flat, meta, last, total):  # ray.put copies the staging buffer into the object store
            return server.update_weights_bucket.remote(ray.put(flat), meta, last, version, total=total)

        sent, n = await send_buckets(full_cpu(weights), self.bucket_bytes, send, self.max_in_flight)
        return SyncReport(
            version=version,
            transport=self.name,
            bytes=float(sent),
            copied_bytes=float(sent),
            seconds=time.perf_counter() - start,
            buckets=n,
        )

    def receive(self, flat, metadata: list) -> Iterable[tuple[str, torch.Tensor]]:
        """Rollout side: one bucket's ``(name, tensor)`` views (the server's ``update_weights_bucket`` hands them to
        its ``apply``)."""
        return unpack_bucket(flat, metadata)
