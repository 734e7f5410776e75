"""Narrow patches of VeRL 0.9.1 where it assumes CUDA, flash-attn, TRL's value head or a fresh run (:data:`PATCHES`).

Each wraps VeRL's own function (or replaces the one name it calls) and leaves CUDA behaviour unchanged; each is
applied when the process imports its module (:func:`verl_backend.patches.apply`), so the plugin itself imports no
heavy VeRL module.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from types import ModuleType

from verl_backend.patches.record import Patch, attribute_check, is_marked, mark, resolve, searched, wrap

VERSIONS = "==0.9.1"  # the VeRL release these patches were written against and tested with
NATIVE_ROLLOUT = "verl_backend.rollout.adapter.NativeServerAdapter"
REPLAY_POLL_S = 0.2

#: Per-step metrics this module adds under DAPO's dynamic sampling on the reward
#: (``algorithm.filter_groups.metric=reward``, :func:`graded_group_metrics`): the groups trained on, the groups replaced
#: for having no reward spread, and the sum of the replaced groups' scores (one score a group: its samples all score
#: alike). With VeRL's ``critic/score/mean`` of the groups trained on they give the reward of every group the step
#: graded (:func:`verl_backend.driver.report.graded_reward`). "total"/"sum" in the names make VeRL's
#: ``MetricsAggregator`` add them up over a step's sampling rounds.
KEPT_GROUPS_KEY = "rl_tpu/filter_groups/kept_groups_total"
REPLACED_GROUPS_KEY = "rl_tpu/filter_groups/replaced_groups_total"
REPLACED_SCORE_SUM_KEY = "rl_tpu/filter_groups/replaced_score_sum"

#: rl-tpu features that two patched VeRL methods run, by name: ``resource_pools(manager)`` after
#: ``ResourcePoolManager.create_resource_pool``, ``step_begin(trainer)`` in ``PPOTrainer.on_step_begin``. The plugin
#: (:mod:`verl_backend.workers.plugin`, the floor above that owns them) hands them over through
#: :func:`verl_backend.patches.apply`, so this floor imports nothing of the workers.
FEATURES: dict[str, Callable] = {}


def feature(name: str) -> Callable:
    """The feature ``name`` of :data:`FEATURES`.

    Raises:
        RuntimeError: the plugin did not hand it over (a patched VeRL method ran without
            :func:`verl_backend.patches.apply` being given the features).
    """
    try:
        return FEATURES[name]
    except KeyError:
        raise RuntimeError(
            f"rl-tpu's patch of VeRL runs the feature {name!r}, which the plugin did not hand over "
            "(verl_backend.patches.apply(features=...), called by verl_backend.workers.plugin)"
        ) from None


def _dedupe_backend(backend: str | None) -> str | None:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: one backend per device type, first one wins."""
    if not backend or ":" not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.partition(":")
        seen.setdefault(device.strip(), name.strip())
    return ",".join(f"{d}:{n}" for d, n in seen.items())


def _init_pg_ray(original):
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        """Patched ``verl.utils.distributed.initialize_global_process_group_ray`` (VeRL 0.9.1).

        VeRL builds ``f"cpu:gloo,{device}:{backend}"``, which is ``"cpu:gloo,cpu:gloo"`` on the CPU platform and
        torch rejects duplicate device types. We pass the de-duplicated string.
        """
        if backend is None:
            from verl.utils.device import get_device_name, get_nccl_backend

            backend = f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
        return original(timeout_second=timeout_second, backend=_dedupe_backend(backend))

    return initialize_global_process_group_ray


def _rebind_init_pg_ray(module: ModuleType) -> None:
    """Where VeRL imported the function by name (before or after the patch), bind the patched one."""
    import verl.utils.distributed as vdist

    wrap(vdist, "initialize_global_process_group_ray", _init_pg_ray, _INIT_PG)
    module.initialize_global_process_group_ray = vdist.initialize_global_process_group_ray


