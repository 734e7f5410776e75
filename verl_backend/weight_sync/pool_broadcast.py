"""Transport ``pool_broadcast`` (route 4): the trainer's weights to rollout workers in a pool of their own (a rollout
slice, ``separate_async``) over the ``gloo`` checkpoint engine's group (:mod:`verl_backend.weight_sync.gloo_engine`):
host network (DCN between TPU slices), no NCCL, no RDMA.

Bucketed and streamed: tensors are cut into chunks of at most ``bucket_size`` bytes
(:func:`verl.checkpoint_engine.base.split_weight_chunks`) and each full bucket goes as soon as it is packed: a header
(payload bytes, JSON bytes, last), the JSON (names, shapes, dtypes, offsets), then the bytes broadcast from the
group's rank 0. A receiver reads each bucket into a fresh buffer (a consumer may keep the yielded views); each chunk
starts at a multiple of 64 bytes, so a float32 tensor after an odd-length bf16 one is still a legal view. A source
whose export raises sends an abort header, so every receiver raises :class:`PoolSyncError` in one line.

:class:`PoolBroadcast` holds the stream's loop; :class:`~verl_backend.weight_sync.pool_shared_memory.PoolSharedMemory`
overrides only where a bucket's bytes go.
"""

from __future__ import annotations

import itertools
import json
import pickle
import time
from collections.abc import Generator, Iterable

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import TensorMeta, split_weight_chunks

from verl_backend.weight_sync.base import SyncReport, Transport
from verl_backend.weight_sync.pool_stream import PoolSyncError

HEADER = 3  # int64: payload bytes, JSON bytes, 1 on the last bucket (ABORTED: the source stopped; no bytes follow)
ABORTED = -1
ALIGN = 64  # bytes: each chunk starts at a multiple, so a receiver's ``.view(dtype)`` of it is legal for any dtype


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PoolSyncError(f"weight stream names dtype {name!r}, which this torch does not have")
    return dtype


