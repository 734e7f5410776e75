"""Narrow patches of VeRL 0.9.1 functions that assume CUDA. Each names the function, the version and why.

Applied by the plugin in every process, each when VeRL imports its target module (post-import hooks, so the
plugin itself imports no heavy VeRL module); each leaves CUDA behaviour unchanged.
"""

from __future__ import annotations

import verl

PATCHED_VERSION = "0.9.1"
_applied = False


def _check_resource_available(self) -> None:
    """Replacement for ``verl.single_controller.ray.base.ResourcePoolManager._check_resource_available``.

    VeRL 0.9.1 counts only ``GPU``/``NPU`` resources, so on CPU or TPU it always reports
    "Total available GPUs 0". This counts the current platform's Ray resource (``CPU``, ``TPU``, ``GPU``) and
    raises one clear error when the cluster is too small, instead of a placement group that waits forever.
    """
    import ray
    from verl.plugin.platform import get_platform

    resource = get_platform().ray_resource_name()
    per_node = ray._private.state.available_resources_per_node()
    available = sum(float(info.get(resource, 0)) for info in per_node.values())
    required = sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
    if available < required:
        raise ValueError(
            f"the Ray cluster has {available:g} {resource} available but the resource pools need {required} "
            f"(trainer.nnodes x trainer.n_gpus_per_node); lower them or add {resource} to the cluster"
        )


def _dedupe_backend(backend: str | None) -> str | None:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: one backend per device type, first one wins."""
    if not backend or ":" not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.partition(":")
        seen.setdefault(device.strip(), name.strip())
    return ",".join(f"{d}:{n}" for d, n in seen.items())


def _make_init_pg_ray(original):
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        """Patched ``verl.utils.distributed.initialize_global_process_group_ray`` (VeRL 0.9.1).

        VeRL builds ``f"cpu:gloo,{device}:{backend}"``, which is ``"cpu:gloo,cpu:gloo"`` on the CPU platform and
        torch rejects duplicate device types. We pass the de-duplicated string.
        """
        if backend is None:
            from verl.utils.device import get_device_name, get_nccl_backend

            backend = f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
        return original(timeout_second=timeout_second, backend=_dedupe_backend(backend))

    initialize_global_process_group_ray.__wrapped__ = original
    return initialize_global_process_group_ray


def _cpu_offload_policy_without_pinning(original_cls):
    def CPUOffloadPolicy(pin_memory: bool = True, **kwargs):  # noqa: N802 - stands in for the class
        """Patched ``CPUOffloadPolicy`` inside ``verl.workers.engine.fsdp.transformer_impl`` (VeRL 0.9.1).

        VeRL gives the reference model ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator and
        raises "Cannot access accelerator device when none is available" on the CPU platform, where the
        parameters already live in host memory. Pinning is dropped there.
        """
        return original_cls(pin_memory=False, **kwargs)

    return CPUOffloadPolicy


def _append_file_logger_init(self, project_name: str, experiment_name: str):
    """Patched ``verl.utils.tracking.FileLogger.__init__`` (VeRL 0.9.1): open the JSONL in append mode.

    VeRL opens ``VERL_FILE_LOGGER_PATH`` with ``"wb"``, so a run resumed from its checkpoint (``verl train``
    restarts after a killed actor) would erase the metrics of every step before the crash.
    """
    import os

    self.project_name, self.experiment_name = project_name, experiment_name
    self.filepath = os.getenv("VERL_FILE_LOGGER_PATH", None)
    if self.filepath is None:
        root = os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", "."))
        os.makedirs(os.path.join(root, project_name), exist_ok=True)
        self.filepath = os.path.join(root, project_name, f"{experiment_name}.jsonl")
    self.fp = open(self.filepath, "ab", buffering=0)


def _trl_has_value_head_model() -> bool:
    """Replacement for ``verl.utils.import_utils.is_trl_available`` (VeRL 0.9.1).

    VeRL treats "trl is importable" as "``AutoModelForCausalLMWithValueHead`` exists" and then imports it while
    building every model; TRL 1.x removed that class, so merely having ``trl`` installed (e.g. for a TRL
    baseline benchmark) made model set-up fail with ImportError. Report trl as available only when the class
    is really there.
    """
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return False
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
    except ImportError:
        try:
            from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
        except ImportError:
            return False
    return True


def _make_load_valuehead_model(original):
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        """Replacement for ``verl.utils.model.load_valuehead_model`` (VeRL 0.9.1), which builds the critic.

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
            local_path, dtype=torch_dtype, config=model_config,
            attn_implementation="sdpa" if attn.startswith("flash_attention") else attn,
            trust_remote_code=trust_remote_code,
        )

    return load_valuehead_model


REPLAY_POLL_S = 0.2


def _make_replay_buffer_init(original):
    def __init__(self, *args, **kwargs):
        """Patched ``verl.trainer.ppo.v1.replay_buffer.ReplayBuffer.__init__`` (VeRL 0.9.1).

        The sync replay buffer waits for finished rollouts by polling TransferQueue every ``poll_interval``
        seconds, hard-coded to 2.0 with no config key: every rollout phase rounds up to a multiple of 2 s
        (~1 s lost per step on average, more with validation). Polling every 0.2 s costs one small Ray call.
        """
        original(self, *args, **kwargs)
        self.poll_interval = min(float(self.poll_interval), REPLAY_POLL_S)

    __init__.__wrapped__ = original
    return __init__