def _resource_check(original):
    def _check_resource_available(self) -> None:
        """Patched ``ResourcePoolManager._check_resource_available`` (VeRL 0.9.1).

        VeRL counts only ``GPU``/``NPU`` resources, so on CPU or TPU it always reports "Total available GPUs 0". On
        other platforms this counts the platform's Ray resource (``CPU``, ``TPU``) against VeRL's own
        ``get_n_gpus()`` and raises one clear error when the cluster is too small, instead of a placement group
        that waits forever; on GPU and NPU it is VeRL's check.
        """
        import ray
        from verl.plugin.platform import get_platform

        resource = get_platform().ray_resource_name()
        if resource in ("GPU", "NPU"):
            return original(self)
        available = float(ray.available_resources().get(resource, 0))  # summed over the nodes, as VeRL's per node
        required = self.get_n_gpus()
        if available < required:
            raise ValueError(
                f"the Ray cluster has {available:g} {resource} available but the resource pools need {required} "
                f"(trainer.nnodes x trainer.n_gpus_per_node); lower them or add {resource} to the cluster"
            )

    return _check_resource_available


def _create_resource_pool(original):
    def create_resource_pool(self) -> None:
        """Patched ``verl.single_controller.ray.base.ResourcePoolManager.create_resource_pool`` (VeRL 0.9.1): VeRL's
        pools, then the plugin's feature ``resource_pools`` (:data:`FEATURES`: the pools of ``rl_tpu.slice`` and
        ``rl_tpu.rollout_slice`` reserved whole, :func:`verl_backend.workers.slice_pool.place_pools_on_slices`)."""
        original(self)
        feature("resource_pools")(self)

    return create_resource_pool


def _replay_buffer_init(original):
    def __init__(self, *args, **kwargs):
        """Patched ``verl.trainer.ppo.v1.replay_buffer.ReplayBuffer.__init__`` (VeRL 0.9.1).

        The sync replay buffer waits for finished rollouts by polling TransferQueue every ``poll_interval``
        seconds, hard-coded to 2.0 with no config key: every rollout phase rounds up to a multiple of 2 s
        (~1 s lost per step on average, more with validation). Polling every 0.2 s costs one small Ray call.
        """
        original(self, *args, **kwargs)
        self.poll_interval = min(float(self.poll_interval), REPLAY_POLL_S)
        if self.filter_groups_metric is not None and self.refill_fn is not None:
            self.refill_fn = bounded_refill(self.refill_fn)
        from verl.trainer.ppo.v1 import replay_buffer

        if self.filter_groups_metric == replay_buffer.FILTER_GROUPS_REWARD_METRIC:
            self.sample = graded_group_metrics(self.sample, replay_buffer.DAPO_FILTERED_REWARD_COUNTS_KEY)

    return __init__


def graded_group_metrics(sample: Callable, counts_key: str) -> Callable:
    """``sample`` (VeRL 0.9.1's ``ReplayBuffer.sample``, bound) whose training metrics also count the groups the step
    graded, so the reward of all of them can be plotted: under DAPO's dynamic sampling ``critic/score/mean`` is the
    mean over the groups kept for having a reward spread, which stays near the middle while the model learns; the
    groups it replaced (all samples right, or all wrong) show the learning, and VeRL passes their scores only to a
    wandb table (``DapoFilteredRewardTableLogger``; other loggers drop them).

    Adds :data:`KEPT_GROUPS_KEY` (``batch_size``, groups), :data:`REPLACED_GROUPS_KEY` (groups) and
    :data:`REPLACED_SCORE_SUM_KEY` (the sum of each replaced group's shared score) to the metrics of a ``"train"``
    sample, from VeRL's ``{shared score: group count}`` diagnostic under ``counts_key``. Groups sampled beyond the
    step's batch (VeRL's ``discarded_surplus_samples``) are graded by no one and counted nowhere here.
    """

    def sample_counting(global_steps: int, partition_id: str, batch_size: int):
        batch, metrics = sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
        if partition_id != "val":
            counts = metrics.get(counts_key) or {}
            metrics[KEPT_GROUPS_KEY] = int(batch_size)
            metrics[REPLACED_GROUPS_KEY] = int(sum(int(n) for n in counts.values()))
            metrics[REPLACED_SCORE_SUM_KEY] = float(sum(float(v) * int(n) for v, n in counts.items()))
        return batch, metrics

    return sample_counting


