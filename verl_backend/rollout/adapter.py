"""``NativeServerAdapter``: the rollout object VeRL builds inside each trainer worker (``BaseRollout``).

VeRL's colocated weight sync (``checkpoint_engine.backend=naive``) calls
``rollout.update_weights(per_tensor_param)`` in every trainer worker after each actor update. The leader rank of
each replica sends the full tensors to its replica's server; the other ranks only drain the generator (which is
collective under FSDP). No NCCL, no shared device memory. The route is chosen once per replica by
:func:`verl_backend.weight_sync.choose_route` (logged as ``planned X, took Y, because ...``) and carried out by one
``transport.send(weights, version)`` (:class:`verl_backend.weight_sync.Transport`); the transports, the first that
applies (the package docstring has the table):

- **shared memory, in place** (server on this host, CPU, one FSDP rank: the default CPU job): the actor's
  parameters already live in a shared-memory file (:func:`verl_backend.workers.engine.share_fsdp_parameters`, handed
  over with :func:`verl_backend.weight_sync.hand_over`) and the server computes on them, mapped read-only
  (:meth:`NativeRolloutServer.attach_trainer_weights`, done at the first sync). A sync copies nothing: it holds
  generation, checks each tensor is its slot, and tags the new step.
- **shared memory, copied** (server on this host, CPU): the leader maps the server's weight file
  (:class:`rl_tpu.shared_weights.SharedWeightsWriter`) and copies each tensor into place: one memory copy.
- **Ray object store** (otherwise, or ``rl_tpu.shared_weights=false``): tensors are packed into buckets
  (:func:`rl_tpu.collectives.pack_bucket`); each bucket is ``ray.put`` and loaded by the server as it arrives.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Generator

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from verl_backend import weight_sync
from verl_backend.rollout import server_actor_name
from verl_backend.rollout.native_kwargs import native_engine_kwargs
from verl_backend.weight_sync.base import ReplicaEnd, full_cpu, transport_class

logger = logging.getLogger(__name__)


def sampler_placement(rollout_config) -> str:
    """``actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement``
    (:class:`~verl_backend.rollout.native_kwargs.NativeEngineKwargs`): ``server`` (default: the rollout server
    process holds an inference copy) or ``worker`` (the trainer worker samples on its own device; needed on TPU where
    each worker owns its chip), checked against the checkpoint engine.

    Raises:
        ValueError: a bad ``engine_kwargs.native`` (:func:`~verl_backend.rollout.native_kwargs.native_engine_kwargs`),
            or ``worker`` with a checkpoint engine that does not serve the worker's sampler to the rollout server
            (:data:`IN_WORKER_ENGINES`; without one every generate fails).
    """
    placement = native_engine_kwargs(rollout_config).sampler_placement
    engine = getattr(rollout_config, "checkpoint_engine", None)
    backend = engine.get("backend", None) if engine is not None else None
    if placement == "worker" and backend not in IN_WORKER_ENGINES:
        raise ValueError(
            "actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement=worker needs "
            f"actor_rollout_ref.rollout.checkpoint_engine.backend native or gloo (it is {backend!r}): those engines "
            "serve the worker's sampler to the rollout server; set native (gloo with a rollout slice), or drop "
            "sampler_placement"
        )
    return placement


# checkpoint engines that serve a worker's own sampler (verl_backend.worker_sampler.InWorkerGenerate): native in
# the trainer worker (hybrid), gloo in the trainer worker and in a rollout slice's CheckpointEngineWorkers
IN_WORKER_ENGINES = ("native", "gloo")


class NativeServerAdapter(BaseRollout):
    """Weight-sync side of the native rollout, living in the trainer worker process (hybrid) or in a standalone
    replica's ``CheckpointEngineWorker`` (a rollout pool of its own). With ``sampler_placement=worker`` it also
    builds the sampler in that process, on its device, and loads every sync into it."""

    def __init__(self, config, model_config, device_mesh, *args, replica_rank: int = -1, **kwargs):
        """``replica_rank``: given by VeRL to a standalone replica's worker (``CheckpointEngineWorker``, created
        before its process group: ``RANK`` is its rank within the replica); ``-1`` in a trainer worker, whose rank
        gives its colocated replica.

        This is where a rollout replica's worker reads the job's settings record, once
        (:func:`verl_backend.settings.current`): its section (:class:`verl_backend.settings.RolloutSettings`) is kept
        as ``self.rl_tpu`` and handed down (the in-worker sampler, the sync route, verification).

        Raises:
            verl_backend.settings.SettingsMissingError: this process was not started by a ``verl train`` job.
        """
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        from verl_backend.settings import current, rollout_settings

        self.rl_tpu = rollout_settings(current())  # the one read of the job's record in a rollout replica's worker
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))
        tp = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        tp *= self.config.pipeline_model_parallel_size
        self.replica_rank = rank // tp if replica_rank < 0 else int(replica_rank)
        self.colocated = replica_rank < 0  # in a trainer worker; else a standalone replica's CheckpointEngineWorker
        self.is_leader = rank % tp == 0
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self._server = None
        self._writer = None  # SharedWeightsWriter once mapped; False: shared memory is not available
        self._attached = None  # the actor's SharedWeights once the server computes on them; False: it does not
        self.last_sync: dict[str, float] = {}  # SyncReport.as_dict of the last sync
        self.last_metrics: dict[str, float] = {}  # its weight_sync/{route,bytes,seconds,verified}
        self.route: weight_sync.SyncRoute | None = None  # chosen at the first sync (choose_route), logged once
        self.transport: weight_sync.Transport | None = None  # carries out the route
        self.src_rank = rank
        self.placement = sampler_placement(self.config)
        self.sampler = None
        if self.placement == "worker":
            from verl.utils.device import get_device_name

            from verl_backend.weight_sync.lora import set_base_path

            set_base_path(self.model_config.local_path)  # an adapter-only LoRA sync merges onto these files

            from verl_backend.rollout.inworker import set_worker_sampler
            from verl_backend.rollout.sampling import build_sampler

            self.sampler = build_sampler(
                self.model_config.local_path,
                self.config,
                get_device_name(),
                bool(getattr(self.model_config, "trust_remote_code", False) or False),
                settings=self.rl_tpu,
            )
            set_worker_sampler(self.sampler, threads=self.rl_tpu.threads)

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def _shared_writer(self):
        """The server's shared-memory weights, mapped here; ``None`` if the server is on another host, keeps no
        shared weights, or the file cannot be opened (then the object store is used, and a warning says why)."""
        if self._writer is None:
            self._writer = False
            self._writer_reason = "rl_tpu.shared_weights=false"
            if self.rl_tpu.shared_weights:
                server = self._server_handle()
                handle = await server.shared_weights_handle.remote()
                if handle is None:
                    self._writer_reason = "the rollout server keeps no shared-memory weights"
                elif handle["node_id"] != ray.get_runtime_context().get_node_id():
                    self._writer_reason = "the rollout server is on another host"
                else:
                    from rl_tpu.shared_weights import SharedWeightsWriter

                    try:
                        self._writer = SharedWeightsWriter(handle)
                    except OSError as exc:
                        self._writer_reason = f"cannot map the rollout server's shared weights ({exc})"
                    else:
                        await server.shared_weights_attached.remote()
        return self._writer or None

    async def _trainer_weights(self) -> str | None:
        """Attach this replica's server to the actor's shared-memory parameters (handed over by the engine,
        :func:`verl_backend.weight_sync.handed_over`). Returns ``None`` when the server computes on them, else why
        not (the route then copies)."""
        if self._attached is None:
            self._attached = False
            published = weight_sync.handed_over("actor")
            if published is None:
                self._attach_reason = "the actor's parameters are not in a shared-memory file (its engine says why)"
            else:
                handle = published.handle(node_id=ray.get_runtime_context().get_node_id())
                reason = await self._server_handle().attach_trainer_weights.remote(handle)
                if reason is None:
                    self._attached = published
                self._attach_reason = (
                    reason and f"the rollout server cannot compute on the trainer's weights ({reason})"
                )
        return None if self._attached else self._attach_reason

    async def _choose_route(self) -> weight_sync.SyncRoute:
        """The route of this replica's syncs (:func:`verl_backend.weight_sync.choose_route`), decided at the first
        sync from what this process and the server can map, and logged once with its reason by the replica's
        leader."""
        if self.route is None:
            shared = bool(self.rl_tpu.shared_weights) and self.placement == "server"
            trainer = server = "rl_tpu.shared_weights=false"
            lora = int(getattr(self.model_config, "lora_rank", 0) or 0)
            if shared and lora > 0:  # adapter-only sync: the server merges what it receives (object store)
                from verl_backend.weight_sync.route import known_blockers

                trainer, server = known_blockers(True, 1, lora)
            elif shared:
                trainer = await self._trainer_weights()
                if trainer is not None:
                    server = None if await self._shared_writer() is not None else self._writer_reason
            self.route = weight_sync.choose_route(
                weight_sync.SyncFacts(
                    placement=self.placement,
                    shared_weights=bool(self.rl_tpu.shared_weights),
                    trainer_memory=trainer,
                    server_memory=server,
                    src_rank=self.src_rank,
                    dst_replica=self.replica_rank,
                    bucket_bytes=self.bucket_bytes,
                )
            )
            if self.is_leader:
                print(weight_sync.took_line(self._planned(), self.route), flush=True)
        return self.route

    def _planned(self) -> str:
        """What ``--print-config`` planned for this replica (:func:`verl_backend.weight_sync.route.known_blockers`:
        the facts knowable before Ray), to log beside the route taken."""
        from verl.utils.device import get_device_name

        from verl_backend.weight_sync.route import known_blockers

        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        trainer, server = known_blockers(
            get_device_name() == "cpu", ranks, int(getattr(self.model_config, "lora_rank", 0) or 0)
        )
        if not self.colocated:  # the second hop of a pool's sync: from the gloo engine's receiver to its server
            trainer = "the rollout runs in a pool of its own: the weights arrive over the gloo engine"
        return weight_sync.choose_route(
            weight_sync.SyncFacts(
                placement=self.placement,
                shared_weights=bool(self.rl_tpu.shared_weights),
                trainer_memory=trainer,
                server_memory=server,
            )
        ).transport

    async def _transport(self) -> weight_sync.Transport:
        """The transport of this replica's route (made at the first sync, through the
        :class:`~verl_backend.weight_sync.Transport` interface: :meth:`~verl_backend.weight_sync.Transport.for_replica`
        of the class the registry names)."""
        if self.transport is None:
            route = await self._choose_route()
            self.transport = transport_class(route.transport).for_replica(self._end(route))
        return self.transport

    def _end(self, route: weight_sync.SyncRoute) -> ReplicaEnd:
        """What this adapter holds for its syncs (:class:`~verl_backend.weight_sync.base.ReplicaEnd`)."""
        return ReplicaEnd(
            server=self._server_handle() if self.is_leader else None,
            sampler=self.sampler,
            attached=None if self._attached is False else self._attached,
            writer=None if self._writer is False else self._writer,
            bucket_bytes=route.bucket_bytes,
            colocated=self.colocated,
            shared_weights=bool(self.rl_tpu.shared_weights),
        )

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ):
        """Send ``(name, tensor)`` pairs of the trainer step ``global_steps`` (the weights' version) to this
        replica's server along its route (:meth:`_choose_route`). Returns when the server serves the new weights.

        Records ``last_sync`` (:meth:`verl_backend.weight_sync.SyncReport.as_metrics`: version, transport, bytes,
        copied bytes, seconds, buckets).

        A stream that can be closed (the ``gloo`` engine's
        :class:`~verl_backend.weight_sync.pool_stream.ReceivedWeights`) is closed on the way out, raised or not: what
        this replica did not read is drained, so the trainer and the other replicas finish the sync instead of waiting
        for the group's timeout.

        Raises:
            ValueError: ``wire_format`` other than ``"named_tensors"`` (delta sync is not supported).
        """
        close = getattr(weights, "close", None)
        try:
            await self._update_weights(weights, wire_format, **kwargs)
        except BaseException:
            if callable(close):
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 -- the load's own error is the one to see;
                    # the drain's is logged
                    logger.warning("weight sync: draining the rest of the stream after a failed load: %s", exc)
            raise
        if callable(close):
            close()

    async def _update_weights(self, weights, wire_format: str, **kwargs: Any):
        if wire_format != "named_tensors":
            raise ValueError(f"native rollout supports wire_format='named_tensors' only, got {wire_format!r}")
        global_steps = kwargs.get("global_steps")
        from verl_backend.weight_sync.verify import WeightSyncMismatch, take_proof

        # a rollout worker fed by the gloo engine (a pool of its own): the trainer's proof comes after the stream,
        # and the engine's source waits for this worker's verdict (ReceivedWeights.report_verdict)
        verdict = getattr(weights, "report_verdict", None)
        if verdict is not None:
            weights.promise_verdict()  # reported below, or "unverified" by close() on the way out
        received = weights
        # every rank (the probe's forward is collective under FSDP): the trainer's probe now, fingerprints as it sends
        start = time.perf_counter()
        proof, verify_on = None, bool(self.rl_tpu.verify_weight_sync)  # the section read at __init__
        if verify_on:
            weights, proof = take_proof(weights, global_steps, getattr(self.config, "dtype", None))
        probe_seconds = time.perf_counter() - start  # the trainer's side of the verification (its probe forward)
        if self.placement != "worker" and not self.is_leader:  # only walk the export (collective under FSDP)
            for _ in full_cpu(weights):
                pass
            if verdict is not None:
                verdict("not_serving")  # the replica's leader checks the weights it serves
            return
        transport = await self._transport()
        report = await transport.send(weights, global_steps)  # the one send, whatever the route
        trainer_side = proof is not None
        if proof is None and verify_on:
            proof = getattr(received, "proof", None)  # from another pool's trainer, read after the stream
        try:
            verify = await self._verify_sync(proof) if proof is not None else {}
        except WeightSyncMismatch:
            if verdict is not None:
                verdict("failed")
            raise
        report.verified = verify.get("weight_sync/verified", 0.0) == 1.0
        if verdict is not None:
            verdict(
                "verified" if report.verified else "unverified",
                verify.get("weight_sync/verify_max_abs_diff", 0.0),
                verify.get("weight_sync/verify_seconds", 0.0),
            )
        self.last_sync = report.as_dict()
        self.last_metrics = {**report.as_metrics(), **verify}
        if trainer_side:
            self.last_metrics["weight_sync/verify_trainer_seconds"] = probe_seconds
        words, detail = transport.first_sync_words(report, self._end(self.route))
        self._report_first_sync(transport=words, detail=detail)

    async def _verify_sync(self, proof) -> dict:
        """The rollout proves it computes with the weights just sent (:mod:`verl_backend.weight_sync.verify`): this
        process's own sampler (``sampler_placement=worker``), else the replica's server. Returns the metrics
        (``weight_sync/verified`` ...).

        Raises:
            verl_backend.weight_sync.verify.WeightSyncMismatch: one line naming the replica, the version and the tensor.
        """
        from verl_backend.weight_sync.verify import WeightSyncMismatch, check_sync

        if self.placement == "worker":
            return check_sync(self.sampler, proof, self.replica_rank).as_metrics()
        try:
            return await self._server_handle().verify_sync.remote(proof)
        except Exception as exc:  # Ray's wrapper carries the server's traceback: the one line is the message
            cause = getattr(exc, "cause", None)
            if isinstance(cause, WeightSyncMismatch):
                raise WeightSyncMismatch(str(cause)) from None
            raise

    def _report_first_sync(self, transport: str, detail: str = "") -> None:
        """Say once what the first sync did: ``transport`` in words, ``detail``, bytes and seconds."""
        if not getattr(self, "_reported", False):
            self._reported = True
            s = self.last_sync
            rank = int(getattr(self.model_config, "lora_rank", 0) or 0)  # LoRA: the engine sends the adapter only
            what = (
                (
                    f" (adapter only, LoRA rank {rank}, {s['bytes'] / 1e6:.1f} MB: the rollout merges it onto its base "
                    "weights)"
                )
                if rank
                else ""
            )
            print(
                f"[rl-tpu] weight sync to rollout replica {self.replica_rank}: {transport}"
                f"{', ' + detail if detail else ''}, {s['bytes'] / 1e6:.0f} MB in {s['seconds']:.2f} s{what}",
                flush=True,
            )