def _make_create_resource_pool(original):
    def create_resource_pool(self) -> None:
        """Patched ``verl.single_controller.ray.base.ResourcePoolManager.create_resource_pool`` (VeRL 0.9.1).

        With ``$RL_TPU_SLICE`` set, a pool shaped ``[chips_per_host] * hosts`` of that slice is a
        :class:`SliceResourcePool`; every other pool (and every pool without the variable) is VeRL's own.
        """
        from verl_backend.settings import current
        from verl_backend.slice_pool import SliceResourcePool, job_slice

        original(self)
        spec = job_slice()
        if spec is None:
            return
        timeout_s = current().slice_timeout_s
        for pool_name, nodes in self.resource_pool_spec.items():
            if list(nodes) == [spec.chips_per_host] * spec.hosts:
                self.resource_pool_dict[pool_name] = SliceResourcePool(
                    spec, name_prefix=pool_name, max_colocate_count=self.max_colocate_count, timeout_s=timeout_s)

    create_resource_pool.__wrapped__ = original
    return create_resource_pool


_init_pg_ray_patched = None


def _patched_init_pg_ray(vdist):
    global _init_pg_ray_patched
    if _init_pg_ray_patched is None:
        original = vdist.initialize_global_process_group_ray
        _init_pg_ray_patched = _make_init_pg_ray(getattr(original, "__wrapped__", original))
    return _init_pg_ray_patched


def _patch_resource_pool_manager(module) -> None:
    module.ResourcePoolManager._check_resource_available = _check_resource_available
    module.ResourcePoolManager.create_resource_pool = _make_create_resource_pool(
        module.ResourcePoolManager.create_resource_pool)


def _patch_replay_buffer(module) -> None:
    module.ReplayBuffer.__init__ = _make_replay_buffer_init(module.ReplayBuffer.__init__)


def _patch_trl_check(module) -> None:
    module.is_trl_available = _trl_has_value_head_model


def _patch_model_utils(module) -> None:
    module.is_trl_available = _trl_has_value_head_model
    module.load_valuehead_model = _make_load_valuehead_model(module.load_valuehead_model)


def _patch_tracking(module) -> None:
    module.FileLogger.__init__ = _append_file_logger_init


def _patch_distributed(module) -> None:
    module.initialize_global_process_group_ray = _patched_init_pg_ray(module)


def _rebind_init_pg_ray(module) -> None:
    """Where VeRL imported the function by name (before or after the patch), bind the patched one."""
    import verl.utils.distributed as vdist

    module.initialize_global_process_group_ray = _patched_init_pg_ray(vdist)


def _patch_trainer_step_hook(module) -> None:
    """VeRL 0.9.1 ``verl/trainer/ppo/v1/trainer_base.py``: ``PPOTrainer.on_step_begin`` is an empty hook (its
    subclasses do not override it); it now also ends a SIGTERM'd run at the step boundary
    (:func:`verl_backend.driver.preemption.at_step_begin`)."""
    from verl_backend.driver.preemption import at_step_begin

    original = module.PPOTrainer.on_step_begin

    def on_step_begin(self):
        at_step_begin(self)
        return original(self)

    module.PPOTrainer.on_step_begin = on_step_begin


def _patch_fsdp_engine_module(module) -> None:
    from verl.utils.device import get_device_name

    if get_device_name() == "cpu":
        module.CPUOffloadPolicy = _cpu_offload_policy_without_pinning(module.CPUOffloadPolicy)


# VeRL module -> what to do once it has been imported. Heavy VeRL modules (its FSDP engine pulls ~2,000 modules,
# ~190 MiB) are never imported by us: each patch waits for the process to import its target, so VeRL's light
# processes (agent loop, reward loop, load balancer, TransferQueue) stay light.
PATCHES = {
    "verl.single_controller.ray.base": _patch_resource_pool_manager,
    "verl.trainer.ppo.v1.replay_buffer": _patch_replay_buffer,
    "verl.models.transformers.monkey_patch": _patch_trl_check,
    "verl.utils.model": _patch_model_utils,
    "verl.utils.tracking": _patch_tracking,
    "verl.utils.distributed": _patch_distributed,
    "verl.workers.engine_workers": _rebind_init_pg_ray,
    "verl.checkpoint_engine.base": _rebind_init_pg_ray,
    "verl.workers.engine.fsdp.transformer_impl": _patch_fsdp_engine_module,
    "verl.trainer.ppo.v1.trainer_base": _patch_trainer_step_hook,
}


def apply() -> None:
    """Apply every patch once each target module is imported (VeRL must be the pinned version).

    Uses post-import hooks (``wrapt.register_post_import_hook``): a target already imported is patched at once.
    """
    global _applied
    if _applied:
        return
    if verl.__version__ != PATCHED_VERSION:
        raise RuntimeError(f"rl-tpu patches target verl=={PATCHED_VERSION}, found {verl.__version__}; pin verl")
    import wrapt

    for name, patch in PATCHES.items():
        wrapt.register_post_import_hook(patch, name)
    _applied = True
