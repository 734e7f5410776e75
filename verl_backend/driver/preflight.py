"""Pre-flight checks of ``verl train``: everything about the job that can be found wrong before Ray starts.

Each check raises :class:`~verl_backend.errors.BadInputError` with one line naming the input, where it is (config
key, file and row) and the fix: the backend is there, counts are whole numbers, batch sizes split over the workers,
prompts fit ``data.max_prompt_length``, the model folder is a model with a tokenizer, the user's reward function
imports, the native rollout can serve the lengths asked for; and the epoch count is fitted to the steps asked for.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

from verl_backend.driver.data_prep import data_files
from verl_backend.errors import BadInputError


def check_user_reward(config) -> None:
    """Import the user's reward function in this process before Ray starts (its file, module and name).

    Inside Ray a missing file, a syntax error or a wrong name failed every sample in VeRL's reward worker, and the
    run ended some 90 s later on the replay buffer's ``RuntimeError``.

    Raises:
        BadInputError: one line naming ``reward.custom_reward_function.path/name`` and what went wrong.
    """
    kwargs = config.reward.custom_reward_function.get("reward_kwargs") or {}
    path = kwargs.get("user_fn_path")
    if not path:
        return
    name = kwargs.get("user_fn_name") or "compute_score"
    from verl_backend.data.rewards import load_user_reward

    if not callable(load_user_reward(str(path), str(name))):
        raise BadInputError(f"reward.custom_reward_function.name={name}: {path} defines it, but not as a function")


def _n_prompt_tokens(tok, messages: list) -> int:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)``, loaded once per path for the checks that run before Ray starts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def check_prompt_lengths(config) -> None:
    """Count prompts longer than ``data.max_prompt_length`` and say what happens to them (never silent)."""
    import pandas as pd

    limit = int(config.data.max_prompt_length)  # a whole number: check_whole_numbers ran first
    tok = _tokenizer(str(config.actor_rollout_ref.model.path))
    for key in ("train_files", "val_files"):
        for f in data_files(config.data.get(key)):
            df = pd.read_parquet(f)
            lengths = [_n_prompt_tokens(tok, list(p)) for p in df["prompt"]]
            too_long = sum(n > limit for n in lengths)
            if not too_long:
                continue
            # worked examples (rl_tpu.few_shot) are earlier turns of every prompt: fewer of them is a fix too
            shots = sum(m["role"] == "assistant" for m in df["prompt"].iloc[0])
            fewer = f", or lower rl_tpu.few_shot (now {shots} worked example(s) a prompt)" if shots else ""
            if not config.data.filter_overlong_prompts:
                raise BadInputError(
                    f"{f}: {too_long} of {len(df)} prompts are longer than data.max_prompt_length={limit} tokens "
                    f"(longest {max(lengths)}); raise data.max_prompt_length{fewer}, or set "
                    "data.filter_overlong_prompts=true"
                )
            if too_long == len(df):
                raise BadInputError(
                    f"{f}: all {len(df)} prompts are longer than data.max_prompt_length={limit} tokens (shortest "
                    f"{min(lengths)}); raise it{fewer}"
                )
            print(
                f"[rl-tpu] {f}: dropping {too_long} of {len(df)} prompts longer than {limit} tokens "
                "(data.filter_overlong_prompts=true)"
            )


def check_native_rollout(config) -> None:
    """Refuse, before any process starts, native-rollout settings that would only fail inside Ray.

    - ``actor_rollout_ref.rollout.checkpoint_engine`` must be a mapping (the weight sync reads its bucket size).
    - ``engine_kwargs.native`` must hold only the native rollout's keys, each valid
      (:func:`verl_backend.rollout.native_kwargs.native_engine_kwargs`), and ``sampler_placement=worker`` a checkpoint
      engine that serves it (:func:`verl_backend.rollout.adapter.sampler_placement`).
    - ``tensor_model_parallel_size``, ``data_parallel_size`` and ``pipeline_model_parallel_size`` must be 1: the native
      sampler holds one unsharded model per replica, on one chip, and would silently ignore a split across several.
    - A Phi-3-style ``longrope`` model switches all positions from its short to its long RoPE factors once a forward
      call's sequence passes ``original_max_position_embeddings``
      (:func:`rl_tpu.sampler.engine.longrope_switch_length`). The rollout fills its KV cache below the switch, the
      trainer's forward sees the whole sequence above it: their log-probs differ by whole nats. So the rollout's
      ``prompt_length + response_length`` (filled from ``data.max_*`` unless set) must not pass the switch.

    Raises:
        BadInputError: one of the above, naming the config key and the fix.
    """
    rollout = config.actor_rollout_ref.rollout
    if str(rollout.get("name")) != "native":
        return
    engine = rollout.get("checkpoint_engine")
    if not hasattr(engine, "get"):
        raise BadInputError(
            f"actor_rollout_ref.rollout.checkpoint_engine={engine!r}: the native rollout's weight sync needs one; "
            "drop the override (VeRL's default) or set actor_rollout_ref.rollout.checkpoint_engine.backend="
            "naive|native"
        )
    from transformers import AutoConfig

    from rl_tpu.sampler.engine import longrope_switch_length
    from verl_backend.rollout.adapter import sampler_placement

    try:
        sampler_placement(rollout)  # reads and checks every key of engine_kwargs.native
    except ValueError as exc:
        raise BadInputError(str(exc)) from None
    for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        if int(rollout.get(key, 1) or 1) != 1:
            raise BadInputError(
                f"actor_rollout_ref.rollout.{key}={rollout.get(key)}: the native rollout runs each replica on one chip "
                f"(one unsharded model, no split across chips); set it to 1 (more chips give more replicas)"
            )
    model = config.actor_rollout_ref.model
    try:
        hf = AutoConfig.from_pretrained(model.path, trust_remote_code=bool(model.get("trust_remote_code", False)))
    except (OSError, ValueError):
        return  # not a model folder: the model check reports it
    switch = longrope_switch_length(hf)
    if switch is None:
        return
    need = int(rollout.prompt_length) + int(rollout.response_length)  # whole numbers: check_whole_numbers
    if need > switch:
        raise BadInputError(
            f"actor_rollout_ref.rollout.prompt_length + response_length = {need} tokens (from data.max_prompt_length "
            f"and data.max_response_length unless set) is past {switch}, where {model.path}'s longrope RoPE switches "
            "from its short to its long factors: rollout and trainer log-probs would disagree for sequences that "
            f"cross it; lower them to {switch} tokens or less in total"
        )


# Counts the planning below and VeRL's trainer do arithmetic with: (key, smallest value, may be null)
WHOLE_NUMBER_KEYS = (
    ("data.train_batch_size", 1, False),
    ("data.max_prompt_length", 1, False),
    ("data.max_response_length", 1, False),
    ("actor_rollout_ref.rollout.n", 1, False),
    ("actor_rollout_ref.rollout.prompt_length", 1, True),
    ("actor_rollout_ref.rollout.response_length", 1, True),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 1, True),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1, True),
    ("actor_rollout_ref.actor.ppo_epochs", 1, True),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 1, True),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1, True),
    ("critic.ppo_mini_batch_size", 1, True),
    ("critic.ppo_micro_batch_size_per_gpu", 1, True),
    ("trainer.total_training_steps", 1, True),
    ("trainer.total_epochs", 1, False),
    ("trainer.n_gpus_per_node", 1, False),
    ("trainer.nnodes", 1, False),
)


def check_whole_numbers(config) -> None:
    """Refuse a count in :data:`WHOLE_NUMBER_KEYS` that is not a whole number at or above its smallest value.

    Before this check ``data.train_batch_size=0`` divided by zero in the step planning, ``=abc`` was a ``ValueError``
    traceback, and ``actor_rollout_ref.rollout.n=0`` started the whole job only to fail in VeRL's replay buffer.
    Keys a config does not have are skipped.

    Raises:
        BadInputError: one line naming the key, its value and what to give.
    """
    from omegaconf import OmegaConf

    for key, low, nullable in WHOLE_NUMBER_KEYS:
        value = OmegaConf.select(config, key, default="<absent>", throw_on_missing=False)
        if isinstance(value, str) and value == "<absent>" or (value is None and nullable):
            continue
        number = None
        if not isinstance(value, bool):
            try:
                number = int(value)
            except (TypeError, ValueError):
                pass
            if number is not None and isinstance(value, float) and number != value:
                number = None
        if number is None or number < low:
            raise BadInputError(
                f"{key}={value!r}: give a whole number of {low} or more"
                + (" (or null for VeRL's default)" if nullable else "")
            )


def fit_epochs_to_steps(config) -> None:
    """Raise ``trainer.total_epochs`` so that ``trainer.total_training_steps`` is reached, or refuse an empty epoch.

    VeRL 0.9.1's trainer (``verl/trainer/ppo/v1/trainer_base.py``, ``PPOTrainer._init_dataloader`` and ``fit``)
    takes ``steps_per_epoch = len(train_dataset) // data.train_batch_size`` (the train loader drops the last
    partial batch) and lets an explicit ``trainer.total_training_steps`` replace ``steps_per_epoch × total_epochs``,
    but its loop also stops after ``total_epochs`` epochs and reports success: 6 steps asked of 4 batches × 1 epoch
    ran 4. The rule here: rows = the train parquet rows (capped by ``data.train_max_samples``), batches =
    rows // ``data.train_batch_size``; if ``total_training_steps > batches × total_epochs``, set ``total_epochs =
    ceil(steps / batches)`` (VeRL still stops at the step count) and say so in one ``[rl-tpu]`` line. With
    ``data.filter_overlong_prompts`` VeRL may drop rows, so the count is an upper bound and the line says so.

    Raises:
        BadInputError: fewer train rows than ``data.train_batch_size`` (VeRL would divide by zero, or assert).
    """
    import pyarrow.parquet as pq
    from omegaconf import open_dict

    files = data_files(config.data.get("train_files"))
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    cap = int(config.data.get("train_max_samples") or -1)
    if 0 < cap < rows:
        rows = cap
    batch = int(config.data.train_batch_size)
    batches = rows // batch
    if batches == 0:
        raise BadInputError(
            f"data.train_files ({', '.join(files)}) has {rows} rows, fewer than data.train_batch_size={batch}: "
            f"an epoch would have no batch; {f'set data.train_batch_size={rows} or less, or ' if rows else ''}give "
            "more rows (rl_tpu.train_size for the built-in data)"
        )
    steps, epochs = config.trainer.get("total_training_steps"), int(config.trainer.total_epochs)
    if steps is None or int(steps) <= batches * epochs:
        return
    needed = -(-int(steps) // batches)
    with open_dict(config):
        config.trainer.total_epochs = needed
    bound = (
        f" ({rows} rows is an upper bound: data.filter_overlong_prompts=true may drop some)"
        if config.data.get("filter_overlong_prompts")
        else ""
    )
    print(
        f"[rl-tpu] trainer.total_training_steps={steps} needs {needed} epochs of {batches} batches ({rows} rows "
        f"/ data.train_batch_size {batch}); trainer.total_epochs raised from {epochs} to {needed}{bound}",
        flush=True,
    )


def check_sdpa_attention(key: str, path: Path, config) -> None:
    """Refuse a model family whose transformers class has no ``scaled_dot_product_attention`` path (GPT-OSS in
    transformers 5.x: its attention sinks have only eager and kernel implementations). rl-tpu's trainer engine
    (``override_config.attn_implementation=sdpa``, :mod:`verl_backend.driver.profiles`) and the native sampler
    (:mod:`rl_tpu.sampler.attention`) both compute attention through sdpa; such a model failed inside a Ray worker
    with ~100 lines ending in transformers' ``ValueError``.

    Args:
        key: the config key that named the folder (``actor_rollout_ref.model.path``).
        path: the model folder.
        config: its transformers config (``AutoConfig.from_pretrained(path)``).

    Raises:
        BadInputError: one line naming the family, why, and the families that run.
    """
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return  # not a causal LM transformers knows (remote code, a critic's head): VeRL loads it its own way
    from rl_tpu.patches.transformers_internals import supports_sdpa

    if supports_sdpa(cls):
        return
    raise BadInputError(
        f"{key}={path}: {cls.__name__} ({config.model_type}) has no scaled_dot_product_attention implementation in "
        f"transformers {transformers.__version__}, and rl-tpu's trainer engine and native sampler compute attention "
        "through sdpa; train a family that has one (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma3, Mistral)"
    )


# What a non-attention layer type (transformers 5.x ``config.layer_types``) holds, for the refusal's reason
_NON_ATTENTION_KINDS = {
    "mamba": "Mamba state-space layers",
    "conv": "short-convolution layers",
    "linear_attention": "linear-attention (recurrent-state) layers",
    "hybrid": "layers with a Mamba state-space mixer beside their attention",
    "recurrent": "recurrent (RG-LRU) layers",
}


def non_attention_layers(config) -> dict[str, int]:
    """The layer types of ``config``'s decoder that are not key/value attention, each with its layer count;
    ``{}`` for a model whose every layer is attention (full, sliding-window or chunked).

    Read from the text config's ``layer_types`` (transformers 5.x names every layer there, and maps each type to a
    cache layer in ``transformers.cache_utils.LAYER_TYPE_CACHE_MAPPING``: a type whose cache layer holds a
    convolution or recurrent state, ``LinearAttentionCacheLayerMixin``, is not attention), else
    ``layers_block_type`` / ``block_types`` (RecurrentGemma). A type that names no attention and is not in that
    mapping (NemotronH's ``mlp`` layers) counts as not attention too.

    Args:
        config: a transformers ``PretrainedConfig`` (a multimodal one is read through ``get_text_config()``).

    Returns:
        ``{layer type: number of layers}``, in the order first met.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if not types:
        types = getattr(text, "layers_block_type", None) or getattr(text, "block_types", None)
    if not isinstance(types, (list, tuple)):
        return {}
    try:
        from transformers.cache_utils import LAYER_TYPE_CACHE_MAPPING, LinearAttentionCacheLayerMixin
    except ImportError:  # an older transformers: names only
        LAYER_TYPE_CACHE_MAPPING, LinearAttentionCacheLayerMixin = {}, ()
    found: dict[str, int] = {}
    for kind in types:
        kind = str(kind)
        layer = LAYER_TYPE_CACHE_MAPPING.get(kind)
        state = (
            isinstance(layer, type)
            and bool(LinearAttentionCacheLayerMixin)
            and issubclass(layer, LinearAttentionCacheLayerMixin)
        )
        if state or (layer is None and "attention" not in kind):
            found[kind] = found.get(kind, 0) + 1
    return found


def check_attention_layers(key: str, path: Path, config) -> None:
    """Refuse a model whose decoder layers are not all attention: a hybrid of attention with convolution,
    state-space or linear-attention layers (LFM2, Jamba, Bamba, Falcon-H1, Zamba, NemotronH, GraniteMoeHybrid,
    Qwen3-Next, Qwen3.5, OLMo-Hybrid, MiniMax, RecurrentGemma) or a model with no attention (Mamba, Mamba2,
    FalconMamba), by :func:`non_attention_layers`.

    rl-tpu's paths cannot run them exactly: the native sampler keeps one static key/value cache per layer and no
    convolution or recurrent state, and the trainer's packed micro batches and shared-prefix forward put several
    sequences in one row, which only an attention mask keeps apart (a convolution or a recurrent state carries one
    sequence into the next). Such a job ended inside Ray, in the rollout's weight-sync check, as a ``RuntimeError``
    traceback.

    Args:
        key: the config key that named the folder (``actor_rollout_ref.model.path``).
        path: the model folder.
        config: its transformers config (``AutoConfig.from_pretrained(path)``).

    Raises:
        BadInputError: one line naming the family, its non-attention layers (type and count), why, and the fix.
    """
    found = non_attention_layers(config)
    if not found:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    total = int(getattr(text, "num_hidden_layers", 0) or 0)
    kinds = ", ".join(
        f"{n}{f' of {total}' if total else ''} {_NON_ATTENTION_KINDS.get(k, f'{k!r} layers')}" for k, n in found.items()
    )
    raise BadInputError(
        f"{key}={path}: its {config.model_type} model has {kinds}; rl-tpu's native sampler caches only attention "
        "keys and values, and its packed micro batches keep sequences apart only by an attention mask, so it cannot "
        "run this family exactly; train a family whose layers are all attention (Llama, Qwen2, Qwen3, Qwen3-MoE, "
        "Gemma3, Mistral)"
    )


def check_model_folder(key: str, path: Path, tokenizer_path: str | None) -> None:
    """Refuse a model folder VeRL 0.9.1 would fail on inside a Ray worker, with one line naming ``key``.

    A folder named after an embedded model (``~/.cache/rl-tpu/gemma-3-270m``, :data:`verl_backend.models.EMBEDDED`)
    that does not exist yet, or is empty, is converted from the model's GGUF first; one with files in it is read as
    it is.

    Checks: ``config.json`` and ``*.safetensors`` are there; transformers loads its config and a tokenizer (from
    ``tokenizer_path`` when given); its layers are all attention (:func:`check_attention_layers`); the config has
    ``num_key_value_heads``, which VeRL's FSDP engine reads for every model
    (``verl/models/transformers/monkey_patch.py``, ``apply_monkey_patch``; GPT-2-style configs lack it).

    Raises:
        BadInputError: the first check that fails.
    """
    from verl_backend.models import EMBEDDED, embedded_name_of, ensure_model, is_hf_model_dir

    name = embedded_name_of(path)
    # an embedded model named by a folder that does not exist yet (or is empty): converted there once; a folder
    # with anything in it (the user's own checkpoint of that name) is never replaced
    if name is not None and not (path.is_dir() and any(path.iterdir())) and not path.is_file():
        print(f"[rl-tpu] {key}={path}: converting the embedded model {name} from its GGUF into it (once)", flush=True)
        ensure_model(name, target=path)
    if not is_hf_model_dir(path):
        raise BadInputError(
            f"{key}={path} is not a model folder (needs config.json and *.safetensors); "
            "pass an HF-format checkpoint folder such as <run>/checkpoints/global_step_N/actor/huggingface, or "
            f"a folder named after an embedded model ({', '.join(EMBEDDED)})"
        )
    from transformers import AutoConfig

    def first_line(exc: Exception) -> str:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise BadInputError(
            f"{key}={path}: transformers cannot read its config.json ({first_line(exc)}); pass a "
            "folder written by save_pretrained"
        ) from None
    check_attention_layers(key, path, config)  # before the key/value-head check: Mamba has no heads at all
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_key_value_heads", None) is None:
        raise BadInputError(
            f"{key}={path}: its {config.model_type} config has no num_key_value_heads, which VeRL 0.9.1's FSDP engine "
            "reads for every model (verl/models/transformers/monkey_patch.py); use a Llama-, Qwen- or Mistral-style "
            "checkpoint"
        )
    check_sdpa_attention(key, path, config)
    tok = Path(os.path.expanduser(tokenizer_path.strip("\"'"))) if tokenizer_path else path
    try:
        _tokenizer(str(tok))
    except Exception as exc:
        raise BadInputError(
            f"{key}={path}: transformers cannot load a tokenizer from {tok} ({first_line(exc)}); copy the base "
            f"model's tokenizer files (tokenizer.json, tokenizer_config.json) into it, or set "
            f"{key.rsplit('.', 1)[0]}.tokenizer_path"
        ) from None


def _smallest_multiple(size: int, of: int, n: int) -> int:
    """The smallest batch size >= ``size`` (and > 0) whose product with ``n`` (``rollout.n``) is a multiple of
    ``of``: one whose sequences split over ``of`` workers or data-parallel ranks."""
    step = of // math.gcd(of, n)
    return max(step, -(-size // step) * step)


def _check_step_split(batch: int, n: int, workers: int, pool: str) -> None:
    """Refuse a step of ``batch × n`` sequences that does not split over the ``workers`` (VeRL's ``validate_config``;
    the caller skips it under ``use_dynamic_bsz``); ``pool`` names the workers and where their count came from.

    Raises:
        BadInputError: one line naming ``data.train_batch_size``, ``rollout.n`` and a batch size that splits.
    """
    if (batch * n) % workers:
        raise BadInputError(
            f"data.train_batch_size={batch} × actor_rollout_ref.rollout.n={n} = {batch * n} sequences per step do "
            f"not split evenly over the {pool}: set data.train_batch_size={_smallest_multiple(batch, workers, n)} "
            f"(a multiple of {workers // math.gcd(workers, n)}), or run on fewer workers"
        )


def _check_mini_batches(roles: list, batch: int, n: int, workers: int, pool: str) -> dict[str, int]:
    """Refuse a PPO mini batch above ``data.train_batch_size`` or whose ``× n`` sequences do not split over the
    role's data-parallel ranks (``workers`` / its Ulysses sequence-parallel size), role by role in ``roles``
    (``[(config key prefix, its section)]``); a role without ``ppo_mini_batch_size`` is skipped.

    Returns:
        The data-parallel size of each role checked: ``{role: ranks}``.

    Raises:
        BadInputError: one line naming the role's ``ppo_mini_batch_size`` and a value that works.
    """
    dp_of: dict[str, int] = {}
    for role, section in roles:
        mini = section.ppo_mini_batch_size
        if mini is None:
            continue
        mini = int(mini)
        if not section.use_dynamic_bsz and batch < mini:
            raise BadInputError(
                f"data.train_batch_size={batch} is below {role}.ppo_mini_batch_size={mini}: a PPO update needs "
                f"that many prompts; set {role}.ppo_mini_batch_size={batch} or raise data.train_batch_size"
            )
        engine = section.get("fsdp_config" if role != "critic" else "fsdp") or {}
        sp = max(
            int(section.get("ulysses_sequence_parallel_size") or 1),
            int(engine.get("ulysses_sequence_parallel_size") or 1),
        )
        dp = max(1, workers // sp)
        dp_of[role] = dp
        if (mini * n) % dp:
            raise BadInputError(
                f"{role}.ppo_mini_batch_size={mini} × actor_rollout_ref.rollout.n={n} = {mini * n} sequences per "
                f"PPO update do not split over the {dp} data-parallel ranks of the {pool}: set "
                f"{role}.ppo_mini_batch_size={_smallest_multiple(mini, dp, n)} (a multiple of {dp // math.gcd(dp, n)})"
            )
    return dp_of


def _check_micro_batches(roles: list, n: int, dp_of: dict[str, int]) -> None:
    """Refuse a ``ppo_micro_batch_size_per_gpu`` that does not divide each data-parallel rank's share of a PPO update
    (``ppo_mini_batch_size × n`` / the role's ranks in ``dp_of``): VeRL's engine splits that share into micro batches
    (workers/engine/utils.py asserts). Roles without a mini or micro batch, or under ``use_dynamic_bsz``, pass.

    Raises:
        BadInputError: one line naming the role's micro batch key, the share and its arithmetic.
    """
    for role, section in roles:
        mini, micro = section.ppo_mini_batch_size, section.get("ppo_micro_batch_size_per_gpu")
        if mini is None or not micro or section.use_dynamic_bsz:
            continue
        share = int(mini) * n // dp_of[role]
        if share % int(micro):
            raise BadInputError(
                f"{role}.ppo_micro_batch_size_per_gpu={micro} does not divide the {share} sequences each "
                f"data-parallel rank gets per PPO update ({role}.ppo_mini_batch_size={mini} × rollout.n={n} / "
                f"{dp_of[role]} ranks): set it to a divisor of {share}"
            )


def _check_log_prob_micro_batches(config, batch: int, n: int, workers: int) -> None:
    """Refuse a rollout's or reference policy's ``log_prob_micro_batch_size_per_gpu`` that does not divide the
    ``batch × n / workers`` sequences each worker scores per step: VeRL's engine splits that share into log-prob
    micro batches (workers/engine/utils.py). Unset, or under ``log_prob_use_dynamic_bsz``, passes.

    Raises:
        BadInputError: one line naming the key, the share and its arithmetic.
    """
    per_rank = batch * n // max(1, workers)
    for key in (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ):
        section = config.actor_rollout_ref.rollout if ".rollout." in key else config.actor_rollout_ref.ref
        micro = section.get("log_prob_micro_batch_size_per_gpu")
        if micro and not section.get("log_prob_use_dynamic_bsz", False) and per_rank % int(micro):
            raise BadInputError(
                f"{key}={micro} does not divide the {per_rank} sequences each worker scores per step "
                f"(data.train_batch_size={batch} × actor_rollout_ref.rollout.n={n} / {workers} workers): set it to a "
                f"divisor of {per_rank}"
            )


def check_batch_sizes(config, workers_from: str = "") -> None:
    """Refuse batch sizes that do not split over the workers, before Ray starts (VeRL finds out later, as a traceback).

    Mirrors VeRL 0.9.1's own rules for FSDP strategies: ``verl.utils.config.validate_config`` (each step's
    ``data.train_batch_size × rollout.n`` sequences a multiple of the ``n_gpus_per_node × nnodes`` workers, unless
    ``use_dynamic_bsz``), ``ActorConfig/CriticConfig.validate`` (``ppo_mini_batch_size <= data.train_batch_size``),
    and the engine worker's ``update_actor``/``update_critic`` (each ``ppo_mini_batch_size × rollout.n`` update a
    multiple of the data-parallel size, workers / Ulysses sequence-parallel size). Megatron is left to VeRL.

    Args:
        config: the composed VeRL config.
        workers_from: where the worker count came from (e.g. ``--slice v4-16``), for the message.

    Raises:
        BadInputError: one line naming the keys, their values, the worker count and a value that works.
    """
    import warnings

    from verl.trainer.ppo.utils import need_critic

    actor, critic = config.actor_rollout_ref.actor, config.critic
    if actor.strategy not in ("fsdp", "fsdp2"):
        return
    per_node, nodes = int(config.trainer.n_gpus_per_node), int(config.trainer.nnodes)
    workers = per_node * nodes
    n, batch = int(config.actor_rollout_ref.rollout.n), int(config.data.train_batch_size)
    pool = f"{workers} workers (trainer.n_gpus_per_node={per_node} × trainer.nnodes={nodes}" + (
        f", from {workers_from})" if workers_from else ")"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # need_critic warns that a non-GAE estimator has no critic
        roles = [("actor_rollout_ref.actor", actor)] + ([("critic", critic)] if need_critic(config) else [])
    if not actor.use_dynamic_bsz:
        _check_step_split(batch, n, workers, pool)
    dp_of = _check_mini_batches(roles, batch, n, workers, pool)
    _check_micro_batches(roles, n, dp_of)
    _check_log_prob_micro_batches(config, batch, n, workers)


# VeRL 0.9.1's registered advantage estimators (verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY) that its V1
# trainer, the one rl-tpu runs (verl/trainer/ppo/v1/trainer_base.py, PPOTrainer._compute_advantage), cannot feed:
# it hands the estimator only uid, response_mask, rm_scores, the log-probs and values; nothing else.
V1_UNFED_ESTIMATORS = {
    "remax": "ReMax subtracts the reward of a greedy rollout (reward_baselines), which VeRL 0.9.1's V1 trainer never "
    "samples (only its legacy trainer, trainer.use_v1=false, which rl-tpu does not run, does); use rloo or "
    "grpo (a baseline from the group's other samples) instead",
    "optimal_token_baseline": "the optimal token baseline needs the actor's sum of squared token probabilities "
    "(actor.calculate_sum_pi_squared), which VeRL 0.9.1's V1 trainer never asks the actor "
    "for (only its legacy trainer, trainer.use_v1=false, which rl-tpu does not run, does); "
    "use grpo or rloo instead",
    "tir_optimal_token_baseline": "the optimal token baseline needs the actor's sum of squared token probabilities "
    "(actor.calculate_sum_pi_squared), which VeRL 0.9.1's V1 trainer never asks the "
    "actor for (only its legacy trainer, trainer.use_v1=false, which rl-tpu does not "
    "run, does); use grpo or rloo instead",
    "gdpo": "GDPO normalizes each reward component named in algorithm.gdpo_reward_keys apart, but VeRL 0.9.1's V1 "
    "trainer passes the estimator none of the reward's extra keys (only its legacy trainer, "
    "trainer.use_v1=false, which rl-tpu does not run, does); with one reward, use grpo",
}


def check_adv_estimator(config, before_run: bool = False) -> None:
    """Refuse an ``algorithm.adv_estimator`` that VeRL 0.9.1's V1 trainer cannot feed
    (:data:`V1_UNFED_ESTIMATORS`; each failed inside Ray after the first rollout, ReMax with a ``TypeError``
    traceback, the optimal token baselines and GDPO on an assertion); with ``before_run`` (called after the user's
    reward file is imported, where a ``register_adv_est`` may be, and after ``--print-config``) also one not
    registered in this process and GAE without a critic micro batch size. Every other registered estimator runs on the
    CPU backend (``benchmarks/bench_estimators.py``, ``docs/estimators.md``); GAE brings VeRL's critic itself.

    Raises:
        BadInputError: one line naming the estimator, why, and what to use instead.
    """
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    name = str(getattr(config.algorithm.adv_estimator, "value", config.algorithm.adv_estimator))
    if name in V1_UNFED_ESTIMATORS:
        raise BadInputError(f"algorithm.adv_estimator={name}: {V1_UNFED_ESTIMATORS[name]}")
    critic = config.get("critic") or {}
    if (
        before_run
        and name == "gae"
        and critic.get("enable") is not False
        and not critic.get("use_dynamic_bsz")
        and not critic.get("ppo_micro_batch_size_per_gpu")
        and not critic.get("ppo_micro_batch_size")
    ):
        # VeRL's validate_config refused it with a hydra InstantiationException traceback naming other keys
        raise BadInputError(
            "algorithm.adv_estimator=gae trains VeRL's critic, which needs a micro batch size: set "
            "critic.ppo_micro_batch_size_per_gpu (e.g. 4), or start from examples/ppo_cpu.yaml"
        )
    if name not in ADV_ESTIMATOR_REGISTRY and before_run:
        usable = sorted(set(ADV_ESTIMATOR_REGISTRY) - set(V1_UNFED_ESTIMATORS))
        raise BadInputError(
            f"algorithm.adv_estimator={name}: VeRL 0.9.1 registers no such estimator; give one of "
            f"{', '.join(usable)} (or register yours with core_algos.register_adv_est)"
        )
