"""The native rollout server: a Ray actor that owns an inference copy of the policy and the rl_tpu sampler.

VeRL's agent loop sends one ``generate(request_id, prompt_ids, sampling_params)`` call per sample, all at once
and concurrently. The server gathers the calls that arrive together into one batch (up to
``rollout.max_num_seqs``), groups them by sampling settings, runs the batched, KV-cached sampler in a worker
thread and answers each call with a :class:`verl.workers.rollout.replica.TokenOutput`.

Each sample draws from a random stream of its own (:func:`sample_seed_of`): its seed mixes the job seed
(``data.seed``), the rollout seed, the weight version it is sampled with, VeRL's request id and the prompt's tokens,
so a completion does not depend on which requests share its batch (docs/reproducibility.md).

Weights arrive from the trainer in one of two ways, neither needing NCCL nor a shared device:

- same host, CPU (the colocated default): the server keeps its model's parameters in a shared-memory file
  (:class:`rl_tpu.shared_weights.SharedWeights`); the trainer writes new weights straight into it between
  :meth:`begin_weight_update` and :meth:`end_weight_update`. While the rollout sleeps (VeRL's
  ``free_cache_engine``, on by default) those pages are given back to the OS.
- otherwise: packed buckets through the Ray object store (:meth:`update_weights_bucket`).

Whatever the transport (:mod:`verl_backend.weight_sync`), received tensors enter the sampler in one place,
:meth:`NativeRolloutServer.apply`, and every sync ends in :meth:`NativeRolloutServer.weights_live`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_backend.host_memory.heap import trim_host_heap
from verl_backend.rollout.sampling import (
    build_sampler,
    run_sampler,
    sampling_params_from_request,
)
from verl_backend.settings import RolloutSettings, current, rollout_settings

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt_ids: list[int]
    key: Any  # rl_tpu.sampler.SamplingParams (frozen): requests with equal settings share a batch
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)
    request_id: str = ""


def sample_seed_of(
    job_seed: int | str | None,
    rollout_seed: int,
    request_seed: int | None,
    version: int,
    request_id: str,
    occurrence: int,
    prompt_ids: list[int],
) -> int:
    """The seed of one sample's random stream (:func:`rl_tpu.sampler.seeds.sample_seed`).

    Args:
        job_seed: the job's seed (VeRL's ``data.seed``, :attr:`verl_backend.settings` ``job_seed``).
        rollout_seed: VeRL's ``actor_rollout_ref.rollout.seed``.
        request_seed: a ``seed`` the request itself carries, or ``None``.
        version: the weight version (trainer step) the sample is drawn with: the same request id at another step
            draws anew.
        request_id: VeRL's ``det-<priority>`` under ``rollout.full_determinism`` (legacy trainer: the sample's place
            in the step's batch, prompt-major; VeRL 0.9.1's V1 trainer, the default, names every request ``det-0``),
            else ``replica-<rank>`` (VeRL's ids are then fresh uuids, which would make every run another).
        occurrence: how many requests with this ``request_id`` and prompt came before it at this version (arrival
            order): what tells the ``n`` samples of a prompt apart when the request id does not.
        prompt_ids: the prompt's tokens (a multi-turn request id sees a new prompt each turn).
    """
    from rl_tpu.sampler.seeds import sample_seed

    return sample_seed("verl", job_seed, rollout_seed, request_seed, version, request_id, occurrence, prompt_ids)


class NativeRolloutServer:
    """Serves VeRL's token-in/token-out ``generate`` with :class:`rl_tpu.sampler.Sampler`.

    Args:
        rollout_config: VeRL ``RolloutConfig`` (``prompt_length``, ``response_length``, ``max_num_seqs``,
            ``dtype``, ``calculate_log_probs``).
        model_path: HF model folder (the trainer's ``actor_rollout_ref.model.local_path``).
        device: torch device type for the sampler (``"cpu"``, ``"tpu"``, ``"cuda"``).
        replica_rank: rank of the replica this server belongs to.
        batch_window_s: how long (seconds) to wait for more requests after the first one before running a batch.
        worker_method: ``sampler_placement=worker``: the ``execute_checkpoint_engine`` actor method of the worker
            that owns the device (the trainer worker, or a rollout slice's ``CheckpointEngineWorker``); batches run
            there, on its own device (a TPU chip), and this server holds no model.
        settings: the rollout's section of the job's settings (:class:`verl_backend.settings.RolloutSettings`);
            ``None`` (a server started as a Ray actor): the server's construction is where it reads the job's
            record, once (:func:`verl_backend.settings.current`), and everything below takes this section.

    Raises:
        verl_backend.settings.SettingsMissingError: ``settings`` is ``None`` and this process has no record.
    """

    def __init__(
        self,
        rollout_config: Any,
        model_path: str,
        device: str = "cpu",
        replica_rank: int = 0,
        batch_window_s: float = 0.05,
        trust_remote_code: bool = False,
        worker_method: Any = None,
        settings: RolloutSettings | None = None,
    ):
        from rl_tpu.device import set_num_threads

        # the one read of the job's record in a rollout server process
        self.rl_tpu = rollout_settings(current()) if settings is None else settings
        if self.rl_tpu.threads:
            set_num_threads(self.rl_tpu.threads)
        self.config = rollout_config
        self.model_path = model_path
        self.device = torch.device(device)
        self.replica_rank = replica_rank
        self.batch_window_s = batch_window_s
        self.trust_remote_code = trust_remote_code
        self.worker_method = worker_method
        self.max_batch = max(1, int(getattr(rollout_config, "max_num_seqs", 64) or 64))
        self.global_steps = 0  # step of the weights being served; VeRL tags every output with it
        self.full_determinism = bool(getattr(rollout_config, "full_determinism", False))
        self.rollout_seed = int(getattr(rollout_config, "seed", 0) or 0)
        self.job_seed = self.rl_tpu.job_seed
        if self.job_seed is None:  # data.seed unset: VeRL's order is unseeded, so are the draws
            import secrets

            self.job_seed = f"unseeded-{secrets.randbits(63)}"
        self._arrivals: dict[tuple, int] = {}  # (version, request id, prompt) -> requests seen (sample_seed_of)
        self._queue: list[_Request] = []
        self._wake = None  # asyncio.Event, created on the actor's event loop
        self._loop_task = None
        self._paused = False
        self._updating = False  # a weight sync is between its first and last bucket: hold generation
        self._buckets_loaded = 0
        self._batch_running = False
        self._sync_started = 0.0  # perf_counter() at the last begin_weight_update
        self.sampler = None
        self.shared = None  # SharedWeights: the model's parameters in shared memory (CPU, sampler in this process)
        self._shared_attached = False  # a trainer on this host writes into them: release them while asleep
        self.trainer_weights = None  # SharedWeightsReader: the model computes on the trainer's own parameters
        self.free_when_asleep = bool(getattr(rollout_config, "free_cache_engine", True))
        self.stats = {"requests": 0, "batches": 0, "generated_tokens": 0, "generate_s": 0.0, "weight_sync_s": 0.0}
        self._build_sampler()
        trim_host_heap()  # what loading the checkpoint freed

    # ------------------------------------------------------------------ set-up
    def _build_sampler(self) -> None:
        self.max_prompt_len = int(getattr(self.config, "prompt_length", 512))
        self.response_length = int(getattr(self.config, "response_length", 512))
        if self.worker_method is None:
            from verl_backend.weight_sync.lora import set_base_path

            self.sampler = build_sampler(
                self.model_path, self.config, self.device, self.trust_remote_code, settings=self.rl_tpu
            )
            set_base_path(self.model_path)  # an adapter-only LoRA sync merges onto these files
            if self.device.type == "cpu" and self.rl_tpu.shared_weights:
                from rl_tpu.shared_weights import SharedWeights, SharedWeightsError

                try:
                    self.shared = SharedWeights(self.sampler.model, name=f"rl_tpu_rollout_{self.replica_rank}")
                except (SharedWeightsError, OSError) as exc:
                    logger.warning("weight sync falls back to the Ray object store: %s", exc)

    # --------------------------------------------------------------- generate
    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ):
        """Generate one response for ``prompt_ids`` (token ids).

        ``sampling_params`` becomes :class:`rl_tpu.sampler.SamplingParams` in one place,
        :func:`sampling_params_from_request`: every key is honoured or refused (see
        :data:`rl_tpu.sampler.params.REQUEST_KEYS`).

        Returns:
            ``TokenOutput`` with ``token_ids`` (response only), ``log_probs`` (when the request asks for them with
            VeRL's ``logprobs``, else ``None``: float, one per response token, log-softmax of the
            temperature-scaled logits before penalties and truncation) and ``stop_reason`` ``"completed"``.

        Raises:
            ValueError: images/videos given (the native rollout is text only), a prompt longer than
                ``rollout.prompt_length``, or a sampling key the native sampler cannot honour
                (``rl_tpu.sampler.SamplerError``, one line naming it).
        """
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None:
            raise ValueError("the native rollout is text-only: drop image/video inputs or use rollout.name=vllm")
        if len(prompt_ids) > self.max_prompt_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens is longer than rollout.prompt_length={self.max_prompt_len}; "
                "raise data.max_prompt_length or keep data.filter_overlong_prompts=True"
            )
        key = sampling_params_from_request(sampling_params, self.config, self.response_length, self.replica_rank)
        loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
            self._loop_task = loop.create_task(self._batch_loop())
        req = _Request(list(map(int, prompt_ids)), key, loop.create_future(), request_id=str(request_id))
        self._queue.append(req)
        self.stats["requests"] += 1
        self._wake.set()
        token_ids, log_probs = await req.future  # log_probs None unless requested
        extra = {"global_steps": self.global_steps}
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason="completed", extra_fields=extra)

    async def _batch_loop(self) -> None:
        while True:
            await self._wake.wait()
            # Let concurrent callers enqueue: VeRL's agent loop fires all samples of a step together.
            await asyncio.sleep(self.batch_window_s)
            while self._paused or self._updating:
                await asyncio.sleep(0.01)
            self._wake.clear()
            while self._queue:
                key = self._queue[0].key
                batch = [r for r in self._queue if r.key == key][: self.max_batch]
                taken = set(map(id, batch))
                self._queue = [r for r in self._queue if id(r) not in taken]
                while self._updating:  # a weight sync began while earlier batches ran
                    await asyncio.sleep(0.01)
                seeds = self._sample_seeds(batch, key)
                order = sorted(range(len(batch)), key=seeds.__getitem__)  # not arrival order: floats see one order
                batch, seeds = [batch[i] for i in order], [seeds[i] for i in order]
                self._batch_running = True
                try:
                    outs = await asyncio.to_thread(self._run_batch, [r.prompt_ids for r in batch], key, seeds)
                except Exception as exc:  # surface the sampler's error to every caller of this batch
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                finally:
                    self._batch_running = False
                for r, out in zip(batch, outs):
                    if not r.future.done():
                        r.future.set_result(out)

    def _sample_seeds(self, batch: list[_Request], key: Any) -> list[int]:
        """Each request's stream seed (:func:`sample_seed_of`) at the weight version it is about to be sampled
        with, counting the requests of each (request id, prompt) in arrival order: VeRL's ids do not always tell a
        prompt's samples apart (uuids without ``rollout.full_determinism``; ``det-0`` for all in VeRL 0.9.1's V1
        trainer), and the count does, reproducibly up to the arrival order of a prompt's ``n`` samples, which only
        swaps which of them gets which completion."""
        version, seeds = self.global_steps, []
        if any(k[0] != version for k in self._arrivals):
            self._arrivals = {k: c for k, c in self._arrivals.items() if k[0] == version}
        for r in batch:
            # VeRL's deterministic ids, else this replica (its requests' samples differ from another replica's)
            rid = (
                r.request_id
                if (self.full_determinism or r.request_id.startswith("det-"))
                else f"replica-{self.replica_rank}"
            )
            slot = (version, rid, tuple(r.prompt_ids))
            count = self._arrivals.get(slot, 0)
            self._arrivals[slot] = count + 1
            seeds.append(sample_seed_of(self.job_seed, self.rollout_seed, key.seed, version, rid, count, r.prompt_ids))
        return seeds

    def _run_batch(
        self, prompts: list[list[int]], key: Any, seeds: list[int] | None = None
    ) -> list[tuple[list[int], list[float] | None]]:
        if self.shared is not None and not self.shared.resident:
            raise RuntimeError(
                "the native rollout is asleep: sleep() released its weights; sync weights first "
                "(VeRL's checkpoint_manager.update_weights does) or set "
                "actor_rollout_ref.rollout.free_cache_engine=False"
            )
        start = time.perf_counter()
        if self.worker_method is None:
            outs = run_sampler(self.sampler, prompts, key, seeds, threads=self.rl_tpu.threads)
        else:  # the sampler lives in the worker that owns the chip: forward the batch there
            import ray

            outs = ray.get(self.worker_method.remote("native_generate", prompts, key, seeds))
        self.stats["generate_s"] += time.perf_counter() - start
        self.stats["batches"] += 1
        self.stats["generated_tokens"] += sum(len(ids) for ids, _ in outs)
        trim_host_heap()  # the batch's KV cache and logits
        return outs

    # ------------------------------------------------------------- weight sync
    async def update_weights_bucket(
        self, flat: Any, metadata: list, last: bool, global_steps: int | None = None, total: int | None = None
    ) -> int:
        """Receive one packed bucket of weights (from :func:`rl_tpu.collectives.pack_bucket`) and load it.

        ``flat`` is the ``uint8`` bytes (a read-only numpy view of the Ray object store, or a tensor), ``metadata``
        its layout; ``total`` the number of buckets in this sync, given with any of them (a streaming sender knows
        it at the last); the sync ends once that many are loaded (``None`` on all: the one marked ``last`` ends it).
        Each bucket is copied into the model as it arrives, so the object store and this process hold one
        bucket at a time, not a second copy of the model. Generation is held from the first bucket until all
        have been loaded (a batch already running finishes first on the old weights), so no batch ever sees a
        half-updated model. Returns the number of bytes received.
        """
        from verl_backend.weight_sync.object_store import ObjectStore

        if self.trainer_weights is not None:
            raise RuntimeError(
                "this rollout computes on the trainer's weights in shared memory (read-only): a bucket "
                "sync cannot write them; restart the rollout server to sync through the object store"
            )
        if not self._updating:
            self._updating, self._buckets_loaded, self._buckets_total = True, 0, None
        if total is not None:
            self._buckets_total = total
        while self._batch_running:  # never copy weights under a running batch
            await asyncio.sleep(0.005)
        start = time.perf_counter()
        self._buckets_loaded += 1
        total = self._buckets_total
        final = (total is not None and self._buckets_loaded >= total) or (total is None and last)
        self.apply(ObjectStore().receive(flat, metadata), global_steps, final=final)
        if final:
            self._updating = False
            trim_host_heap()
        self.stats["weight_sync_s"] += time.perf_counter() - start
        return int(flat.nbytes)

    # ------------------------------------------ weight sync through shared memory (same host)
    def shared_weights_handle(self) -> dict | None:
        """Where the model's weights live in shared memory (:meth:`rl_tpu.shared_weights.SharedWeights.handle`),
        with this server's Ray node id; ``None`` when they do not (not on CPU, or sampling in the worker)."""
        if self.shared is None:
            return None
        import ray

        return self.shared.handle(node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else None)

    def attach_trainer_weights(self, handle: dict) -> str | None:
        """Compute on the trainer's own parameters from now on: map its shared-memory file (read-only) and make
        every model tensor a view of it, then free this server's copy. A weight sync then copies nothing: the
        optimizer's steps are what the next batch reads (VeRL's colocated loop never generates during an update).

        Args:
            handle: :meth:`rl_tpu.shared_weights.SharedWeights.handle` of the trainer's parameters, with its node id.

        Returns:
            ``None`` once attached; otherwise why not (another host, no CPU sampler here, a name or shape the
            model lacks, the file cannot be opened), and the server keeps its own weights.
        """
        import ray

        from rl_tpu.collectives import weight_mismatch
        from rl_tpu.shared_weights import SharedWeightsReader

        if self.worker_method is not None or self.sampler is None or self.device.type != "cpu":
            return "the sampler does not run on this server's CPU"
        if ray.is_initialized() and handle.get("node_id") != ray.get_runtime_context().get_node_id():
            return (
                "the trainer runs on another host"
                if handle.get("node_id")
                else "the trainer's weights handle names no Ray node (SharedWeights.handle(node_id=...))"
            )
        try:
            reader = SharedWeightsReader(handle)
        except OSError as exc:
            return f"cannot map the trainer's weights ({exc})"
        own = self.sampler._tensors  # name -> Parameter / buffer, every name (tied weights twice)
        first = next(iter(reader.tensors), None)
        for name, tensor in own.items():
            problem = weight_mismatch("trainer weights", name, reader.tensors.get(name), tensor, first)
            if problem or reader.tensors[name].dtype != tensor.dtype:
                reader.close()
                return problem or f"{name!r}: trainer holds {reader.tensors[name].dtype}, rollout {tensor.dtype}"
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.data = reader.tensors[name]
        if self.shared is not None:  # our own file: nothing points into it any more
            self.shared.close()
            self.shared = None
        self.trainer_weights = reader
        self.sampler.weights_changed()
        trim_host_heap()
        return None

    def shared_weights_attached(self) -> None:
        """A trainer on this host has mapped the weights and syncs through them from now on."""
        self._shared_attached = True

    async def begin_weight_update(self) -> None:
        """Hold generation for a shared-memory weight sync; returns once no batch runs (the old weights are free
        to overwrite)."""
        self._updating = True
        while self._batch_running:
            await asyncio.sleep(0.002)
        self._sync_started = time.perf_counter()

    async def end_weight_update(self, written: list[int], global_steps: int | None = None) -> None:
        """The trainer has written the slots ``written``: serve the new weights (tagged ``global_steps``).

        Raises:
            rl_tpu.shared_weights.SharedWeightsError: the weights were released and not all slots were written.
        """
        try:  # written by another process: the sampler's packed copies are stale (weights_live drops them)
            if self.trainer_weights is not None:  # the trainer's own weights (attach_trainer_weights): nothing to check
                from verl_backend.weight_sync.trainer_memory import TrainerMemory

                TrainerMemory().receive(self, global_steps)
            else:
                from verl_backend.weight_sync.shared_memory import SharedMemory

                SharedMemory().receive(self, written, global_steps)
        finally:
            self._updating = False
            self.stats["weight_sync_s"] += time.perf_counter() - self._sync_started

    def apply(self, named_tensors, version: int | None, final: bool = True) -> int:
        """Seam (a): the one place a received ``(name, tensor)`` stream enters this server's sampler
        (:func:`verl_backend.weight_sync.apply.load`); ``final``: the sync's last part, the weights go live
        (:meth:`weights_live`). Returns the bytes loaded."""
        from verl_backend.weight_sync.apply import load

        n = load(self.sampler, named_tensors, version)
        if final:
            from verl_backend.weight_sync.lora import adapter_sync_open, unadapted_for_refill

            if adapter_sync_open():  # LoRA, adapter only: the unadapted weights never change...
                self._adapter_syncs = True
                if self.shared is not None and not self.shared.resident:  # ...unless their pages went while asleep
                    self.sampler.load_state_dict(unadapted_for_refill())  # from the files' page cache, not the wire
                    self.shared.resident = True
            self.weights_live(version, written_elsewhere=False)
        return n

    def weights_live(self, version: int | None, written_elsewhere: bool) -> None:
        """Seam (b): every transport ends here once the new weights are in place: this server serves ``version``
        from now on (:func:`verl_backend.weight_sync.apply.live`, where a verification of the sync runs).
        ``written_elsewhere``: another process wrote them (shared memory): the packed copies are dropped."""
        from verl_backend.weight_sync.apply import live

        self.set_global_steps(version)
        live(self.sampler, version, written_elsewhere)

    def set_global_steps(self, global_steps: int | None) -> None:
        """Record the step of the weights now served (``sampler_placement=worker``: the worker loaded them)."""
        if global_steps is not None:
            self.global_steps = int(global_steps)

    async def verify_sync(self, proof) -> dict:
        """Prove the sync just made live is the trainer's model (:func:`verl_backend.weight_sync.verify.check_sync`: the
        probe through this sampler's own path, fingerprints), generation held meanwhile; returns
        ``weight_sync/verified`` and the verification's metrics ({} when the sampler lives in a worker: the adapter
        verifies there).

        Raises:
            verl_backend.weight_sync.verify.WeightSyncMismatch: one line naming this replica, the version and the
            tensor.
        """
        from verl_backend.weight_sync.verify import check_sync

        if self.sampler is None:
            return {}
        self._updating = True
        try:
            while self._batch_running:
                await asyncio.sleep(0.002)
            result = await asyncio.to_thread(check_sync, self.sampler, proof, self.replica_rank)
        finally:
            self._updating = False
        return result.as_metrics()

    # ------------------------------------------- VeRL's server control surface
    async def wake_up(self):
        return None

    async def sleep(self):
        """VeRL puts the colocated rollout to sleep for the actor update: with ``free_cache_engine`` (VeRL's
        default) and a trainer writing through shared memory, give the weights' pages back to the OS (the next
        sync writes all of them again). The sampler's packed weight copies are dropped whatever the transport (they
        are rebuilt at the next batch, on the synced weights). The KV cache lives only while a batch runs."""
        while self._batch_running or self._updating:
            await asyncio.sleep(0.005)
        if self.sampler is not None:
            self.sampler.weights_changed()
        # a trainer writing all of them, or adapter-only LoRA syncs (which rewrite them from the files): the pages
        # can go while the actor updates
        if (
            self.shared is not None
            and (self._shared_attached or getattr(self, "_adapter_syncs", False))
            and self.free_when_asleep
        ):
            self.shared.release()
        trim_host_heap()

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False):
        self._paused = True

    async def resume_generation(self):
        self._paused = False

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    def get_server_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), 0