def bounded_refill(refill_fn: Callable[[int], int]) -> Callable[[int], int]:
    """``refill_fn`` (VeRL 0.9.1's ``PPOTrainer._add_prompts_to_generate``, bound to the trainer) with DAPO's bound on
    generation batches a step, ``algorithm.filter_groups.max_num_gen_batches``, taking effect.

    With DAPO's dynamic sampling (``algorithm.filter_groups.enable=true``) VeRL's V1 replay buffer replaces every
    group whose rewards are all equal with fresh prompts until ``data.train_batch_size`` groups have a spread, and it
    ignores ``max_num_gen_batches`` (it logs so): a model that gets every prompt right, or none, makes the step
    generate forever. Here the step's prompts (its first batch and every refill, counted per
    ``trainer.global_steps``) may come to ``max_num_gen_batches * data.train_batch_size``; the refill past that raises,
    as VeRL's DAPO recipe does. ``max_num_gen_batches <= 0``: no bound (VeRL's default), ``refill_fn`` unchanged.

    Raises (from the returned function):
        BadInputError: the step would pass the bound; the message names the key, the step and the fix.
    """
    trainer = getattr(refill_fn, "__self__", None)
    if trainer is None:
        return refill_fn
    limit = int(trainer.config.algorithm.filter_groups.get("max_num_gen_batches", 0) or 0)
    batch = int(trainer.config.data.train_batch_size)
    if limit <= 0:
        return refill_fn
    prompts: dict[int, int] = {}  # step -> prompts refilled in it

    def refill(count: int) -> int:
        from verl_backend.errors import BadInputError

        step = int(trainer.global_steps)
        prompts[step] = prompts.get(step, 0) + count
        if batch + prompts[step] > limit * batch:
            raise BadInputError(
                f"algorithm.filter_groups.max_num_gen_batches={limit}: step {step} has generated {limit} batches "
                f"of {batch} prompts and fewer than {batch} of their groups had a reward spread, the only groups "
                "DAPO's dynamic sampling trains on: the task is too easy or too hard for the model now. Raise "
                "algorithm.filter_groups.max_num_gen_batches (0: no bound), or set algorithm.filter_groups.enable=false"
            )
        return refill_fn(count)

    return refill


def _value_head_class_importable() -> bool:
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead
    except ImportError:
        try:
            from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
        except ImportError:
            return False
    return True


def _trl_with_value_head(original):
    def is_trl_available() -> bool:
        """Patched ``is_trl_available`` as ``verl.utils.model`` and ``verl.models.transformers.monkey_patch`` see it.

        VeRL treats "trl is importable" as "``AutoModelForCausalLMWithValueHead`` exists" and then imports it while
        building every model; TRL 1.x removed that class, so merely having ``trl`` installed (e.g. for a TRL
        baseline benchmark) made model set-up fail with ImportError. VeRL's answer, and the class is really there.
        """
        return bool(original()) and _value_head_class_importable()

    return is_trl_available


def _load_valuehead_model(original):
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        """Patched ``verl.utils.model.load_valuehead_model`` (VeRL 0.9.1), which builds the critic.

        VeRL loads it as ``AutoModelForTokenClassification`` with ``attn_implementation="flash_attention_2"``
        hard-coded and, when that fails, falls back to TRL's value-head wrapper (gone in TRL 1.x). Without
        flash-attn (CPU, TPU) no critic could be built at all. When flash-attn is not installed, load it with the
        model config's own attention implementation (``sdpa`` from the backend defaults) instead.
        """
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return original(local_path, torch_dtype, model_config, trust_remote_code)
        from transformers import AutoModelForTokenClassification

        attn = getattr(model_config, "_attn_implementation", None) or "sdpa"
        return AutoModelForTokenClassification.from_pretrained(
            local_path,
            dtype=torch_dtype,
            config=model_config,
            attn_implementation="sdpa" if attn.startswith("flash_attention") else attn,
            trust_remote_code=trust_remote_code,
        )

    return load_valuehead_model


