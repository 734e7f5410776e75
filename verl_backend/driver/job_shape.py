"""The typed description of a composed ``verl train`` job that the TPU plans read: workers and shards, batch and micro
batches, lengths and the sampler's buckets, dtypes, which models run. Built once from the composed VeRL config
(:func:`job_shape`) and passed down to the memory plan (:mod:`verl_backend.driver.memory_plan`), the graph list
(:mod:`verl_backend.driver.aot.graphs`) and the ``--aot-only`` report (:mod:`verl_backend.driver.aot.job`), which
read its fields, not the config's keys.

Micro batches are per chip (per worker process on CPU), as VeRL's workers normalise them: a
``…_micro_batch_size_per_gpu``, else VeRL's global ``…_micro_batch_size`` over the data-parallel ranks. Where VeRL's
config leaves one unset (VeRL 0.9.1 refuses that unless ``use_dynamic_bsz``), the plans take the mini batch's share
of a chip for an update and the step's share of a worker for a log-prob forward, all in one micro batch. All lengths
are tokens.
"""

from __future__ import annotations

import dataclasses

from verl_backend.driver.job_keys import config_get, per_chip_micro_batch, pow2, runs_critic

_ARO = "actor_rollout_ref"


def _true(value) -> bool:
    """A config flag as VeRL reads it: ``True`` or the string ``true`` (any case)."""
    return value is True or str(value).lower() == "true"


