"""VeRL's checkpoint engine ``gloo``: weight sync between pools, the trainer's weights to rollout replicas on another
slice, without NCCL, by the two pool transports (:mod:`~verl_backend.weight_sync.pool_broadcast`,
:mod:`~verl_backend.weight_sync.pool_shared_memory`).

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
- verified: every trainer rank takes the trainer's proof (:func:`verl_backend.weight_sync.verify.take_proof`: the
  probe on its module, the stream fingerprinted at :data:`POOL_FINGERPRINT_DTYPES`), the source broadcasts it after
  the last bucket (:attr:`ReceivedWeights.proof`), and every rollout worker answers a verdict once its weights are live
  (:meth:`ReceivedWeights.report_verdict`, one all-reduce; the native adapter checks with
  :func:`~verl_backend.weight_sync.verify.check_sync`), which the source returns as ``weight_sync/verified`` and
  ``weight_sync/verify_*``;
- nobody waits for the timeout on a fault: a receiver whose consumer raises or stops early drains the rest of the
  stream when it is closed (the native adapter closes it, raised or not), and a source whose weight export raises
  sends an abort header, so every receiver raises :class:`PoolSyncError` in one line; each chunk starts at a
  multiple of 64 bytes in its bucket, so a float32 tensor after an odd-length bf16 one is still a legal view;
- the group is made for one sync and destroyed in ``finalize``: a replica restarted between syncs joins the next one.

Same host (the CPU backend's ``separate_async``, a TPU host that holds both pools): the bytes skip gloo's TCP
loopback. In ``prepare`` the source makes a shared-memory file of two halves of ``bucket_size``
(:mod:`verl_backend.weight_sync.pool_shared_memory`); each rollout worker maps it read-only if it is on the same host
(boot id) and sees the same file (a nonce). One all-reduce at the start of the sync picks the transport for the whole
group: shared memory only if every receiver mapped it, else the byte broadcast above, unchanged (never a mix). Then the
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

The plan (:func:`~verl_backend.weight_sync.route.choose_route`, shown by ``--print-config``) says which of the two a
sync should take; the collective confirms it, and the source logs ``planned X, took Y, because ...`` once per
outcome. The source returns the sync's figures, which VeRL merges into the step's metrics: the four
``weight_sync/{route,bytes,seconds,verified}`` every transport reports, and ``weight_sync/pool_*`` (bytes, buckets,
seconds, ``pool_shared_memory`` 1 or 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from verl_backend.settings import SettingsMissingError, WeightSyncSettings, current, weight_sync_settings
from verl_backend.weight_sync.base import SyncReport
from verl_backend.weight_sync.pool_broadcast import (
    PoolBroadcast,
    all_min,
    broadcast,
    exchange_verdict,
    plan_choice,
    receive_object,
    send_object,
)
from verl_backend.weight_sync.pool_shared_memory import (
    BucketFile,
    BucketMapping,
    PoolSharedMemory,
    map_bucket_file,
)
from verl_backend.weight_sync.pool_stream import PoolSyncError, ReceivedWeights, merge_chunks
from verl_backend.weight_sync.route import SyncFacts, choose_route
from verl_backend.worker_sampler import InWorkerGenerate

__all__ = ["GlooCheckpointEngine", "PoolSyncError", "ReceivedWeights"]

logger = logging.getLogger(__name__)

#: the dtypes the source fingerprints the stream at for the rollout's check: it does not know the rollout pool's
#: ``actor_rollout_ref.rollout.dtype``; the receiver compares the set of its own (:meth:`SyncProof.fingerprints_for`)
POOL_FINGERPRINT_DTYPES = ("float32", "bfloat16", "float16")

_TOLD: set[str] = set()  # lines logged once per process (why a receiver could not use shared memory; the route)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"


@CheckpointEngineRegistry.register("gloo")
class GlooCheckpointEngine(InWorkerGenerate, CheckpointEngine):
    """VeRL checkpoint engine ``gloo``: one trainer rank broadcasts bucketed weights to every rollout worker
    (through a shared-memory file when all of them are on its host: module docstring). With
    ``sampler_placement=worker`` (the TPU profile) its rollout workers also sample, on their own chips
    (:class:`verl_backend.worker_sampler.InWorkerGenerate`, the rollout's interface).

    Args:
        bucket_size: bytes per bucket (VeRL's ``checkpoint_engine.update_weights_bucket_megabytes`` << 20).
        is_master: this is trainer rank 0 (VeRL passes it on the trainer side; rollout workers get ``False``).
        timeout_s: seconds a collective of the group may wait for its peers before it raises.
        settings: the engine's section of the job's settings (:class:`verl_backend.settings.WeightSyncSettings`);
            ``None``: the engine's construction is where it reads the job's record, once
            (:func:`verl_backend.settings.current`), or takes the table's defaults in a process no ``verl train`` job
            started (the engine is VeRL's, usable on its own: tests, ``benchmarks/bench_weight_sync.py``).
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        timeout_s: float = 600.0,
        settings: WeightSyncSettings | None = None,
        **_: Any,
    ) -> None:
        if settings is None:
            try:
                settings = weight_sync_settings(current())  # the one read of the job's record in this engine
            except SettingsMissingError:
                settings = WeightSyncSettings()
        self.rl_tpu = settings
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = timedelta(seconds=timeout_s)
        self.rank: int | None = None
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._file: BucketFile | None = None  # source: this sync's shared-memory buckets
        self._mapping: BucketMapping | None = None  # receiver: the source's file, mapped read-only
        self._shared = False  # this sync's transport: shared memory (True) or the byte broadcast
        self.last_report: SyncReport | None = None
        self._no_file = ""  # why the source made no shared-memory file

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
        self._no_file = ""
        if not self.rl_tpu.shared_weights:
            self._no_file = "rl_tpu.shared_weights=false"
        else:
            try:
                self._file = BucketFile(self.bucket_size)
            except OSError as exc:
                self._no_file = str(exc)
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
            raise ValueError(
                "checkpoint_engine.backend=gloo: trainer rank 0 did not start the weight-sync store "
                "(is_master not set on it)"
            )
        world = 1 + rollout_world_size
        actor = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world)),
            "world_size": [world] * rollout_world_size,
            "master": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict) -> None:
        """Join the sync's gloo group (ranks < 0 stay out); a rollout worker also maps the source's shared-memory
        file if it can (see :func:`~verl_backend.weight_sync.pool_shared_memory.map_bucket_file`)."""
        self.rank = rank
        if rank < 0:
            return
        if rank > 0:
            self._close_shared()
            self._mapping, why = map_bucket_file(master.get("shm"))
            if self._mapping is None and why not in _TOLD:
                _TOLD.add(why)
                logger.info("weight sync: buckets come over gloo, not shared memory: %s", why)
        store = (
            self._store
            if rank == 0
            else dist.TCPStore(master["host"], master["port"], is_master=False, timeout=self.timeout)
        )
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("rl_tpu_pool_sync", store), rank, world_size, self.timeout)

    def finalize(self) -> None:
        """Drop the group, the store and the shared-memory file or mapping (the next sync builds new ones)."""
        self._close_shared()
        self.group, self._store, self.rank = None, None, None

    def _close_shared(self) -> None:
        for held in (self._file, self._mapping):
            if held is not None:
                held.close()
        self._file, self._mapping, self._shared = None, None, False

    # -- the sync ----------------------------------------------------------------------------------------------------
    def _transport(self, can_map: bool) -> PoolBroadcast:
        """The one collective that picks the sync's transport for the whole group: shared memory if every rank could
        use the file, else the byte broadcast."""
        self._shared = bool(all_min(self.group, int(can_map)))
        if self._shared:
            return PoolSharedMemory(self.group, self.bucket_size, file=self._file, mapping=self._mapping)
        return PoolBroadcast(self.group, self.bucket_size)

    def planned(self) -> str:
        """The transport :func:`~verl_backend.weight_sync.route.choose_route` plans for this sync between pools
        (``rl_tpu.shared_weights``, ``rl_tpu.rollout_slice``: the plan ``--print-config`` shows)."""
        shared, rollout_slice = self.rl_tpu.shared_weights, self.rl_tpu.rollout_slice or None
        why = f"the rollout pool is on other hosts (rl_tpu.rollout_slice={rollout_slice})" if rollout_slice else None
        return choose_route(
            SyncFacts(
                placement="server",
                shared_weights=shared,
                trainer_memory=None,
                server_memory=None,
                pool=True,
                pool_memory=why,
            )
        ).transport

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None):
        """Stream ``weights`` (``(name, tensor)`` pairs, any device, DTensors gathered) from the source rank.

        Every trainer rank must call it with its own generator: producing a tensor is collective over the trainer.
        Returns the source's figures for VeRL's step metrics: ``weight_sync/{route,bytes,seconds,verified}`` (the
        same names as every transport, :meth:`~verl_backend.weight_sync.base.SyncReport.as_metrics`) and
        ``weight_sync/pool_*`` (bytes, buckets, seconds, ``pool_shared_memory`` 1.0 or 0.0); ``{}`` on the other
        ranks.

        Raises:
            PoolSyncError: called before :meth:`init_process_group`.
            Exception: what the weight generator raised (the receivers are told first, and raise PoolSyncError).
        """
        from verl_backend.weight_sync.verify import take_proof

        start = time.perf_counter()
        if self.rank is None:
            raise PoolSyncError("checkpoint_engine gloo: send_weights before init_process_group")
        # every trainer rank (the probe's forward is collective under FSDP): the trainer's proof of this version
        proof = None
        if self.rl_tpu.verify_weight_sync:
            weights, proof = take_proof(weights, global_steps, POOL_FINGERPRINT_DTYPES)
        probe_seconds = time.perf_counter() - start

        def gathered():
            for name, tensor in weights:
                yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

        if self.rank != 0:
            for _ in gathered():
                pass
            return {}
        broadcast(self.group, torch.tensor([-1 if global_steps is None else int(global_steps)], dtype=torch.int64))
        transport = self._transport(self._file is not None)
        report = await transport.send(gathered(), global_steps)
        report.seconds = time.perf_counter() - start
        # the proof after the last bucket; then every rollout worker checks its weights once live and says so
        send_object(self.group, proof)
        counts, max_diff, verify_seconds = exchange_verdict(self.group)
        report.verified = (
            proof is not None and counts["verified"] > 0 and counts["failed"] == 0 and counts["unverified"] == 0
        )
        self.last_report = report
        if proof is not None and not report.verified:
            logger.warning("weight sync %s: not verified by every rollout worker (%s)", global_steps, counts)
        self._report_route(global_steps, report)
        return self._sync_metrics(report, proof is not None, max_diff, verify_seconds, probe_seconds)

    def _report_route(self, global_steps: int | None, report: SyncReport) -> None:
        """Say how the sync went on the source: the route line (planned, taken and why; printed once per process
        and outcome) and one log line of the sync's bytes, buckets, rollout workers, transport and seconds."""
        took, because = plan_choice(self._file is not None, self._shared, self._no_file)
        planned = self.planned()
        line = (
            f"[rl-tpu] weight sync route: planned {planned}, took {took}, because {because} (trainer rank 0 -> "
            f"{self.group.size() - 1} rollout workers, {self.bucket_size >> 20} MiB buckets)"
        )
        if line not in _TOLD:
            _TOLD.add(line)
            print(line, flush=True)
        logger.info(
            "weight sync %s: %.1f MiB in %d buckets of %d MiB to %d rollout workers by %s, %.2f s",
            global_steps,
            report.bytes / 2**20,
            report.buckets,
            self.bucket_size >> 20,
            self.group.size() - 1,
            report.transport,
            report.seconds,
        )

    def _sync_metrics(
        self, report: SyncReport, proof_sent: bool, max_diff: float, verify_seconds: float, probe_seconds: float
    ) -> dict[str, float]:
        """The source's figures for VeRL's step metrics: ``report``'s ``weight_sync/{route,bytes,seconds,verified}``,
        the verification's ``weight_sync/verify_*`` (the rollout's max probe difference and seconds, the trainer's
        probe seconds; only when a proof was sent, ``proof_sent``) and ``weight_sync/pool_*`` (bytes, buckets,
        seconds, ``pool_shared_memory`` 1.0 or 0.0)."""
        verify = (
            {}
            if not proof_sent
            else {
                "weight_sync/verify_max_abs_diff": max_diff,
                "weight_sync/verify_seconds": verify_seconds,
                "weight_sync/verify_trainer_seconds": probe_seconds,
            }
        )
        return {
            **report.as_metrics(),
            **verify,
            "weight_sync/pool_bytes": report.bytes,
            "weight_sync/pool_buckets": float(report.buckets),
            "weight_sync/pool_seconds": report.seconds,
            "weight_sync/pool_shared_memory": float(self._shared),
        }

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
        received = ReceivedWeights(
            lambda views, keep: self._receive(global_steps, views, keep, received),
            lambda *verdict: exchange_verdict(self.group, *verdict),
        )
        return received

    def _receive(
        self, global_steps: int | None, views: bool, keep: bool, received: ReceivedWeights
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The stream a rollout worker iterates (``keep=False``: the whole sync drained, nothing yielded); once it
        has ended, the trainer's proof is read into ``received`` (:meth:`ReceivedWeights.ended`)."""
        if self.rank is None or self.rank <= 0:
            raise PoolSyncError("checkpoint_engine gloo: receive_weights on a rank that is not a rollout worker")
        version = torch.zeros(1, dtype=torch.int64)
        broadcast(self.group, version)
        transport = self._transport(self._mapping is not None)
        sent = None if int(version) < 0 else int(version)
        if global_steps is not None and sent is not None and sent != int(global_steps):
            for _ in transport.receive(keep=False):  # drained, so the source is not left waiting on this worker
                pass
            received.ended(receive_object(self.group))
            raise PoolSyncError(
                f"weight sync: the trainer sent step {sent}'s weights, this rollout worker expected step {global_steps}"
            )
        control, state = {"keep": keep}, {"ended": False}

        def stream():
            yield from transport.receive(views=views, control=control)
            state["ended"] = True  # the last bucket came (not the source's abort): the proof follows

        chunks = stream()
        try:
            yield from merge_chunks(chunks, self.bucket_size)
        finally:  # the consumer raised or stopped early: drain the rest, so the source and other workers finish
            control["keep"] = False
            for _ in chunks:
                pass
            if state["ended"]:
                received.ended(receive_object(self.group))