def _append_instead_of_truncate(file, mode="r", *args, **kwargs):
    """``open`` as ``verl.utils.tracking`` sees it (VeRL 0.9.1): mode ``"wb"`` becomes ``"ab"``.

    ``FileLogger.__init__`` opens ``VERL_FILE_LOGGER_PATH`` with ``"wb"`` (its only ``"wb"``), so a run resumed
    from its checkpoint (``verl train`` restarts after a killed actor) would erase the metrics of every step
    before the crash.
    """
    return builtins.open(file, "ab" if mode == "wb" else mode, *args, **kwargs)


def _cpu_offload_policy_without_pinning(original_cls):
    def CPUOffloadPolicy(pin_memory: bool = True, **kwargs):  # stands in for the class
        """Patched ``CPUOffloadPolicy`` inside ``verl.workers.engine.fsdp.transformer_impl`` (VeRL 0.9.1).

        VeRL gives the reference model ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator and
        raises "Cannot access accelerator device when none is available" on the CPU platform, where the
        parameters already live in host memory. Pinning is dropped there.
        """
        return original_cls(pin_memory=False, **kwargs)

    return CPUOffloadPolicy


def _on_cpu() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


def _save_to_cpu(original):
    def fsdp2_sharded_save_to_cpu(model):
        """Patched ``verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu`` (VeRL 0.9.1), with which ``separate_async``'s
        ``DetachActorWorker`` keeps pi_old across a sync cycle's mini-batches (bypass mode off).

        VeRL copies each shard with ``.cpu()``, which returns the tensor itself when it is on the CPU already (the
        CPU backend, the TPU dry run): the saved pi_old then moved with every update, and later mini-batches' old
        log-probs were silently the current policy's. A shard that shares the live parameter's storage is cloned. A
        module without DTensor parameters (``rl_tpu.plain_module``, one rank) is saved as clones with spec ``None``,
        where VeRL asserted.

        Returns:
            ``({name: (tensor, DTensorSpec | None)}, DTensorSpec | None)`` as VeRL's.
        """
        from torch.distributed.tensor import DTensor

        params = dict(model.named_parameters())
        if not any(isinstance(p, DTensor) for p in params.values()):
            return {n: (p.detach().clone(), None) for n, p in params.items()}, None
        state, spec = original(model)
        for name, (tensor, shard_spec) in state.items():
            live = params[name].to_local() if isinstance(params[name], DTensor) else params[name]  # same storage
            if tensor.untyped_storage().data_ptr() == live.untyped_storage().data_ptr():
                state[name] = (tensor.clone(), shard_spec)
        return state, spec

    return fsdp2_sharded_save_to_cpu


def _load_from_cpu(original):
    def fsdp2_sharded_load_from_cpu(model, cpu_sharded_state, target_spec):
        """Patched ``verl.utils.fsdp_utils.fsdp2_sharded_load_from_cpu`` (VeRL 0.9.1): a state saved from a module
        without DTensor parameters (spec ``None``, :func:`_save_to_cpu`) is copied back into its parameters; any
        other is VeRL's."""
        if target_spec is not None:
            return original(model, cpu_sharded_state, target_spec)
        import torch

        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in cpu_sharded_state:
                    param.copy_(cpu_sharded_state[name][0])
        return None

    return fsdp2_sharded_load_from_cpu


def _step_begin_hook(original):
    def on_step_begin(self):
        """Patched ``PPOTrainer.on_step_begin`` (VeRL 0.9.1, an empty hook its subclasses do not override): it
        also runs the plugin's feature ``step_begin`` (:data:`FEATURES`: a SIGTERM'd run ends at the step boundary,
        :func:`verl_backend.workers.preemption.at_step_begin`)."""
        feature("step_begin")(self)
        return original(self)

    return on_step_begin