@dataclasses.dataclass(frozen=True)
class JobShape:
    """One composed job, as the plans need it (build it with :func:`job_shape`).

    Attributes:
        model_path: ``actor_rollout_ref.model.path``; ``trust_remote_code`` its key.
        device: ``trainer.device`` (VeRL's; ``cpu`` when unset).
        critic_model_path: the critic's ``critic.model.path`` when it names another model, else ``""``.
        workers: trainer workers (one per chip on TPU): ``trainer.n_gpus_per_node × trainer.nnodes``.
        shards: FSDP shards of the parameters (``actor.fsdp_config.fsdp_size`` when in 1..workers, else workers).
        sequence_parallel: Ulysses sequence-parallel size (the actor's or its FSDP config's, the larger).
        train_batch_size: prompts a step (``data.train_batch_size``); ``rollout_n``: samples per prompt.
        prompt_length, response_length: ``data.max_prompt_length`` / ``data.max_response_length``.
        rollout_prompt_length, rollout_response_length: the rollout's own (its largest buckets).
        max_num_seqs: the rollout's ``max_num_seqs`` (sequences decoded at once).
        model_dtype, param_dtype, reduce_dtype: the actor's FSDP ``model_dtype`` and mixed-precision dtypes;
            ``ref_model_dtype``, ``critic_model_dtype``, ``rollout_dtype`` the reference's, the critic's and the
            rollout's (names as VeRL's config gives them: ``fp32``, ``bf16``, ``bfloat16``, ``auto``...).
        lora_rank: ``actor_rollout_ref.model.lora_rank`` (0: full fine-tuning).
        param_offload, optimizer_offload, ref_param_offload: VeRL's FSDP offloads.
        reference: a reference policy runs (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``).
        old_log_probs: the old policy's log-probs are recomputed (``rollout_correction.bypass_mode`` false).
        critic: VeRL's critic trains (PPO with GAE).
        packed: packed micro batches (``model.use_remove_padding``); ``prefix_grouper``: each prompt once per group.
        dynamic_batch: ``actor.use_dynamic_bsz``; ``max_tokens_per_chip`` its ``ppo_max_token_len_per_gpu``.
        gradient_checkpointing, critic_gradient_checkpointing: VeRL's ``enable_gradient_checkpointing`` (default on).
        update_micro_batch, critic_micro_batch: sequences per chip in one update micro batch (actor, critic).
        log_prob_micro_batch, ref_log_prob_micro_batch, critic_forward_micro_batch: the same for the old policy's,
            the reference policy's and the critic's forward-only passes.
        sampler_placement: the native rollout's ``sampler_placement`` (``worker``: inside the trainer worker).
        packed_weights: the native rollout's ``packed_weights`` (``None``: not given, on).
        compile_trainer, plain_module, response_only_logits, logits_chunk_mib: the ``rl_tpu.*`` settings of the
            same name (``logits_chunk_mib`` 0 where a caller gives none: no chunking).
    """

    model_path: str
    trust_remote_code: bool
    device: str
    critic_model_path: str
    workers: int
    shards: int
    sequence_parallel: int
    train_batch_size: int
    rollout_n: int
    prompt_length: int
    response_length: int
    rollout_prompt_length: int
    rollout_response_length: int
    max_num_seqs: int
    model_dtype: str
    param_dtype: str
    reduce_dtype: str
    ref_model_dtype: str
    critic_model_dtype: str
    rollout_dtype: str
    lora_rank: int
    param_offload: bool
    optimizer_offload: bool
    ref_param_offload: bool
    reference: bool
    old_log_probs: bool
    critic: bool
    packed: bool
    prefix_grouper: bool
    dynamic_batch: bool
    max_tokens_per_chip: int
    gradient_checkpointing: bool
    critic_gradient_checkpointing: bool
    update_micro_batch: int
    log_prob_micro_batch: int
    ref_log_prob_micro_batch: int
    critic_micro_batch: int
    critic_forward_micro_batch: int
    sampler_placement: str
    packed_weights: bool | None
    compile_trainer: bool
    plain_module: bool
    response_only_logits: bool
    logits_chunk_mib: int = 0

    def logit_chunk_tokens(self, vocab: int, tokens: int) -> int:
        """Tokens the trainer's LM head takes at once for ``tokens`` response tokens of a ``vocab``-wide head:
        ``tokens``, or a chunk of them where the engine chunks the head (``rl_tpu.logits_chunk_mib``: packed
        response-only micro batches on one plain CPU rank, eager, whose fp32 logits would pass the budget;
        :meth:`verl_backend.workers.engine.RlTpuFSDPEngineWithLMHead._use_chunked_head`)."""
        from verl_backend.workers.response_logits import logits_chunk_tokens

        applies = (
            self.device == "cpu"
            and self.shards == 1
            and self.plain_module
            and not self.compile_trainer
            and self.packed
            and self.response_only_logits
            and tokens * vocab * 4 > self.logits_chunk_mib << 20
        )
        chunk = logits_chunk_tokens(vocab, self.logits_chunk_mib) if applies else 0
        return min(tokens, chunk) if chunk else tokens

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: the workers over the sequence-parallel size."""
        return max(1, self.workers // self.sequence_parallel)

    @property
    def sequence_length(self) -> int:
        """Prompt plus response, the longest sequence a micro batch holds (tokens)."""
        return self.prompt_length + self.response_length

    @property
    def padded_length(self) -> int:
        """The compiled trainer's static length for the longest micro batch: the power-of-two bucket of
        :attr:`sequence_length` (:func:`rl_tpu.compiled_blocks.bucket_length`)."""
        from rl_tpu.compiled_blocks import bucket_length

        return bucket_length(self.sequence_length)

    @property
    def bucketed(self) -> bool:
        """The trainer pads each micro batch to a power-of-two bucket: ``rl_tpu.compile_trainer`` on padded micro
        batches."""
        return self.compile_trainer and not self.packed

    @property
    def cache_slots(self) -> int:
        """KV-cache slots of the sampler's largest bucket: the rollout's prompt plus response length."""
        return self.rollout_prompt_length + self.rollout_response_length

    @property
    def sampler_batch(self) -> int:
        """Sequences one worker's sampler decodes at once: its share of ``train_batch_size × n``, at most
        ``max_num_seqs``, as a power-of-two bucket (:mod:`rl_tpu.sampler.engine`)."""
        share = max(1, -(-self.train_batch_size * self.rollout_n // self.workers))
        return pow2(min(share, self.max_num_seqs or share))

    @property
    def server_batch(self) -> int:
        """Sequences the CPU rollout server decodes at once: all of ``train_batch_size × n``, at most
        ``max_num_seqs``, as a power-of-two bucket."""
        rows = self.train_batch_size * self.rollout_n
        return pow2(min(rows, self.max_num_seqs or rows))


def job_workers(config) -> int:
    """The trainer workers of a composed config (``trainer.n_gpus_per_node × trainer.nnodes``): one per chip."""
    return int(config_get(config, "trainer.n_gpus_per_node", 1)) * int(config_get(config, "trainer.nnodes", 1))


def job_settings_of(config):
    """The job's typed settings (:class:`verl_backend.settings.RlTpuSettings`) from the composed config's ``rl_tpu``
    section (``verl train`` writes the resolved table there), parsed by :func:`verl_backend.settings.from_mapping`;
    a config without the section, or a key left out, takes the table's defaults.

    Raises:
        BadInputError: an unknown key or a bad value in ``config.rl_tpu``.
    """
    from verl_backend.settings import from_mapping

    section = config_get(config, "rl_tpu", None)
    return from_mapping(section if section is not None else {}, "config rl_tpu")


def job_shape(config, workers: int | None = None, settings=None) -> JobShape:
    """The :class:`JobShape` of a composed VeRL ``config`` (an OmegaConf node or a nested dict), read once.

    Long as the field list is: one keyword a field of :class:`JobShape`, read top to bottom.

    Args:
        workers: trainer workers to plan for (``None``: :func:`job_workers`).
        settings: the job's :class:`verl_backend.settings.RlTpuSettings` (``None``: the config's ``rl_tpu``
            section, defaults for what it leaves out).

    Raises:
        BadInputError: a bad ``rl_tpu`` section (an unknown key, a value of the wrong type).
        ValueError: a bad ``engine_kwargs.native`` (:func:`verl_backend.rollout.native_kwargs.native_engine_kwargs`).
    """
    from verl_backend.rollout.native_kwargs import native_engine_kwargs

    def get(key, default=None):
        return config_get(config, key, default)

    settings = job_settings_of(config) if settings is None else settings
    w = int(workers or job_workers(config))
    fsdp = int(get(f"{_ARO}.actor.fsdp_config.fsdp_size", -1))
    sp = max(
        int(get(f"{_ARO}.actor.ulysses_sequence_parallel_size", 1)),
        int(get(f"{_ARO}.actor.fsdp_config.ulysses_sequence_parallel_size", 1)),
    )
    dp = max(1, w // sp)
    n = int(get(f"{_ARO}.rollout.n", 1))
    prompt, response = int(get("data.max_prompt_length", 512)), int(get("data.max_response_length", 512))

    def update_micro(section: str) -> int:  # VeRL's micro batch, else the mini batch's share of the ranks
        given = per_chip_micro_batch(get, f"{section}.ppo_micro_batch_size_per_gpu", dp)
        return given or max(1, int(get(f"{section}.ppo_mini_batch_size", 1)) * n // dp)

    update = update_micro(f"{_ARO}.actor")
    share = max(1, int(get("data.train_batch_size", 1)) * n // w)  # a step's sequences on one worker
    critic_update = update_micro("critic")
    critic_path = str(get("critic.model.path", "") or "")
    native = native_engine_kwargs(get(f"{_ARO}.rollout", {}))
    fc = f"{_ARO}.actor.fsdp_config"
    return JobShape(
        model_path=str(get(f"{_ARO}.model.path", "") or ""),
        trust_remote_code=_true(get(f"{_ARO}.model.trust_remote_code", False)),
        device=str(get("trainer.device", "cpu")),
        critic_model_path=critic_path if critic_path != str(get(f"{_ARO}.model.path", "")) else "",
        workers=w,
        shards=fsdp if 0 < fsdp <= w else w,
        sequence_parallel=sp,
        train_batch_size=int(get("data.train_batch_size", 1)),
        rollout_n=n,
        prompt_length=prompt,
        response_length=response,
        rollout_prompt_length=int(get(f"{_ARO}.rollout.prompt_length", prompt) or prompt),
        rollout_response_length=int(get(f"{_ARO}.rollout.response_length", response) or response),
        max_num_seqs=int(get(f"{_ARO}.rollout.max_num_seqs", 0) or 0),
        model_dtype=str(get(f"{fc}.model_dtype", "fp32")),
        param_dtype=str(get(f"{fc}.mixed_precision.param_dtype", "bf16")),
        reduce_dtype=str(get(f"{fc}.mixed_precision.reduce_dtype", "fp32")),
        ref_model_dtype=str(get(f"{_ARO}.ref.fsdp_config.model_dtype", "fp32")),
        critic_model_dtype=str(get("critic.fsdp.model_dtype", get("critic.model_config.model_dtype", "fp32"))),
        rollout_dtype=str(get(f"{_ARO}.rollout.dtype", "bfloat16")),
        lora_rank=int(get(f"{_ARO}.model.lora_rank", 0)),
        param_offload=_true(get(f"{fc}.param_offload", False)),
        optimizer_offload=_true(get(f"{fc}.optimizer_offload", False)),
        ref_param_offload=_true(get(f"{_ARO}.ref.fsdp_config.param_offload", False)),
        reference=_true(get(f"{_ARO}.actor.use_kl_loss", False)) or _true(get("algorithm.use_kl_in_reward", False)),
        old_log_probs=not _true(get("algorithm.rollout_correction.bypass_mode", False)),
        critic=runs_critic(get),
        packed=_true(get(f"{_ARO}.model.use_remove_padding", False)),
        prefix_grouper=_true(get(f"{_ARO}.actor.use_prefix_grouper", False)),
        dynamic_batch=_true(get(f"{_ARO}.actor.use_dynamic_bsz", False)),
        max_tokens_per_chip=int(get(f"{_ARO}.actor.ppo_max_token_len_per_gpu", 16384)),
        gradient_checkpointing=_true(get(f"{_ARO}.model.enable_gradient_checkpointing", True)),
        critic_gradient_checkpointing=_true(get("critic.model.enable_gradient_checkpointing", True)),
        update_micro_batch=update,
        log_prob_micro_batch=per_chip_micro_batch(get, f"{_ARO}.rollout.log_prob_micro_batch_size_per_gpu", w) or share,
        ref_log_prob_micro_batch=per_chip_micro_batch(get, f"{_ARO}.ref.log_prob_micro_batch_size_per_gpu", w) or share,
        critic_micro_batch=critic_update,
        critic_forward_micro_batch=per_chip_micro_batch(get, "critic.forward_micro_batch_size_per_gpu", dp)
        or critic_update,
        sampler_placement=native.sampler_placement,
        packed_weights=native.packed_weights,
        compile_trainer=bool(settings.compile_trainer),
        plain_module=bool(settings.plain_module),
        response_only_logits=bool(settings.response_only_logits),
        logits_chunk_mib=int(settings.logits_chunk_mib),
    )
