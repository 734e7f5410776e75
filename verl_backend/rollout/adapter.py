"""``NativeServerAdapter``: the rollout object VeRL builds inside each trainer worker (``BaseRollout``).

VeRL's colocated weight sync (``checkpoint_engine.backend=naive``) calls
``rollout.update_weights(per_tensor_param)`` in every trainer worker after each actor update. The leader rank of
each replica sends the full tensors to its replica's server; the other ranks only drain the generator (which is
collective under FSDP). No NCCL, no shared device memory. Three transports, the first that applies:

- **shared memory, in place** (server on this host, CPU, one FSDP rank: the default CPU job): the actor's
  parameters already live in a shared-memory file (:func:`verl_backend.engine.share_fsdp_parameters`) and the
  server computes on them, mapped read-only (:meth:`NativeRolloutServer.attach_trainer_weights`, done at the first
  sync). A sync copies nothing: it holds generation, checks each tensor is its slot, and tags the new step.
- **shared memory, copied** (server on this host, CPU): the leader maps the server's weight file
  (:class:`rl_tpu.shared_weights.SharedWeightsWriter`) and copies each tensor into place: one memory copy.
- **Ray object store** (otherwise, or ``rl_tpu.shared_weights=false``): tensors are packed into buckets
  (:func:`rl_tpu.collectives.pack_bucket`); each bucket is ``ray.put`` and loaded by the server as it arrives.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Generator

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from verl_backend.rollout import server_actor_name

logger = logging.getLogger(__name__)

PLACEMENTS = ("server", "worker")


def sampler_placement(rollout_config) -> str:
    """``actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement``: ``server`` (default: the rollout
    server process holds an inference copy, synced through the Ray object store) or ``worker`` (the trainer
    worker samples on its own device; needed on TPU where each worker owns its chip).

    Raises:
        ValueError: any other value, or ``worker`` without ``checkpoint_engine.backend=native`` (the engine that
            serves the worker's sampler to the rollout server; without it every generate fails).
    """
    kwargs = getattr(rollout_config, "engine_kwargs", None) or {}
    native = kwargs.get("native", None) or {}
    if not hasattr(native, "get"):
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.native={native!r}: give a mapping, e.g. "
            "'+actor_rollout_ref.rollout.engine_kwargs.native={sampler_placement:worker}'"
        )
    placement = native.get("sampler_placement", None)
    placement = "server" if placement is None else str(placement)
    if placement not in PLACEMENTS:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement={placement!r}: choose one of {PLACEMENTS}"
        )
    engine = getattr(rollout_config, "checkpoint_engine", None)
    backend = engine.get("backend", None) if engine is not None else None
    if placement == "worker" and backend != "native":
        raise ValueError(
            "actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement=worker needs "
            f"actor_rollout_ref.rollout.checkpoint_engine.backend=native (it is {backend!r}): the native engine "
            "serves the worker's sampler to the rollout server; set it, or drop sampler_placement"
        )
    return placement


MAX_BUCKETS_IN_FLIGHT = 2  # weight-sync buckets sent and not yet loaded: the object store holds at most these


class NativeServerAdapter(BaseRollout):
    """Weight-sync side of the native rollout, living in the trainer worker process."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        tp = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        tp *= self.config.pipeline_model_parallel_size
        self.replica_rank = rank // tp
        self.is_leader = rank % tp == 0
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self._server = None
        self._writer = None  # SharedWeightsWriter once mapped; False: shared memory is not available
        self._attached = None  # the actor's SharedWeights once the server computes on them; False: it does not
        self.last_sync: dict[str, float] = {}
        self.placement = sampler_placement(self.config)
        self.sampler = None
        if self.placement == "worker":
            from verl.utils.device import get_device_name

            from verl_backend.rollout.inworker import set_worker_sampler
            from verl_backend.rollout.sampling import build_sampler

            self.sampler = build_sampler(
                self.model_config.local_path, self.config, get_device_name(),
                bool(getattr(self.model_config, "trust_remote_code", False) or False),
            )
            set_worker_sampler(self.sampler)

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def _shared_writer(self):
        """The server's shared-memory weights, mapped here; ``None`` if the server is on another host, keeps no
        shared weights, or the file cannot be opened (then the object store is used, and a warning says why)."""
        if self._writer is None:
            self._writer = False
            from verl_backend.settings import current

            if current().shared_weights:
                server = self._server_handle()
                handle = await server.shared_weights_handle.remote()
                if handle is not None and handle["node_id"] == ray.get_runtime_context().get_node_id():
                    from rl_tpu.shared_weights import SharedWeightsWriter

                    try:
                        self._writer = SharedWeightsWriter(handle)
                    except OSError as exc:
                        logger.warning("weight sync through the Ray object store: cannot map the rollout server's "
                                       "shared weights (%s)", exc)
                    else:
                        await server.shared_weights_attached.remote()
        return self._writer or None

    async def _trainer_weights(self):
        """The actor's parameters in shared memory (:func:`verl_backend.engine.trainer_shared_weights`) once this
        replica's server computes on them; ``None`` if there are none in this process or the server cannot map
        them (a warning says why; the sync then copies)."""
        if self._attached is None:
            self._attached = False
            engine = sys.modules.get("verl_backend.engine")  # the actor's engine, when it runs in this process
            published = engine.trainer_shared_weights() if engine is not None else None
            if published is not None:
                handle = published.handle(node_id=ray.get_runtime_context().get_node_id())
                reason = await self._server_handle().attach_trainer_weights.remote(handle)
                if reason is None:
                    self._attached = published
                else:
                    logger.warning("weight sync copies into the rollout server: it cannot compute on the trainer's "
                                   "weights (%s)", reason)
        return self._attached or None

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], wire_format: str = "named_tensors", **kwargs: Any):
        """Send ``(name, tensor)`` pairs to this replica's server: written straight into its shared-memory weights
        when it runs on this host, else in object-store buckets of ``checkpoint_engine.update_weights_bucket_megabytes``
        MiB. Returns when the server serves the new weights.

        Records ``last_sync = {"bytes", "seconds", "buckets", "transport"}`` (``"shared_memory"`` or
        ``"object_store"``).

        Raises:
            ValueError: ``wire_format`` other than ``"named_tensors"`` (delta sync is not supported).
        """
        if wire_format != "named_tensors":
            raise ValueError(f"native rollout supports wire_format='named_tensors' only, got {wire_format!r}")
        global_steps = kwargs.get("global_steps")
        start, n = time.perf_counter(), 0

        def cpu_full(it):
            for name, t in it:
                if hasattr(t, "full_tensor"):
                    t = t.full_tensor()
                yield name, t.detach().to("cpu")

        if self.placement == "worker":  # in-process, on this worker's device
            def counted(it):
                nonlocal n
                for name, t in it:
                    t = t.full_tensor() if hasattr(t, "full_tensor") else t
                    n += t.numel() * t.element_size()
                    yield name, t.detach()

            self.sampler.load_state_dict(counted(weights))
            if self.is_leader:
                await self._server_handle().set_global_steps.remote(global_steps)
            self.last_sync = {"bytes": float(n), "seconds": time.perf_counter() - start, "buckets": 0.0,
                              "transport": "in_process"}
            self._report_first_sync(detail="loaded on the trainer worker's device")
            return
        if not self.is_leader:
            for _ in cpu_full(weights):
                pass
            return
        server = self._server_handle()
        published = await self._trainer_weights()
        if published is not None:  # the server reads the trainer's parameters: check they are in place
            await server.begin_weight_update.remote()
            try:
                in_place, copied = published.publish(cpu_full(weights))
            finally:
                await server.end_weight_update.remote([], global_steps)
            self.last_sync = {"bytes": float(in_place + copied), "copied_bytes": float(copied),
                              "seconds": time.perf_counter() - start, "buckets": 0.0, "transport": "shared_memory"}
            self._report_first_sync(detail="in place: the rollout computes on the trainer's parameters, "
                                           f"{copied / 1e6:.0f} MB copied")
            return
        writer = await self._shared_writer()
        if writer is not None:
            await server.begin_weight_update.remote()
            try:
                written, sent = writer.write(cpu_full(weights))
            except BaseException:
                try:  # resume the server; its own complaint (a half-written model) is not the cause
                    await server.end_weight_update.remote([], global_steps)
                except Exception:
                    pass
                raise
            await server.end_weight_update.remote(written, global_steps)  # raises if a released model is partial
            self.last_sync = {"bytes": float(sent), "seconds": time.perf_counter() - start, "buckets": 0.0,
                              "transport": "shared_memory"}
            self._report_first_sync()
            return
        from verl_backend.rollout.bucket_sync import send_buckets

        def send(flat, meta, last, total):  # ray.put copies the staging buffer into the object store
            return server.update_weights_bucket.remote(ray.put(flat), meta, last, global_steps, total=total)

        sent, n = await send_buckets(cpu_full(weights), self.bucket_bytes, send, MAX_BUCKETS_IN_FLIGHT)
        self.last_sync = {"bytes": float(sent), "seconds": time.perf_counter() - start, "buckets": float(n),
                          "transport": "object_store"}
        from verl_backend.settings import current

        self._report_first_sync(detail="" if current().shared_weights else "rl_tpu.shared_weights=false")

    def _report_first_sync(self, detail: str = "") -> None:
        if not getattr(self, "_reported", False):
            self._reported = True
            s = self.last_sync
            rank = int(getattr(self.model_config, "lora_rank", 0) or 0)  # LoRA: the engine sends the merged model
            what = f" (merged weights: base + LoRA rank {rank} adapter)" if rank else ""
            print(f"[rl-tpu] weight sync to rollout replica {self.replica_rank}: {s['transport'].replace('_', ' ')}"
                  f"{', ' + detail if detail else ''}, {s['bytes'] / 1e6:.0f} MB in {s['seconds']:.2f} s{what}",
                  flush=True)