def _worker_sync_metrics(original):
    import functools

    @functools.wraps(original)  # keeps VeRL's dispatch attributes (register)
    async def update_weights(self, *args, **kwargs):
        """Patched ``ActorRolloutRefWorker.update_weights`` (VeRL 0.9.1): its colocated (``naive``) path returns
        nothing; the native adapter's figures of the sync (``weight_sync/{route,bytes,seconds,verified}``,
        :meth:`verl_backend.weight_sync.SyncReport.as_metrics`) are returned instead, as the ``gloo`` engine's are."""
        result = await original(self, *args, **kwargs)
        if result is None:
            result = dict(getattr(getattr(self, "rollout", None), "last_metrics", None) or {}) or None
        return result

    return update_weights


def _manager_sync_metrics(original):
    from verl.utils.ray_utils import auto_await

    raw = getattr(original, "__wrapped__", original)  # the coroutine function under auto_await

    async def update_weights(self, global_steps: int = None):
        """Patched ``CheckpointEngineManager.update_weights`` (VeRL 0.9.1): the colocated (``naive``) sync also
        merges what the trainer workers return (the patched worker's ``weight_sync/*``), returns it and keeps it for
        the step's metrics (:func:`_consume_with_naive_sync`); other engines unchanged."""
        if self.backend != "naive":
            return await raw(self, global_steps=global_steps)
        import ray

        merged: dict = {}
        for result in ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)):
            if isinstance(result, dict):
                merged.update(result)
        self._rl_tpu_sync_metrics = merged
        return merged

    return auto_await(update_weights)


def _consume_with_naive_sync(original):
    def _consume_sync_metrics(self):
        """Patched ``PPOTrainer._consume_sync_metrics`` (VeRL 0.9.1): the colocated sync's ``weight_sync/*`` (kept
        by the patched manager, whose return the sync trainers drop) join the step's metrics, as the separate pools'
        do."""
        metrics = dict(original(self) or {})
        for name in ("checkpoint_manager", "standalone_checkpoint_manager"):
            manager = getattr(self, name, None)
            pending = getattr(manager, "_rl_tpu_sync_metrics", None)
            if pending:
                manager._rl_tpu_sync_metrics = {}
                for key, value in pending.items():
                    metrics.setdefault(key, value)
        return metrics

    return _consume_sync_metrics


# the reward function's per-sample accuracy keys that the training rollout dump carries (verl_backend/data/rewards.py)
ACCURACY_KEYS = ("acc", "acc_strict")


def _rollout_dump_with_accuracy(original):
    def _log_rollout_data(self, batch, timing_raw, rollout_data_dir):
        """Patched ``PPOTrainer._log_rollout_data`` (VeRL 0.9.1): its training rollout dump keeps only the reward's
        sum, though the reward function's other keys are in TransferQueue beside it (each sample's
        ``extra_fields["reward_extra_info"]``, which the validation dump writes). Each line gains the reward
        function's ``acc`` and ``acc_strict`` where it gave them, so the console's step line counts accuracy, not
        reward (a format reward gives a right bare number half). A reward function without them leaves the dump as
        VeRL writes it."""
        try:
            by_uid = _reward_accuracy(batch)
        except Exception as exc:  # the dump as VeRL writes it; the step line then counts full-reward samples
            if not getattr(self, "_rl_tpu_accuracy_warned", False):
                self._rl_tpu_accuracy_warned = True
                print(
                    f"[rl-tpu] warning: the rollout dump has no accuracy ({type(exc).__name__}: {exc}); the step "
                    "line's accuracy counts full-reward samples",
                    flush=True,
                )
            by_uid = {}
        if not by_uid:
            return original(self, batch, timing_raw, rollout_data_dir)
        dump = self._dump_generations

        def with_accuracy(*args, reward_extra_infos_dict, **kwargs):
            uids = reward_extra_infos_dict.get("uid") or []
            for key in ACCURACY_KEYS:
                reward_extra_infos_dict[key] = [by_uid.get(uid, {}).get(key) for uid in uids]
            return dump(*args, reward_extra_infos_dict=reward_extra_infos_dict, **kwargs)

        self._dump_generations = with_accuracy  # this call only: the instance attribute shadows the method
        try:
            return original(self, batch, timing_raw, rollout_data_dir)
        finally:
            del self._dump_generations

    return _log_rollout_data


