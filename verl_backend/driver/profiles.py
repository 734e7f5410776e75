"""Backend profiles: what ``verl train --backend cpu|tpu|cuda`` means, one row per backend.

Each :class:`BackendProfile` holds a backend's choices as data: VeRL's platform name, the VeRL keys a user should not
have to know (applied *before* the ``--config`` file and the command line, so any of them can be overridden with
VeRL's own keys), the job run when no ``--config`` is given, the thread count, how TPU slices apply, which of the
CPU host-memory machinery applies, and how the backend's presence is checked. The driver reads the row; nothing else
branches on the backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from verl_backend.errors import BadInputError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# fp32 everywhere on CPU: there is no bf16 matmul hardware on most CPUs (emulated bf16 is slower), and the
# rollout's log-probs then match the trainer's.
_FP32_MP = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"

# The TPU sampler: inside the worker that owns the chip (trainer worker, or a rollout slice's), bucketed and padded
# (no CPU fast path; see rl_tpu/sampler/engine.py).
TPU_SAMPLER = "{sampler_placement:worker,packed_prefill:false,lean_decode:false,packed_weights:false}"

#: the micro batch sizes (sequences a chip runs at once) the tpu row sets: the actor's update, the old policy's and
#: the reference's log-prob forward, the critic's update (its values forward follows it, VeRL's own interpolation)
TPU_MICRO_KEYS = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
)

COMMON: dict[str, str] = {
    "actor_rollout_ref.rollout.name": "native",
    "actor_rollout_ref.rollout.mode": "async",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "actor_rollout_ref.rollout.data_parallel_size": "1",
    "actor_rollout_ref.rollout.max_num_seqs": "64",
    # Our server loads real weights from the model path, then receives every update from the trainer.
    "actor_rollout_ref.rollout.load_format": "auto",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": "64",  # x2 in flight
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "critic.strategy": "fsdp2",
    # FlashAttention2 is VeRL's default and exists only on CUDA.
    "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
    "+critic.model.override_config.attn_implementation": "sdpa",
    "trainer.nnodes": "1",
    # VeRL starts 8 agent-loop and 8 reward workers and 8 data-loader processes by default: each imports
    # torch + VeRL (~0.5 GiB, ~15 s); one of each serves a single-host job.
    "actor_rollout_ref.rollout.agent.num_workers": "1",
    "reward.num_workers": "1",
    "data.dataloader_num_workers": "0",
    "reward.custom_reward_function.path": "pkg://verl_backend.data.rewards",
    "reward.custom_reward_function.name": "guarded_score",
    "trainer.logger": "[console,file,tensorboard]",
    "actor_rollout_ref.actor.checkpoint.save_contents": "[model,optimizer,extra,hf_model]",
    # VeRL's TransferQueue starts 8 storage-unit actors (~0.3 GiB each); one serves a single-host job.
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": "1",
    # Reproducible by default (docs/reproducibility.md): data.seed is the job's seed (VeRL's own is null: an
    # unseeded data order). Not rollout.full_determinism: VeRL 0.9.1's V1 trainer then names every request det-0,
    # which tells no samples apart and routes them all to one replica.
    "data.seed": "1",
}

_OVERRIDES: dict[str, dict[str, str]] = {
    "cpu": {
        **COMMON,
        "trainer.device": "cpu",
        "trainer.n_gpus_per_node": "1",
        "actor_rollout_ref.rollout.dtype": "float32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision": _FP32_MP,
        "+actor_rollout_ref.ref.fsdp_config.mixed_precision": _FP32_MP,
        "+critic.fsdp.mixed_precision": _FP32_MP,  # the critic engine's FSDPEngineConfig (VeRL 0.9.1)
        "actor_rollout_ref.actor.use_torch_compile": "false",
        "actor_rollout_ref.ref.use_torch_compile": "false",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "false",
        "critic.model.enable_gradient_checkpointing": "false",
        # Remove-padding: each micro batch is one packed row, no pad tokens computed (the default job's micro
        # batches were ~25% padding). No flash-attn: transformers >= 5 keeps packed sequences apart in sdpa with
        # a block-diagonal causal mask built from the position ids (the engine's tests check each sequence's
        # log-probs against it run alone).
        "actor_rollout_ref.model.use_remove_padding": "true",
        "critic.model.use_remove_padding": "true",
        # GRPO's n samples of a prompt share one copy of it in the packed row (Prefix Grouper's shared-prefix
        # forward, VeRL's own key; see verl_backend.workers.shared_prefix): the prompt's forward and
        # backward run once per group instead of n times, for the same log-probs and gradients.
        "actor_rollout_ref.actor.use_prefix_grouper": "true",
        # torch's fused AdamW kernel (CPU since torch 2.4): one pass over each parameter instead of foreach's
        # full-size temporaries; measured 0.09 s against 0.66 s a step for 135M parameters on one thread.
        "actor_rollout_ref.actor.optim.override_optimizer_config": "{fused:true}",
        "critic.optim.override_optimizer_config": "{fused:true}",
        # The native rollout samples with the trainer's own fp32 weights (synced after every update), so its
        # per-token log-probs ARE the old-policy log-probs (measured max |diff| ~1e-10): reuse them instead of a
        # second forward pass over the batch. VeRL's bypass mode with the PPO-clip loss, ratio pi_theta/pi_old.
        "algorithm.rollout_correction.bypass_mode": "true",
        "algorithm.rollout_correction.loss_type": "ppo_clip",
    },
    "tpu": {
        **COMMON,
        "trainer.device": "tpu",
        # Padded micro batches: a packed row's length changes every step, and each length is an XLA compile.
        "actor_rollout_ref.model.use_remove_padding": "false",
        "critic.model.use_remove_padding": "false",
        # One worker process per chip (whole chips: Ray refuses fractional TPU requests).
        "trainer.n_gpus_per_node": "4",
        "actor_rollout_ref.rollout.dtype": "bfloat16",
        "actor_rollout_ref.actor.use_torch_compile": "false",
        # A worker owns its chip: sample inside it, forwarded by the rollout server (see rollout/inworker.py). The
        # sampler keeps bucketed static shapes: the CPU fast paths (packed prefill, lean decode, oneDNN-packed
        # weights) are off, stated here rather than left to the sampler's per-device default.
        "+actor_rollout_ref.rollout.engine_kwargs.native": TPU_SAMPLER,
        "actor_rollout_ref.rollout.checkpoint_engine.backend": "native",
        # VeRL's own defaults, stated: the trainer recomputes the old log-probs (the bf16 rollout's are not the
        # actor's), and each sequence keeps its own copy of its prompt (no Prefix Grouper).
        "algorithm.rollout_correction.bypass_mode": "false",
        "actor_rollout_ref.actor.use_prefix_grouper": "false",
        # Sequences a chip runs at once: VeRL sets none, so its own defaults (GAE, 1024 x 1 prompts) were refused
        # for the critic, and a forward without one holds a worker's whole share (128 sequences of 1024 tokens on
        # v6e-8: 40.7 GiB of logits a chip in the memory plan). At 8 the default job's largest trainer graph holds
        # 2.4 GiB (7% of a v6e chip's HBM, docs/tpu.md) and there is one compiled shape per length bucket; a smaller
        # batch share is fitted to (plan.fit_default_micro_batches), a VeRL *_micro_batch_size (global) or dynamic
        # batch the user gives wins.
        **{key: "8" for key in TPU_MICRO_KEYS},
        # Mixture-of-experts blocks as transformers' batched_mm, not its grouped_mm: grouped_mm's torch.cumsum lowers
        # to chlo.scan, which libtpu 0.0.52 refuses (rl_tpu.expert_slices; docs/tpu.md, "MoE on TPU"). A config
        # attribute, as VeRL sets override_config; no effect on a model without experts.
        "+actor_rollout_ref.model.override_config._experts_implementation": "batched_mm",
        "+critic.model.override_config._experts_implementation": "batched_mm",
    },
    "cuda": {
        "trainer.device": "cuda",
        "actor_rollout_ref.rollout.name": "native",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
        "actor_rollout_ref.rollout.load_format": "auto",
        "actor_rollout_ref.actor.strategy": "fsdp2",
        "critic.strategy": "fsdp2",
        "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "+critic.model.override_config.attn_implementation": "sdpa",
    },
}


def _no_check() -> None:
    return None


def _require_tpu() -> None:
    from rl_tpu.device import DeviceError, require_tpu

    try:
        require_tpu()
    except DeviceError as exc:
        raise BadInputError(str(exc)) from None


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise BadInputError("--backend cuda: no CUDA GPU visible; use --backend cpu, or run on a GPU machine")


@dataclass(frozen=True)
class BackendProfile:
    """One backend of ``verl train``.

    Attributes:
        name: the ``--backend`` value.
        platform: VeRL's platform name (``VERL_PLATFORM``; rl-tpu's platforms register ``cpu`` and ``tpu``).
        overrides: VeRL keys applied before the user's (Hydra syntax, ``+`` for keys VeRL lacks).
        default_config: the job YAML run when no ``--config`` is given (``None``: VeRL's own defaults).
        default_threads: torch threads per process when ``rl_tpu.num_threads`` is 0, at most: no more than this
            host's cores over the trainer workers on it (:func:`default_threads`; 0: torch's own count).
        slices: ``"auto"``: a TPU slice from ``--slice`` or the host's ``$TPU_ACCELERATOR_TYPE``; ``"dry_run"``:
            only when ``--slice`` is given, one CPU worker per fake chip; ``"none"``: ``--slice`` is refused.
        host_memory: the CPU host-memory machinery applies (the fork server, ``rl_tpu.compact_malloc``).
        tpu_runtime: TorchTPU runs here (``rl_tpu.tpu_eager_mode`` applies; its import hook is kept on).
        check: raises :class:`BadInputError` (one line) when the backend's device is missing.
        default_slice: the (fake) slice the job runs on when ``--slice`` is not given (``""``: none); the TPU
            dry run's ``v6e-4``.
        settings: ``rl_tpu`` settings this backend sets where the user's ``--config`` file and command line do not
            (``{name: value}``, typed as :mod:`verl_backend.settings` declares them).
    """

    name: str
    platform: str
    overrides: Mapping[str, str]
    default_config: Path | None = None
    default_threads: int = 0
    slices: str = "none"
    host_memory: bool = False
    tpu_runtime: bool = False
    check: Callable[[], None] = field(default=_no_check, repr=False)
    default_slice: str = ""
    settings: Mapping[str, object] = field(default_factory=dict)


# On a chip every eager op is a launch (TorchTPU's strict eager mode): the default job's decode step is 3,325 ATen ops
# and a block's update 389 (forward 103, its recomputation 103, backward 183), each a launch, where a compiled graph is
# one (docs/tpu.md, "Compiled or eager on the TPU"). Both compile flags are on for --backend tpu; the TPU dry run keeps
# the CPU's default (off: inductor on CPU is not the TPU's compiler; its compile check lowers the same graphs for the
# chip).
TPU_SETTINGS = {"compile_trainer": True, "compile_sampler": True}


PROFILES: dict[str, BackendProfile] = {
    "tpu": BackendProfile(
        "tpu",
        platform="tpu",
        overrides=_OVERRIDES["tpu"],
        slices="auto",
        tpu_runtime=True,
        check=_require_tpu,
        settings=TPU_SETTINGS,
    ),
    "cpu": BackendProfile(
        "cpu",
        platform="cpu",
        overrides=_OVERRIDES["cpu"],
        default_config=CONFIGS / "grpo_cpu.yaml",
        default_threads=2,
        slices="dry_run",
        host_memory=True,
    ),
    "cuda": BackendProfile("cuda", platform="nvidia", overrides=_OVERRIDES["cuda"], check=_require_cuda),
}
BACKENDS = tuple(PROFILES)

# The TPU dry run (``rl_tpu.tpu_dry_run``): the tpu row with only its device keys swapped for the CPU's.
DRY_RUN_DEVICE_KEYS: dict[str, str] = {"trainer.device": "cpu"}
DRY_RUN_SLICE = "v6e-4"  # 4 gloo ranks standing in for 4 chips when --slice is not given


def default_threads(cap: int, workers: int, cores: int) -> int:
    """Torch threads per process when ``rl_tpu.num_threads`` is 0: ``cap`` (the profile's ``default_threads``; 0
    leaves torch's own count), or fewer so that the ``workers`` trainer processes on this host have a core per
    thread, at least 1. On the CPU the rollout and the update alternate in VeRL's colocated loop, so each takes the
    cores in turn: the default job (one trainer worker) on 2 cores ran 424 s with 2 threads against 464 s with 1,
    step for step the same rewards (docs/recipe.md)."""
    if cap <= 0:
        return 0
    return max(1, min(cap, cores // max(1, workers)))


def tpu_dry_run(base: BackendProfile) -> BackendProfile:
    """The TPU profile run on CPU devices (``--backend cpu --tpu-dry-run``), derived from the tpu row.

    Every VeRL key of the tpu row is kept (padded micro batches, bf16 rollout, VeRL's default bf16 FSDP mixed
    precision, the sampler inside the trainer worker without the CPU fast paths, the ``native`` checkpoint engine,
    no bypass, no Prefix Grouper) except the device keys (:data:`DRY_RUN_DEVICE_KEYS`): VeRL's ``cpu`` platform,
    gloo. As on TPU there is no host-memory machinery (no fork server, no ``rl_tpu.compact_malloc``) and the
    workers are placed one per chip of a slice, here a fake one (``--slice``, default :data:`DRY_RUN_SLICE`)
    reserved on a Ray cluster (``rl-tpu cluster up --fake-slice``). Where torch-tpu is installed (``.venv-aot``), the
    TPU profile's compile flags are on with ``rl_tpu.compile_backend=tpu-on-cpu`` (:mod:`verl_backend.tpu_on_cpu`:
    the compiled regions as TorchTPU lowers them, run by XLA:CPU); without it they stay off. What is not TPU: the device, the default job
    (``base``'s, which a TPU job lacks) and its thread count, and no chip to check.

    Raises:
        BadInputError: ``base`` is not the cpu profile (the dry run replaces a chip by CPU devices).
    """
    if base.name != "cpu":
        raise BadInputError(
            f"rl_tpu.tpu_dry_run (--tpu-dry-run) runs the TPU profile on CPU devices: use it with "
            f"--backend cpu, not --backend {base.name}"
        )
    from verl_backend.tpu_on_cpu import aot_python_path

    tpu = PROFILES["tpu"]
    return BackendProfile(
        base.name,
        platform=base.platform,
        overrides={**tpu.overrides, **DRY_RUN_DEVICE_KEYS},
        # the TPU profile's compiled regions, as TorchTPU lowers them, run by XLA:CPU; without torch-tpu, eager
        settings={**tpu.settings, "compile_backend": "tpu-on-cpu"} if aot_python_path() else {},
        default_config=base.default_config,
        default_threads=base.default_threads,
        slices="dry_run",
        host_memory=tpu.host_memory,
        tpu_runtime=False,
        check=base.check,
        default_slice=DRY_RUN_SLICE,
    )


def profile(name: str) -> BackendProfile:
    """The profile of ``--backend name`` (case and spaces ignored).

    Raises:
        BadInputError: an unknown backend, naming the known ones.
    """
    key = str(name).strip().lower()
    if key not in PROFILES:
        raise BadInputError(f"--backend {name!r} is unknown: choose one of {', '.join(PROFILES)}")
    return PROFILES[key]