def broadcast(group, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from the group's rank 0."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def all_min(group, flag: int) -> int:
    """The minimum of ``flag`` over the group."""
    tensor = torch.tensor([flag], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([tensor], opts).wait()
    return int(tensor)


def send_object(group, obj) -> None:
    """Broadcast a picklable ``obj`` (``None`` too) from the group's rank 0: its length, then its bytes."""
    data = pickle.dumps(obj)
    broadcast(group, torch.tensor([len(data)], dtype=torch.int64))
    broadcast(group, torch.frombuffer(bytearray(data), dtype=torch.uint8))


def receive_object(group):
    """A receiver's side of :func:`send_object`."""
    length = torch.zeros(1, dtype=torch.int64)
    broadcast(group, length)
    data = torch.zeros(int(length), dtype=torch.uint8)
    broadcast(group, data)
    return pickle.loads(data.numpy().tobytes())


#: what a rollout worker says of a sync once its weights are live (:func:`exchange_verdict`)
VERDICTS = ("failed", "unverified", "verified", "not_serving")


def exchange_verdict(
    group, verdict: str | None = None, max_abs_diff: float = 0.0, seconds: float = 0.0
) -> tuple[dict[str, int], float, float]:
    """One collective of the whole group after a sync: every rollout worker gives its verdict (one of
    :data:`VERDICTS`; ``not_serving``: a rank that only walked the stream, its replica's leader checks), its probe's
    max |difference| and its check's seconds; the source gives ``None``. Returns, on every rank, the count of each
    verdict, the largest difference and the longest check.

    Raises:
        ValueError: ``verdict`` is not one of :data:`VERDICTS`.
    """
    counts = torch.zeros(len(VERDICTS), dtype=torch.float64)
    if verdict is not None:
        if verdict not in VERDICTS:
            raise ValueError(f"weight sync verdict {verdict!r} is not one of {VERDICTS}")
        counts[VERDICTS.index(verdict)] = 1
    figures = torch.tensor([max_abs_diff, seconds], dtype=torch.float64)
    for tensor, op in ((counts, dist.ReduceOp.SUM), (figures, dist.ReduceOp.MAX)):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        group.allreduce([tensor], opts).wait()
    return {v: int(c) for v, c in zip(VERDICTS, counts.tolist())}, float(figures[0]), float(figures[1])


class PoolBroadcast(Transport):
    """Args: ``group`` (the sync's gloo group: rank 0 the source, ranks 1.. the rollout workers), ``bucket_size``."""

    name = "pool_broadcast"

    def __init__(self, group, bucket_size: int) -> None:
        self.group, self.bucket_size = group, int(bucket_size)

    def describe(self) -> str:
        return "gloo broadcast"

    # -- where a bucket's bytes go (PoolSharedMemory overrides these) ---------------------------------------------
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The source's bucket buffers, used in turn."""
        return (torch.empty(self.bucket_size, dtype=torch.uint8),)

    def after_header(self, buffer: torch.Tensor, length: int, index: int, last: bool) -> None:
        """Source, after a bucket's header: its bytes."""
        if length:
            broadcast(self.group, buffer[:length])

    def read(self, length: int, index: int, keep: bool, views: bool) -> torch.Tensor:
        """Receiver, after a bucket's header: its bytes (a fresh buffer per bucket: the consumer may keep views)."""
        buffer = torch.empty(length, dtype=torch.uint8)
        if length:
            broadcast(self.group, buffer)
        return buffer

    def after_read(self, last: bool) -> None:
        """Receiver, once the consumer is done with the bucket."""

    # -- the stream ------------------------------------------------------------------------------------------------
    def _send_bucket(self, buffer, length: int, metas: list[dict], last: bool, index: int) -> None:
        header = json.dumps(metas).encode()
        broadcast(self.group, torch.tensor([length, len(header), int(last)], dtype=torch.int64))
        broadcast(self.group, torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.after_header(buffer, length, index, last)

    async def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None) -> SyncReport:
        """Source: stream ``weights`` (whole tensors, any device) in buckets (the version went ahead, from the
        engine). Raises what the export raised, after telling the receivers (they raise :class:`PoolSyncError`)."""
        start = time.perf_counter()
        buffers = self.buffers()
        buffer = buffers[0]
        metas, offset, total, buckets, sending = [], 0, 0, 0, False
        try:
            async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
                # after an odd-sized bf16 tensor, a float32 one starts aligned (never past the bucket's end)
                offset = min(-(-offset // ALIGN) * ALIGN, self.bucket_size)
                if offset + meta.chunk_size > self.bucket_size:
                    sending = True
                    self._send_bucket(buffer, offset, metas, last=False, index=buckets)
                    metas, offset, buckets, sending = [], 0, buckets + 1, False
                    buffer = buffers[buckets % len(buffers)]
                buffer[offset : offset + meta.chunk_size].copy_(chunk.detach().reshape(-1).to("cpu"))
                metas.append(
                    {
                        "name": meta.name,
                        "shape": list(meta.shape),
                        "dtype": str(meta.dtype),
                        "chunk_offset": meta.chunk_offset,
                        "chunk_size": meta.chunk_size,
                        "offset": offset,
                    }
                )
                offset += meta.chunk_size
                total += meta.chunk_size
        except Exception:  # the weight export failed: tell the receivers, so they raise instead of waiting timeout_s
            if not sending:  # (a failed collective leaves the group unusable: nothing more is sent on it)
                broadcast(self.group, torch.tensor([0, 0, ABORTED], dtype=torch.int64))
            raise
        self._send_bucket(buffer, offset, metas, last=True, index=buckets)
        del buffer, buffers  # views of a shared file: the engine's finalize unmaps it
        return SyncReport(
            version=version,
            transport=self.name,
            bytes=float(total),
            copied_bytes=float(total),
            seconds=time.perf_counter() - start,
            buckets=buckets + 1,
        )

    def receive(
        self, keep: bool = True, views: bool = False, control: dict | None = None
    ) -> Generator[tuple[TensorMeta, torch.Tensor], None, None]:
        """Receiver: the stream's chunks, bucket by bucket (``keep=False``, or ``control["keep"]`` set false while
        iterating: drained, the shared buckets not even copied; ``views``: chunks of the shared file's half itself).

        Raises:
            PoolSyncError: the source stopped mid-stream (its weight export raised; the cause is in its log).
        """
        control = {"keep": keep} if control is None else control
        for index in itertools.count():
            keep = control["keep"]
            header = torch.zeros(HEADER, dtype=torch.int64)
            broadcast(self.group, header)
            length, meta_len, last = (int(x) for x in header)
            if last == ABORTED:
                raise PoolSyncError(
                    f"weight sync: the trainer's weight export stopped after {index} buckets (the "
                    "cause is in the trainer's log)"
                )
            meta_bytes = torch.zeros(meta_len, dtype=torch.uint8)
            broadcast(self.group, meta_bytes)
            buffer = self.read(length, index, keep, views)
            for m in json.loads(meta_bytes.numpy().tobytes()) if keep else ():
                if not control["keep"]:  # the consumer stopped mid-bucket: the rest is drained
                    break
                meta = TensorMeta(
                    name=m["name"],
                    shape=torch.Size(m["shape"]),
                    dtype=_dtype(m["dtype"]),
                    chunk_offset=m["chunk_offset"],
                    chunk_size=m["chunk_size"],
                    offset=m["offset"],
                )
                yield meta, buffer[meta.offset : meta.offset + meta.chunk_size]
            if last:
                self.after_read(last=True)
                return


def plan_choice(file_made: bool, shared: bool, why_no_file: str) -> tuple[str, str]:
    """``(transport, because)`` of a sync between pools once the group chose (``shared``: every receiver mapped the
    source's file)."""
    if shared:
        return "pool_shared_memory", "every rollout worker mapped trainer rank 0's shared-memory file"
    if not file_made:
        return "pool_broadcast", f"trainer rank 0 made no shared-memory file ({why_no_file})"
    return "pool_broadcast", "a rollout worker could not map trainer rank 0's shared-memory file (its log says why)"


__all__ = [
    "VERDICTS",
    "PoolBroadcast",
    "PoolSyncError",
    "all_min",
    "broadcast",
    "exchange_verdict",
    "plan_choice",
    "receive_object",
    "send_object",
]
