"""Weight sync between pools: the trainer's weights to rollout replicas on another slice, without NCCL.

When the rollout runs in a pool of its own (VeRL's standalone replicas: ``trainer_mode=separate_async``, a rollout
slice), VeRL's :class:`~verl.checkpoint_engine.base.CheckpointEngineManager` drives a checkpoint engine on both
sides for every sync: ``prepare`` on each worker, ``build_topology``, ``init_process_group``, then ``send_weights``
on every trainer rank and ``receive_weights`` on every rollout worker, then ``finalize``.
:class:`GlooCheckpointEngine` (``checkpoint_engine.backend=gloo``) does this over a ``gloo`` process group of its own
(host network: DCN between TPU slices; no NCCL, no RDMA):

- one source: trainer rank 0 is rank 0 of the group; every other trainer rank only walks the weight generator
  (producing each tensor is collective over the trainer's FSDP group) and sends nothing;
- bucketed and streamed: tensors are cut into chunks of at most ``bucket_size`` bytes
  (:func:`verl.checkpoint_engine.base.split_weight_chunks`) and each full bucket is broadcast as soon as it is
  packed: a JSON header (names, shapes, dtypes, offsets), then the bytes. Memory on the source: one bucket buffer
  beside the tensor the generator made; on a receiver: the bucket it is reading (a fresh buffer per bucket, so a
  consumer may keep the yielded views), and a tensor larger than a bucket while its chunks arrive
  (:func:`~verl.checkpoint_engine.base.merge_weight_chunks`);
- versioned: each sync carries the trainer step (``global_steps``), checked on every receiver;
- nobody waits for the timeout on a fault: a receiver whose consumer raises or stops early drains the rest of the
  stream when it is closed (the native adapter closes it, raised or not), and a source whose weight export raises
  sends an abort header, so every receiver raises :class:`PoolSyncError` in one line; each chunk starts at a
  multiple of 64 bytes in its bucket, so a float32 tensor after an odd-length bf16 one is still a legal view;
- the group is made for one sync and destroyed in ``finalize``: a replica restarted between syncs joins the next one.

Same host (the CPU backend's ``separate_async``, a TPU host that holds both pools): the bytes skip gloo's TCP
loopback. In ``prepare`` the source makes a shared-memory file of two halves of ``bucket_size``
(:mod:`verl_backend.rollout.pool_shm`); each rollout worker maps it read-only if it is on the same host (boot id)
and sees the same file (a nonce). One all-reduce at the start of the sync picks the transport for the whole group:
shared memory only if every receiver mapped it, else the byte broadcast above, unchanged (never a mix). Then the
source packs each bucket into the free half and broadcasts only its header; each receiver copies the bucket out into
a fresh buffer, and a one-number all-reduce per bucket tells the source that half may be reused (packing bucket k+1
overlaps the copies of bucket k). Cost: a memory copy on each side instead of a socket, and 2 x ``bucket_size`` of
shared memory on the source while the sync runs (a new file per sync: its pages are first touched, and freed in
``finalize``); the bytes delivered are the same, and the consumer may keep what it is given, as on the broadcast
path (some do: the object-store route groups tensors into buckets before copying them, and a device copy may read
its source after it returns). ``benchmarks/bench_weight_sync.py``, SmolLM2's 538 MB in 64 MiB buckets on a 2-core
host: 0.94 s against 1.97 s by broadcast (a plain memory copy: 0.035 s; into fresh pages: 0.24 s). A consumer that
copies each tensor as it comes may opt in to read-only views of the half instead (:class:`ReceivedWeights`): 0.22 s
against 1.28 s by broadcast in another run.

The source returns the sync's figures (bytes, buckets, seconds, and ``weight_sync/pool_shared_memory`` 1 or 0),
which VeRL merges into the step's metrics; its :class:`~verl_backend.weight_sync.SyncReport` names the transport
(``pool_shared_memory`` or ``pool_broadcast``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Generator, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    split_weight_chunks,
)

from verl_backend import weight_sync
from verl_backend.rollout.inworker import InWorkerGenerate
from verl_backend.rollout.pool_shm import BucketFile, BucketMapping, map_bucket_file
from verl_backend.rollout.pool_stream import (
    PoolSyncError,
    ReceivedWeights,
    merge_chunks,
)

__all__ = ["GlooCheckpointEngine", "PoolSyncError", "ReceivedWeights"]

logger = logging.getLogger(__name__)

_HEADER = 3  # int64: payload bytes, JSON bytes, 1 on the last bucket (_ABORTED: the source stopped; no bytes follow)
_ABORTED = -1
_ALIGN = 64  # bytes: each chunk starts at a multiple, so a receiver's ``.view(dtype)`` of it is legal for any dtype
_TOLD: set[str] = set()  # reasons a receiver could not use shared memory, logged once per process


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PoolSyncError(f"weight stream names dtype {name!r}, which this torch does not have")
    return dtype


@CheckpointEngineRegistry.register("gloo")
class GlooCheckpointEngine(InWorkerGenerate, CheckpointEngine):
    """VeRL checkpoint engine ``gloo``: one trainer rank broadcasts bucketed weights to every rollout worker
    (through a shared-memory file when all of them are on its host: module docstring). With
    ``sampler_placement=worker`` (the TPU profile) its rollout workers also sample, on their own chips
    (:class:`verl_backend.rollout.inworker.InWorkerGenerate`).

    Args:
        bucket_size: bytes per bucket (VeRL's ``checkpoint_engine.update_weights_bucket_megabytes`` << 20).
        is_master: this is trainer rank 0 (VeRL passes it on the trainer side; rollout workers get ``False``).
        timeout_s: seconds a collective of the group may wait for its peers before it raises.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0, **_: Any) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = timedelta(seconds=timeout_s)
        self.rank: int | None = None
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._file: BucketFile | None = None  # source: this sync's shared-memory buckets
        self._mapping: BucketMapping | None = None  # receiver: the source's file, mapped read-only
        self._shared = False  # this sync's transport: shared memory (True) or the byte broadcast
        self.last_report: weight_sync.SyncReport | None = None

    # -- set-up, once per sync ---------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """On trainer rank 0, start the group's store on a free port and make the sync's shared-memory file;
        returns ``{"host", "port", "shm"}`` there (``shm``: :meth:`BucketFile.handle`, ``None`` if the platform
        cannot make one), ``{}`` elsewhere."""
        if not self.is_master:
            return {}
        self._close_shared()  # a sync that failed before finalize
        host = _node_ip()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        try:
            self._file = BucketFile(self.bucket_size)
        except OSError as exc:
            logger.info("weight sync: no shared-memory file (%s); buckets go over gloo", exc)
        return {"host": host, "port": self._store.port, "shm": self._file.handle() if self._file else None}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Trainer rank 0 is the group's rank 0, the rollout workers ranks 1..N, other trainer ranks -1 (outside).

        Raises:
            ValueError: trainer rank 0 did not start the store (``is_master`` was not set on it).
        """
        master = metadata[0]
        if not master.get("port"):
            raise ValueError("checkpoint_engine.backend=gloo: trainer rank 0 did not start the weight-sync store "
                             "(is_master not set on it)")
        world = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict) -> None:
        """Join the sync's gloo group (ranks < 0 stay out); a rollout worker also maps the source's shared-memory
        file if it can (see :func:`~verl_backend.rollout.pool_shm.map_bucket_file`)."""
        self.rank = rank
        if rank < 0:
            return
        if rank > 0:
            self._close_shared()
            self._mapping, why = map_bucket_file(master.get("shm"))
            if self._mapping is None and why not in _TOLD:
                _TOLD.add(why)
                logger.info("weight sync: buckets come over gloo, not shared memory: %s", why)
        store = self._store if rank == 0 else dist.TCPStore(master["host"], master["port"], is_master=False,
                                                             timeout=self.timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("rl_tpu_pool_sync", store), rank, world_size,
                                           self.timeout)

    def finalize(self) -> None:
        """Drop the group, the store and the shared-memory file or mapping (the next sync builds new ones)."""
        self._close_shared()
        self.group, self._store, self.rank = None, None, None

    def _close_shared(self) -> None:
        for held in (self._file, self._mapping):
            if held is not None:
                held.close()
        self._file, self._mapping, self._shared = None, None, False

    # -- the sync -------------------------------------------------------------------------------------------------------
    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def _all_min(self, flag: int) -> int:
        tensor = torch.tensor([flag], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([tensor], opts).wait()
        return int(tensor)

    def _choose_transport(self, can_map: bool) -> None:
        """The one collective that picks shared memory (every rank could use the file) or the byte broadcast."""
        self._shared = bool(self._all_min(int(can_map)))

    def _send_bucket(self, buffer: torch.Tensor, length: int, metas: list[dict], last: bool, index: int) -> None:
        """Bucket ``index``: header, JSON, then the bytes (broadcast) or nothing (shared memory: the bytes are in
        half ``index % 2``; the receivers' copy of bucket ``index - 1`` is awaited, so its half may be reused)."""
        header = json.dumps(metas).encode()
        self._broadcast(torch.tensor([length, len(header), int(last)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if not self._shared:
            if length:
                self._broadcast(buffer[:length])
            return
        if index:
            self._all_min(1)  # every receiver has copied bucket index - 1
        if last:
            self._all_min(1)  # ... and this one: the sync is done when the source returns

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None):
        """Broadcast ``weights`` (``(name, tensor)`` pairs, any device, DTensors gathered) from the source rank.

        Every trainer rank must call it with its own generator: producing a tensor is collective over the trainer.
        Returns the source's figures (``weight_sync/pool_*``: bytes, buckets, seconds, and ``pool_shared_memory``
        1.0 if the bytes went through the shared-memory file, 0.0 if broadcast) for VeRL's step metrics; ``{}`` on
        the other ranks.

        Raises:
            PoolSyncError: called before :meth:`init_process_group`.
            Exception: what the weight generator raised (the receivers are told first, and raise PoolSyncError).
        """
        start = time.perf_counter()
        if self.rank is None:
            raise PoolSyncError("checkpoint_engine gloo: send_weights before init_process_group")

        def gathered():
            for name, tensor in weights:
                yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

        if self.rank != 0:
            for _ in gathered():
                pass
            return {}
        self._broadcast(torch.tensor([-1 if global_steps is None else int(global_steps)], dtype=torch.int64))
        self._choose_transport(self._file is not None)
        halves = (self._file.half(0), self._file.half(1)) if self._shared else None
        buffer = halves[0] if halves else torch.empty(self.bucket_size, dtype=torch.uint8)
        metas, offset, total, buckets, sending = [], 0, 0, 0, False
        try:
            async for meta, chunk in split_weight_chunks(gathered(), self.bucket_size):
                # after an odd-sized bf16 tensor, a float32 one starts aligned (never past the bucket's end)
                offset = min(-(-offset // _ALIGN) * _ALIGN, self.bucket_size)
                if offset + meta.chunk_size > self.bucket_size:
                    sending = True
                    self._send_bucket(buffer, offset, metas, last=False, index=buckets)
                    metas, offset, buckets, sending = [], 0, buckets + 1, False
                    buffer = halves[buckets % 2] if halves else buffer
                buffer[offset:offset + meta.chunk_size].copy_(chunk.detach().reshape(-1).to("cpu"))
                metas.append({"name": meta.name, "shape": list(meta.shape), "dtype": str(meta.dtype),
                              "chunk_offset": meta.chunk_offset, "chunk_size": meta.chunk_size, "offset": offset})
                offset += meta.chunk_size
                total += meta.chunk_size
        except Exception:  # the weight export failed: tell the receivers, so they raise instead of waiting timeout_s
            if not sending:  # (a failed collective leaves the group unusable: nothing more is sent on it)
                self._broadcast(torch.tensor([0, 0, _ABORTED], dtype=torch.int64))
            raise
        self._send_bucket(buffer, offset, metas, last=True, index=buckets)
        del buffer, halves  # views of the file: finalize unmaps it
        seconds = time.perf_counter() - start
        transport = "pool_shared_memory" if self._shared else "pool_broadcast"
        self.last_report = weight_sync.SyncReport(version=global_steps, transport=transport, bytes=float(total),
                                                  copied_bytes=float(total), seconds=seconds, buckets=buckets + 1)
        logger.info("weight sync %s: %.1f MiB in %d buckets of %d MiB to %d rollout workers by %s, %.2f s",
                    global_steps, total / 2**20, buckets + 1, self.bucket_size >> 20, self.group.size() - 1,
                    transport, seconds)
        return {"weight_sync/pool_bytes": float(total), "weight_sync/pool_buckets": float(buckets + 1),
                "weight_sync/pool_seconds": seconds, "weight_sync/pool_shared_memory": float(self._shared)}

    def _chunks(self, keep: bool = True, views: bool = False,
                control: dict | None = None) -> Generator[tuple[TensorMeta, torch.Tensor]]:
        """The stream's chunks, bucket by bucket (``keep=False``, or ``control["keep"]`` set false while iterating:
        drained, the shared buckets not even copied; ``views``: chunks of the shared file's half itself, not of a
        copy).

        Raises:
            PoolSyncError: the source stopped mid-stream (its weight export raised; the cause is in its log).
        """
        control = {"keep": keep} if control is None else control
        for index in itertools.count():
            keep = control["keep"]
            header = torch.zeros(_HEADER, dtype=torch.int64)
            self._broadcast(header)
            length, meta_len, last = (int(x) for x in header)
            if last == _ABORTED:
                raise PoolSyncError(f"weight sync: the trainer's weight export stopped after {index} buckets (the "
                                    "cause is in the trainer's log)")
            meta_bytes = torch.zeros(meta_len, dtype=torch.uint8)
            self._broadcast(meta_bytes)
            if not self._shared:
                buffer = torch.empty(length, dtype=torch.uint8)  # fresh per bucket: the consumer may keep its views
                if length:
                    self._broadcast(buffer)
            else:
                if index:
                    self._all_min(1)  # the consumer is done with bucket index - 1: the source may reuse its half
                read = self._mapping.view if views else self._mapping.copy_out
                buffer = read(index % 2, length) if keep else torch.empty(0, dtype=torch.uint8)
            for m in json.loads(meta_bytes.numpy().tobytes()) if keep else ():
                if not control["keep"]:  # the consumer stopped mid-bucket: the rest is drained
                    break
                meta = TensorMeta(name=m["name"], shape=torch.Size(m["shape"]), dtype=_dtype(m["dtype"]),
                                  chunk_offset=m["chunk_offset"], chunk_size=m["chunk_size"], offset=m["offset"])
                yield meta, buffer[meta.offset:meta.offset + meta.chunk_size]
            if last:
                if self._shared:
                    self._all_min(1)  # the consumer is done with the last bucket: the sync ends for the source
                return

    def receive_weights(self, global_steps: int | None = None) -> ReceivedWeights:
        """Iterate the result for ``(name, tensor)`` (CPU) as buckets arrive; a tensor larger than a bucket once all
        its chunks have. Each bucket is a fresh buffer (broadcast into, or copied out of the shared-memory file), so
        the consumer may keep what it is given, unless it called :meth:`ReceivedWeights.allow_views` first.

        A consumer that raises or stops early leaves no one waiting once it calls :meth:`ReceivedWeights.close`:
        the rest of the stream is drained (the native adapter does this, raised or not).

        Raises (while iterated):
            PoolSyncError: the source sends another trainer step than ``global_steps`` (raised after the stream is
                drained, so the source finishes), the source's export stopped mid-stream, or this is not a rollout
                worker's rank.
        """
        return ReceivedWeights(self, global_steps)

    def _receive(self, global_steps: int | None, views: bool,
                 keep: bool = True) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The stream a rollout worker iterates (``keep=False``: the whole sync drained, nothing yielded)."""
        if self.rank is None or self.rank <= 0:
            raise PoolSyncError("checkpoint_engine gloo: receive_weights on a rank that is not a rollout worker")
        version = torch.zeros(1, dtype=torch.int64)
        self._broadcast(version)
        self._choose_transport(self._mapping is not None)
        sent = None if int(version) < 0 else int(version)
        if global_steps is not None and sent is not None and sent != int(global_steps):
            for _ in self._chunks(keep=False):  # drained, so the source is not left waiting on this worker
                pass
            raise PoolSyncError(f"weight sync: the trainer sent step {sent}'s weights, this rollout worker expected "
                                f"step {global_steps}")
        control = {"keep": keep}
        chunks = self._chunks(views=views, control=control)
        try:
            yield from merge_chunks(chunks, self.bucket_size)
        finally:  # the consumer raised or stopped early: drain the rest, so the source and other workers finish
            control["keep"] = False
            for _ in chunks:
                pass