def _reward_accuracy(batch) -> dict[str, dict[str, float]]:
    """Sample key -> the reward function's :data:`ACCURACY_KEYS` it gave, from TransferQueue's ``extra_fields`` of
    ``batch`` (VeRL 0.9.1's agent loop puts the reward function's dict there as ``reward_extra_info``); ``{}`` where
    no sample has them."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    out = {}
    for uid, extra in zip(batch.keys, _as_list(data["extra_fields"])):
        info = extra.get("reward_extra_info") if isinstance(extra, dict) else None
        found = {
            k: float(info[k]) for k in ACCURACY_KEYS if isinstance(info, dict) and isinstance(info.get(k), (int, float))
        }
        if found:
            out[uid] = found
    return out


def _as_list(values) -> list:
    """A TransferQueue field as a Python list (a NonTensorStack, a tensor or a numpy array)."""
    return list(values.tolist() if hasattr(values, "tolist") else values)


def _wrapping(
    module: str, path: str, make: Callable, why: str, upstream: str, when: Callable[[], bool] | None = None
) -> Patch:
    """The record of a patch that wraps ``module.path`` (``"Cls.attr"`` or ``"name"``) with ``make(original)``;
    with ``when``, only where it returns true (elsewhere the patch counts as in place)."""
    target = f"{module}.{path}"
    owner_path, _, name = path.rpartition(".")
    check = attribute_check(path, target)

    def apply(mod: ModuleType) -> None:
        if when is None or when():
            wrap(resolve(mod, owner_path), name, make, target)

    def applied(mod: ModuleType) -> bool:
        return (when is not None and not when()) or check(mod)

    return Patch(
        target=target,
        module=module,
        library="verl",
        versions=VERSIONS,
        why=why,
        upstream=upstream,
        apply=apply,
        applied=applied,
    )


def _default_model_here(original):
    def copy_local_path_from_hdfs(src, *args, **kwargs):
        """Patched ``verl.utils.fs.copy_local_path_from_hdfs`` (VeRL 0.9.1), which every ``copy_to_local`` of a
        model path calls (``HFModelConfig``, the engine, the reward loop): the job's default model folder, missing on
        this host, is converted here first (:func:`verl_backend.models.convert_default_model_here`)."""
        from verl_backend.models import convert_default_model_here

        convert_default_model_here(src)
        return original(src, *args, **kwargs)

    return copy_local_path_from_hdfs


_INIT_PG = "verl.utils.distributed.initialize_global_process_group_ray"
_NO_SYNC_METRICS_ISSUE = searched(
    "verl-project/verl", "verl checkpoint engine naive update_weights returns no metrics weight sync timing"
)
_TRACKING_OPEN = "verl.utils.tracking.open"
_ROLLOUT = "verl.workers.rollout.base._ROLLOUT_REGISTRY"
mark(_append_instead_of_truncate, _TRACKING_OPEN)


def _rebinding(module: str) -> Patch:
    return Patch(
        target=f"{module}.initialize_global_process_group_ray",
        module=module,
        library="verl",
        versions=VERSIONS,
        why="binds the patched process-group init where VeRL imported it by name",
        upstream="https://github.com/verl-project/verl/issues/6237",
        apply=_rebind_init_pg_ray,
        applied=attribute_check("initialize_global_process_group_ray", _INIT_PG),
    )


def _set_tracking_open(module: ModuleType) -> None:
    module.open = _append_instead_of_truncate


def _register_native_rollout(module: ModuleType) -> None:
    module._ROLLOUT_REGISTRY[("native", "async")] = NATIVE_ROLLOUT


# Heavy VeRL modules (its FSDP engine pulls ~2,000 modules, ~190 MiB) are never imported by us: each patch waits for
# the process to import its module, so VeRL's light processes (agent loop, reward loop, TransferQueue) stay light.
PATCHES: tuple[Patch, ...] = (
    _wrapping(
        "verl.single_controller.ray.base",
        "ResourcePoolManager._check_resource_available",
        _resource_check,
        "VeRL counts only GPU/NPU Ray resources: on CPU/TPU it sees 0 and refuses",
        searched(
            "verl-project/verl",
            "verl ResourcePoolManager _check_resource_available Total available GPUs 0 CPU TPU",
            "#539 and #746 report the message on GPUs, for another cause",
        ),
    ),
    _wrapping(
        "verl.single_controller.ray.base",
        "ResourcePoolManager.create_resource_pool",
        _create_resource_pool,
        "a pool of a TPU slice (rl_tpu.slice) is reserved whole with ray.util.tpu's slice placement (rl-tpu feature)",
        searched(
            "verl-project/verl",
            "verl TPU slice resource pool placement group ray.util.tpu",
            "Ray's slice placement is https://github.com/ray-project/ray/pull/56723",
        ),
    ),
    _wrapping(
        "verl.trainer.ppo.v1.replay_buffer",
        "ReplayBuffer.__init__",
        _replay_buffer_init,
        "the replay buffer polls TransferQueue every 2 s, hard-coded; and with DAPO's dynamic sampling it ignores "
        "algorithm.filter_groups.max_num_gen_batches, so a step refills forever where no group has a reward spread",
        searched(
            "verl-project/verl",
            "verl replay buffer poll_interval 2 seconds hard-coded TransferQueue",
            "V1's DAPO refill is https://github.com/verl-project/verl/pull/7082, which leaves max_num_gen_batches out",
        ),
    ),
    _wrapping(
        "verl.models.transformers.monkey_patch",
        "is_trl_available",
        _trl_with_value_head,
        "with TRL 1.x installed VeRL imports AutoModelForCausalLMWithValueHead, which TRL removed",
        "https://github.com/verl-project/verl/issues/5690",
    ),
    _wrapping(
        "verl.utils.model",
        "is_trl_available",
        _trl_with_value_head,
        "with TRL 1.x installed VeRL imports AutoModelForCausalLMWithValueHead, which TRL removed",
        "https://github.com/verl-project/verl/issues/5690",
    ),
    _wrapping(
        "verl.utils.model",
        "load_valuehead_model",
        _load_valuehead_model,
        "the critic is loaded with attn_implementation='flash_attention_2' hard-coded",
        "https://github.com/verl-project/verl/issues/5210",
    ),
    Patch(
        target=_TRACKING_OPEN,
        module="verl.utils.tracking",
        library="verl",
        versions=VERSIONS,
        why="FileLogger opens metrics.jsonl with 'wb': a resumed run erased the steps before it",
        upstream=searched("verl-project/verl", "verl FileLogger metrics jsonl overwritten on resume open wb"),
        apply=_set_tracking_open,
        applied=lambda m: is_marked(m.__dict__.get("open"), _TRACKING_OPEN),
    ),
    _wrapping(
        "verl.utils.distributed",
        "initialize_global_process_group_ray",
        _init_pg_ray,
        "VeRL's backend string is 'cpu:gloo,cpu:gloo' on CPU, which torch rejects (duplicate device type)",
        "https://github.com/verl-project/verl/issues/6237",
    ),
    _wrapping(
        "verl.utils.fs",
        "copy_local_path_from_hdfs",
        _default_model_here,
        "the default model's folder is converted on the driver's host only: a worker on another host converts "
        "it where VeRL makes a model path local (rl-tpu feature)",
        searched(
            "verl-project/verl", "verl copy_to_local model path missing on worker node multi-node local model not found"
        ),
    ),
    _rebinding("verl.workers.engine_workers"),
    _rebinding("verl.checkpoint_engine.base"),
    _wrapping(
        "verl.workers.engine.fsdp.transformer_impl",
        "CPUOffloadPolicy",
        _cpu_offload_policy_without_pinning,
        "the reference model's CPUOffloadPolicy(pin_memory=True) needs an accelerator",
        searched(
            "verl-project/verl",
            "verl CPUOffloadPolicy pin_memory=True Cannot access accelerator device when none is available",
        ),
        when=_on_cpu,
    ),
    _wrapping(
        "verl.utils.fsdp_utils",
        "fsdp2_sharded_save_to_cpu",
        _save_to_cpu,
        "separate_async's DetachActorWorker saves pi_old with .cpu(), a no-op copy for CPU tensors (the saved "
        "policy moved with each update), and asserts FSDP2 DTensors",
        searched(
            "verl-project/verl",
            "verl fsdp2_sharded_save_to_cpu cpu() no copy aliasing old policy",
            "related: https://github.com/verl-project/verl/pull/7251, the same helpers' DTensor-only "
            "assert for FSDP1, closed",
        ),
    ),
    _wrapping(
        "verl.utils.fsdp_utils",
        "fsdp2_sharded_load_from_cpu",
        _load_from_cpu,
        "restores the plain-module state the patched save makes",
        searched(
            "verl-project/verl",
            "verl fsdp2_sharded_save_to_cpu cpu() no copy aliasing old policy",
            "related: https://github.com/verl-project/verl/pull/7251, closed",
        ),
    ),
    _wrapping(
        "verl.trainer.ppo.v1.trainer_base",
        "PPOTrainer.on_step_begin",
        _step_begin_hook,
        "SIGTERM ends the run at the next step boundary with a checkpoint (rl-tpu feature through VeRL's empty hook)",
        searched("verl-project/verl", "verl SIGTERM preemption graceful checkpoint at step boundary"),
    ),
    _wrapping(
        "verl.workers.engine_workers",
        "ActorRolloutRefWorker.update_weights",
        _worker_sync_metrics,
        "the colocated (naive) weight sync returns no figures: weight_sync/{route,bytes,seconds,verified} "
        "reach metrics.jsonl as the gloo engine's do (rl-tpu feature)",
        _NO_SYNC_METRICS_ISSUE,
    ),
    _wrapping(
        "verl.checkpoint_engine.base",
        "CheckpointEngineManager.update_weights",
        _manager_sync_metrics,
        "the naive branch drops what the trainer workers return",
        _NO_SYNC_METRICS_ISSUE,
    ),
    _wrapping(
        "verl.trainer.ppo.v1.trainer_base",
        "PPOTrainer._consume_sync_metrics",
        _consume_with_naive_sync,
        "the sync trainers drop update_weights' return: the colocated sync's figures join the step's metrics",
        _NO_SYNC_METRICS_ISSUE,
    ),
    _wrapping(
        "verl.trainer.ppo.v1.trainer_base",
        "PPOTrainer._log_rollout_data",
        _rollout_dump_with_accuracy,
        "the training rollout dump drops the reward function's other keys (acc, acc_strict), which the "
        "validation dump keeps: the console's step accuracy would be the reward's",
        searched(
            "verl-project/verl", "verl v1 trainer _log_rollout_data rollout_data_dir reward_extra_info missing acc"
        ),
    ),
    Patch(
        target=f"{_ROLLOUT}[('native', 'async')]",
        module="verl.workers.rollout.base",
        library="verl",
        versions=VERSIONS,
        why="VeRL 0.9.1 has no public call to add a rollout: get_rollout_class reads this private dict",
        upstream=searched(
            "verl-project/verl", "verl register custom rollout _ROLLOUT_REGISTRY get_rollout_class plugin"
        ),
        apply=_register_native_rollout,
        applied=lambda m: m._ROLLOUT_REGISTRY.get(("native", "async")) == NATIVE_ROLLOUT,
    ),
)
