"""``verl train``: plan the job (backend defaults, model, data, output folder), then run VeRL's trainer."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from verl_backend.errors import BadInputError, recorded_bad_input
from verl_backend.launch import compose_config, flatten_yaml_overrides, merge_overrides

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "grpo_cpu.yaml"


def _split_rl_tpu(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separate ``rl_tpu.<key>=value`` settings (ours, checked by :func:`verl_backend.settings.resolve`) from VeRL's
    Hydra overrides."""
    verl, ours = [], {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        if key.startswith("rl_tpu."):
            if "=" not in o:
                raise BadInputError(f"{o!r}: give rl_tpu settings as rl_tpu.<key>=<value>; `verl train --help` lists them")
            ours[key[len("rl_tpu."):]] = o.split("=", 1)[1].strip()
        else:
            verl.append(o)
    return verl, ours


def _guard_user_reward(overrides: list[str]) -> list[str]:
    """Route a user's ``reward.custom_reward_function.path/name`` through :func:`guarded_score`.

    The user's function is still the one that scores; the wrapper turns an exception or a NaN into one clear
    error naming the function and the sample. VeRL's older top-level ``custom_reward_function.path/name`` (which
    VeRL 0.9.1 migrates under ``reward.``) is routed the same way; before, it was passed on and silently lost.
    """
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        bare = key.lstrip("+").removeprefix("reward.")  # VeRL's old top-level custom_reward_function.* too
        if bare == "custom_reward_function.path" and value.strip("\"'") not in ("", "null", "pkg://verl_backend.data.rewards"):
            out.append(f"+reward.custom_reward_function.reward_kwargs.user_fn_path={value}")
        elif bare == "custom_reward_function.name":
            out.append(f"+reward.custom_reward_function.reward_kwargs.user_fn_name={value}")
        else:
            out.append(o)
    return out


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


def _check_backend(backend: str) -> None:
    from rl_tpu.device import BACKENDS, DeviceError, require_tpu

    if backend not in BACKENDS:
        raise BadInputError(f"--backend {backend!r} is unknown: choose one of {', '.join(BACKENDS)}")
    if backend == "tpu":
        try:
            require_tpu()
        except DeviceError as exc:
            raise BadInputError(str(exc)) from None
    if backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInputError("--backend cuda: no CUDA GPU visible; use --backend cpu, or run on a GPU machine")


def _prepare_data(keys: dict[str, str], settings, out: Path) -> list[str]:
    """Overrides for the built-in parquet files (reasoning-gym task or GSM8K jsonl, from the ``rl_tpu.*`` data
    settings), written into ``out/data`` unless the user gave ``data.train_files``."""
    from verl_backend.data import gsm8k_jsonl_to_parquet, reasoning_gym_to_parquet

    extra: list[str] = []
    if "data.train_files" not in keys:
        data_dir = out / "data"
        if settings.gsm8k_jsonl:
            src = Path(settings.gsm8k_jsonl).expanduser()
            train = gsm8k_jsonl_to_parquet(src, data_dir / "gsm8k_train.parquet", split="train")
            import pandas as pd

            df = pd.read_parquet(train)
            fraction = settings.gsm8k_val_fraction
            if fraction > 0.9:
                raise BadInputError(f"rl_tpu.gsm8k_val_fraction={fraction}: give a value between 0 and 0.9")
            n_val = max(1, int(len(df) * fraction))
            if len(df) - n_val < 1:
                raise BadInputError(f"rl_tpu.gsm8k_jsonl={src}: {len(df)} row(s), too few to hold out "
                                    f"{n_val} for validation (rl_tpu.gsm8k_val_fraction={fraction}) and train on "
                                    "the rest; give more rows")
            val = data_dir / "gsm8k_val.parquet"
            df.iloc[-n_val:].to_parquet(val, index=False)
            df.iloc[:-n_val].to_parquet(train, index=False)
        else:
            task, seed, task_config = settings.task, settings.seed, settings.task_config or {}
            train = reasoning_gym_to_parquet(task, data_dir / f"{task}_train.parquet", size=settings.train_size,
                                             seed=seed, split="train", task_config=task_config)
            val = reasoning_gym_to_parquet(task, data_dir / f"{task}_val.parquet", size=settings.val_size,
                                           seed=seed + 1000, split="test", task_config=task_config)
        extra += [f"data.train_files={train}", f"data.val_files={val}"]
    return extra


def _data_files(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


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


def _check_prompt_lengths(config) -> None:
    """Count prompts longer than ``data.max_prompt_length`` and say what happens to them (never silent)."""
    import pandas as pd

    limit = int(config.data.max_prompt_length)  # a whole number: check_whole_numbers ran first
    tok = _tokenizer(str(config.actor_rollout_ref.model.path))
    for key in ("train_files", "val_files"):
        for f in _data_files(config.data.get(key)):
            df = pd.read_parquet(f)
            lengths = [_n_prompt_tokens(tok, list(p)) for p in df["prompt"]]
            too_long = sum(n > limit for n in lengths)
            if not too_long:
                continue
            if not config.data.filter_overlong_prompts:
                raise BadInputError(
                    f"{f}: {too_long} of {len(df)} prompts are longer than data.max_prompt_length={limit} tokens "
                    f"(longest {max(lengths)}); raise data.max_prompt_length or set data.filter_overlong_prompts=true"
                )
            if too_long == len(df):
                raise BadInputError(
                    f"{f}: all {len(df)} prompts are longer than data.max_prompt_length={limit}; raise it"
                )
            print(f"[rl-tpu] {f}: dropping {too_long} of {len(df)} prompts longer than {limit} tokens "
                  "(data.filter_overlong_prompts=true)")


def check_native_rollout(config) -> None:
    """Refuse, before any process starts, native-rollout settings that would only fail inside Ray.

    - ``actor_rollout_ref.rollout.checkpoint_engine`` must be a mapping (the weight sync reads its bucket size).
    - ``engine_kwargs.native.sampler_placement`` must be valid (:func:`verl_backend.rollout.adapter.sampler_placement`).
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
        sampler_placement(rollout)
    except ValueError as exc:
        raise BadInputError(str(exc)) from None
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
    ("data.train_batch_size", 1, False), ("data.max_prompt_length", 1, False), ("data.max_response_length", 1, False),
    ("actor_rollout_ref.rollout.n", 1, False), ("actor_rollout_ref.rollout.prompt_length", 1, True),
    ("actor_rollout_ref.rollout.response_length", 1, True), ("actor_rollout_ref.actor.ppo_mini_batch_size", 1, True),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1, True), ("actor_rollout_ref.actor.ppo_epochs", 1, True),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 1, True),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1, True), ("critic.ppo_mini_batch_size", 1, True),
    ("critic.ppo_micro_batch_size_per_gpu", 1, True), ("trainer.total_training_steps", 1, True),
    ("trainer.total_epochs", 1, False), ("trainer.n_gpus_per_node", 1, False), ("trainer.nnodes", 1, False),
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
            raise BadInputError(f"{key}={value!r}: give a whole number of {low} or more"
                                + (" (or null for VeRL's default)" if nullable else ""))


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

    files = _data_files(config.data.get("train_files"))
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
    bound = (f" ({rows} rows is an upper bound: data.filter_overlong_prompts=true may drop some)"
             if config.data.get("filter_overlong_prompts") else "")
    print(f"[rl-tpu] trainer.total_training_steps={steps} needs {needed} epochs of {batches} batches ({rows} rows "
          f"/ data.train_batch_size {batch}); trainer.total_epochs raised from {epochs} to {needed}{bound}", flush=True)


def last_checkpoint_step(ckpts: Path) -> int | None:
    """The step in VeRL's ``<trainer.default_local_dir>/latest_checkpointed_iteration.txt``, or ``None`` when there
    is none (or it is unreadable: VeRL then starts over)."""
    try:
        return int((Path(ckpts) / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return None


RUN_ARTIFACTS = ("metrics.jsonl", "tensorboard", "reward_curve.png", "summary.json")


def prepare_run_folder(config, out: Path) -> None:
    """Resume, refuse, or start over cleanly in a run folder that may hold an earlier run.

    VeRL's default ``trainer.resume_mode=auto`` continues from ``<trainer.default_local_dir>/
    latest_checkpointed_iteration.txt`` and appends to ``metrics.jsonl``. Before this, rerunning a finished job's
    command trained 0 steps and printed the earlier run's accuracy as new, and a run with nothing to resume (no
    checkpoint, or ``resume_mode=disable``) wrote its metrics after the earlier run's and its checkpoints among them.

    - a checkpoint to resume, before the last step: say so; end ``metrics.jsonl`` with a newline if a kill cut it;
    - a checkpoint at ``trainer.total_training_steps`` already (and ``resume_mode=auto``): refuse, nothing to train;
    - no resume but earlier metrics or checkpoints here: move them into ``<out>/earlier/<time>/`` (renames, so
      nothing is lost) and say so. Checkpoints kept outside ``out`` (a ``trainer.default_local_dir`` elsewhere)
      are not moved; with ``resume_mode=disable`` over them the run is refused instead.

    Raises:
        BadInputError: nothing left to train, or earlier checkpoints outside ``out`` that a fresh run would mix into.
    """
    mode = str(config.trainer.get("resume_mode", "auto"))
    if mode not in ("auto", "disable"):
        return  # resume_path: VeRL resumes the checkpoint the user named (trainer.resume_from_path), as it is
    ckpts = Path(str(config.trainer.default_local_dir))
    step = last_checkpoint_step(ckpts)
    if mode == "auto" and step is not None:
        total = config.trainer.get("total_training_steps")
        if total is not None and step >= int(total):
            raise BadInputError(
                f"{ckpts} already holds the checkpoint of step {step}, the last of trainer.total_training_steps="
                f"{total}: nothing to train; give another --output-dir (or trainer.experiment_name), or raise "
                "trainer.total_training_steps to train on"
            )
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size and not metrics.read_bytes().endswith(b"\n"):
            with open(metrics, "ab") as f:  # a cut last line would swallow the resumed run's first row
                f.write(b"\n")
        print(f"[rl-tpu] resuming from the checkpoint of step {step} in {ckpts} (VeRL's trainer.resume_mode=auto); "
              "give another --output-dir, or move that folder away, to start over", flush=True)
        return
    earlier = [out / name for name in RUN_ARTIFACTS if (out / name).exists()]
    has_steps = ckpts.is_dir() and any(ckpts.glob("global_step_*"))
    inside = ckpts.resolve().parent == out.resolve()
    if has_steps and not inside:
        raise BadInputError(
            f"trainer.default_local_dir={ckpts} holds checkpoints of an earlier run that trainer.resume_mode={mode} "
            "would mix new ones into; give another trainer.default_local_dir, or move those away"
        )
    if has_steps:
        earlier.append(ckpts)
    if not earlier:
        return
    dest = out / "earlier" / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True, exist_ok=False)
    for path in earlier:
        path.rename(dest / path.name)
    print(f"[rl-tpu] {out} held an earlier run with nothing to resume ({', '.join(p.name for p in earlier)}): moved "
          f"to {dest}; starting over", flush=True)


_RUN_LOCK_FD: int | None = None  # held open (and locked) for this process's life


def lock_run_folder(out: Path) -> None:
    """Take ``<out>/.verl_train.lock`` (``fcntl.flock``) for this process, so a second ``verl train`` into the same
    folder stops at once instead of interleaving its metrics and checkpoints with the first's.

    Raises:
        BadInputError: another live process holds the folder (its pid named).
    """
    import fcntl

    global _RUN_LOCK_FD
    fd = os.open(out / ".verl_train.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise BadInputError(f"{out} is in use by another verl train (pid {holder}): give another --output-dir, or "
                            "wait for that run to end") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _RUN_LOCK_FD = fd


PATH_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "actor_rollout_ref.model.tokenizer_path",
             "critic.model.tokenizer_path")


DATA_FILE_KEYS = ("data.train_files", "data.val_files")


def _normalized_path(override: str) -> str:
    """A model-path override with ``~`` expanded and no trailing ``/``: VeRL 0.9.1's ``HFModelConfig`` asserts
    on a trailing slash (a traceback deep in Hydra instantiation) and does not expand ``~``. A data file given as
    one ``~/...`` path is expanded too (Hydra's override grammar rejects a bare ``~`` there)."""
    key, sep, value = override.partition("=")
    bare = key.lstrip("+~")
    if not sep or bare not in PATH_KEYS + DATA_FILE_KEYS:
        return override
    raw = value.strip("\"'")
    if raw in ("", "null", "None"):
        return override
    if bare in DATA_FILE_KEYS:
        return f"{key}={os.path.expanduser(raw)}" if raw.startswith("~") else override
    path = os.path.expanduser(raw)
    path = path.rstrip("/") or "/"
    return f"{key}={path}"


def _check_model_folder(key: str, path: Path, tokenizer_path: str | None) -> None:
    """Refuse a model folder VeRL 0.9.1 would fail on inside a Ray worker, with one line naming ``key``.

    Checks: ``config.json`` and ``*.safetensors`` are there; transformers loads its config and a tokenizer (from
    ``tokenizer_path`` when given); the config has ``num_key_value_heads``, which VeRL's FSDP engine reads for every
    model (``verl/models/transformers/monkey_patch.py``, ``apply_monkey_patch``; GPT-2-style configs lack it).

    Raises:
        BadInputError: the first check that fails.
    """
    from verl_backend.models import is_hf_model_dir

    if not is_hf_model_dir(path):
        raise BadInputError(
            f"{key}={path} is not a model folder (needs config.json and *.safetensors); "
            "pass an HF-format checkpoint folder such as <run>/checkpoints/global_step_N/actor/huggingface"
        )
    from transformers import AutoConfig

    def first_line(exc: Exception) -> str:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise BadInputError(f"{key}={path}: transformers cannot read its config.json ({first_line(exc)}); pass a "
                            "folder written by save_pretrained") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_key_value_heads", None) is None:
        raise BadInputError(
            f"{key}={path}: its {config.model_type} config has no num_key_value_heads, which VeRL 0.9.1's FSDP engine "
            "reads for every model (verl/models/transformers/monkey_patch.py); use a Llama-, Qwen- or Mistral-style "
            "checkpoint"
        )
    tok = Path(os.path.expanduser(tokenizer_path.strip("\"'"))) if tokenizer_path else path
    try:
        _tokenizer(str(tok))
    except Exception as exc:
        raise BadInputError(
            f"{key}={path}: transformers cannot load a tokenizer from {tok} ({first_line(exc)}); copy the base "
            f"model's tokenizer files (tokenizer.json, tokenizer_config.json) into it, or set "
            f"{key.rsplit('.', 1)[0]}.tokenizer_path"
        ) from None


def _model_path(keys: dict[str, str]) -> list[str]:
    from verl_backend.models import ensure_default_model

    for role in ("actor_rollout_ref.model", "critic.model"):
        raw = keys.get(f"{role}.path", "").strip("\"'")
        if raw not in ("", "null", "None") and not raw.startswith("${"):
            _check_model_folder(f"{role}.path", Path(os.path.expanduser(raw)), keys.get(f"{role}.tokenizer_path"))
    if "actor_rollout_ref.model.path" in keys:
        return []
    path = ensure_default_model()
    extra = [f"actor_rollout_ref.model.path={path}"]
    if "critic.model.path" not in keys:
        extra.append(f"critic.model.path={path}")
    return extra


def slice_defaults(slice_arg: str | None) -> tuple[dict[str, str], str]:
    """Resource-pool keys for a TPU slice: one VeRL node per host, one worker per chip (whole chips).

    ``slice_arg`` is ``"v6e-16"`` or ``"v6e-16:4x4"`` (``rl_tpu.slice``, ``--slice``); empty reads
    ``TPU_ACCELERATOR_TYPE``/``TPU_TOPOLOGY`` of this host (set on every TPU VM and by ``rl-tpu cluster up
    --fake-slice``).

    Returns:
        ``(keys, slice)``: the VeRL overrides and the slice as ``"<type>:<topology>"`` for the settings record (the
        TaskRunner reserves it, :mod:`verl_backend.slice_pool`); ``({}, "")`` when neither is given.

    Raises:
        BadInputError: unknown accelerator type or a topology that type does not have.
    """
    from rl_tpu.topology import TopologyError, parse_slice

    if slice_arg:
        acc, _, topo = slice_arg.partition(":")
    elif os.environ.get("TPU_ACCELERATOR_TYPE"):
        acc, topo = os.environ["TPU_ACCELERATOR_TYPE"], os.environ.get("TPU_TOPOLOGY", "")
    else:
        return {}, ""
    try:
        spec = parse_slice(acc, topo or None)
    except TopologyError as exc:
        raise BadInputError(f"rl_tpu.slice={slice_arg or acc}: {exc}") from None
    keys = {"trainer.nnodes": str(spec.hosts), "trainer.n_gpus_per_node": str(spec.chips_per_host)}
    return keys, f"{spec.accelerator_type}:{spec.topology}"


DEFAULT_MICRO_KEYS = ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")


def fit_default_micro_batches(config, user_keys: set[str]) -> None:
    """Lower the embedded default config's micro batch sizes to what each worker gets, when there are many workers.

    ``verl_backend/configs/grpo_cpu.yaml`` sizes its micro batches for one worker (log-prob 8, update 4 of 16
    sequences a step). On a slice (``--slice v6e-16``: 16 workers) each worker gets 1 sequence, which VeRL's engine
    cannot split into micro batches of 8, and :func:`check_batch_sizes` would refuse the README's own command. A
    micro batch size the user set (``user_keys``: on the command line) is never changed; that one is refused there.
    Each change is printed as one ``[rl-tpu]`` line.
    """
    from omegaconf import OmegaConf

    workers = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    n, batch = int(config.actor_rollout_ref.rollout.n), int(config.data.train_batch_size)
    mini = config.actor_rollout_ref.actor.get("ppo_mini_batch_size")
    for key in DEFAULT_MICRO_KEYS:
        micro = OmegaConf.select(config, key)
        if key in user_keys or not micro:
            continue
        share = (int(mini) * n if key.endswith("ppo_micro_batch_size_per_gpu") and mini else batch * n) // workers
        if share < 1 or share % int(micro) == 0:
            continue  # divides, or nothing to split (check_batch_sizes names that)
        fitted = math.gcd(int(micro), share)
        OmegaConf.update(config, key, fitted)
        print(f"[rl-tpu] {key} lowered from {micro} (the embedded default) to {fitted}: each of the {workers} "
              f"workers gets {share} sequence(s) at a time", flush=True)


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
    pool = (f"{workers} workers (trainer.n_gpus_per_node={per_node} × trainer.nnodes={nodes}"
            + (f", from {workers_from})" if workers_from else ")"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # need_critic warns that a non-GAE estimator has no critic
        roles = [("actor_rollout_ref.actor", actor)] + ([("critic", critic)] if need_critic(config) else [])

    def multiple(size: int, of: int) -> int:
        """The smallest value >= size whose product with n is a multiple of ``of``."""
        step = of // math.gcd(of, n)
        return max(step, -(-size // step) * step)

    if not actor.use_dynamic_bsz and (batch * n) % workers:
        raise BadInputError(
            f"data.train_batch_size={batch} × actor_rollout_ref.rollout.n={n} = {batch * n} sequences per step do "
            f"not split evenly over the {pool}: set data.train_batch_size={multiple(batch, workers)} (a multiple "
            f"of {workers // math.gcd(workers, n)}), or run on fewer workers"
        )
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
        sp = max(int(section.get("ulysses_sequence_parallel_size") or 1),
                 int(engine.get("ulysses_sequence_parallel_size") or 1))
        dp = max(1, workers // sp)
        dp_of[role] = dp
        if (mini * n) % dp:
            raise BadInputError(
                f"{role}.ppo_mini_batch_size={mini} × actor_rollout_ref.rollout.n={n} = {mini * n} sequences per "
                f"PPO update do not split over the {dp} data-parallel ranks of the {pool}: set "
                f"{role}.ppo_mini_batch_size={multiple(mini, dp)} (a multiple of {dp // math.gcd(dp, n)})"
            )
    # VeRL's engine splits each rank's share of a PPO update into micro batches (workers/engine/utils.py asserts)
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
    # VeRL's engine splits each rank's share of the batch into log-prob micro batches (workers/engine/utils.py)
    per_rank = batch * n // max(1, workers)
    for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"):
        section = config.actor_rollout_ref.rollout if ".rollout." in key else config.actor_rollout_ref.ref
        micro = section.get("log_prob_micro_batch_size_per_gpu")
        if micro and not section.get("log_prob_use_dynamic_bsz", False) and per_rank % int(micro):
            raise BadInputError(
                f"{key}={micro} does not divide the {per_rank} sequences each worker scores per step "
                f"(data.train_batch_size={batch} × actor_rollout_ref.rollout.n={n} / {workers} workers): set it to a "
                f"divisor of {per_rank}"
            )


def run_train(args) -> int:
    """``verl train``: check and compose the config, then run VeRL's trainer (see the README)."""
    fork_server: dict = {}  # the fork server started for this run (verl_backend.zygote), stopped whatever happens
    try:
        return _run_train(args, fork_server)
    finally:
        if fork_server.get("pid"):
            from verl_backend import zygote

            zygote.stop(fork_server["pid"])


def _run_train(args, fork_server: dict) -> int:
    backend = str(args.backend).strip().lower()
    if not (backend == "tpu" and args.print_config):  # a dry run composes the TPU config without a chip
        _check_backend(backend)
    from dataclasses import replace

    from verl_backend import settings as job_settings
    from verl_backend.cli import PLATFORM_NAME
    from verl_backend.defaults import BACKEND_DEFAULTS

    # The platform must be chosen before VeRL is imported anywhere in this process or its workers.
    os.environ["VERL_PLATFORM"] = PLATFORM_NAME[backend]
    if int(getattr(args, "max_restarts", 0) or 0) < 0:
        raise BadInputError(f"--max-restarts {args.max_restarts}: give 0 (no restart) or more")

    config_path = args.config or (DEFAULT_CONFIG if backend == "cpu" else None)
    file_overrides, file_ours = flatten_yaml_overrides(config_path) if config_path else ([], {})
    cli_overrides, cli_ours = _split_rl_tpu(list(args.overrides))
    if "task" in cli_ours and "task_config" not in cli_ours and cli_ours["task"] != file_ours.get("task"):
        file_ours = {k: v for k, v in file_ours.items() if k != "task_config"}  # belongs to the file's task
    settings = job_settings.resolve(cli_ours, file_ours, file_name=f"--config {config_path}", flags={
        "--num-threads": args.num_threads, "--tpu-eager-mode": getattr(args, "tpu_eager_mode", None),
        "--slice": getattr(args, "slice", None)})
    if backend != "tpu" and settings.tpu_eager_mode != "strict":
        raise BadInputError(f"rl_tpu.tpu_eager_mode={settings.tpu_eager_mode} (--tpu-eager-mode) applies to "
                            f"--backend tpu only, not {backend}")
    if settings.compact_malloc and backend == "cpu":
        from rl_tpu.device import host_malloc_env, tune_host_malloc

        os.environ.update(host_malloc_env())  # every process started from here on (Ray's, the workers)
        tune_host_malloc()  # this one, and the fork server forked from it (verl_backend.zygote)
    settings = replace(settings, num_threads=settings.num_threads or (1 if backend == "cpu" else 0))
    if settings.num_threads:
        os.environ["OMP_NUM_THREADS"] = str(settings.num_threads)  # this process; workers get the record (below)
    if backend != "tpu":
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # skip TorchTPU's 5-20 s import hook

    file_overrides, cli_overrides = _guard_user_reward(file_overrides), _guard_user_reward(cli_overrides)
    defaults = dict(BACKEND_DEFAULTS[backend])
    defaults.update(job_settings.env_overrides())  # deprecated aliases of VeRL keys: above defaults, below the rest
    slice_keys: dict[str, str] = {}
    if backend == "tpu" or (backend == "cpu" and settings.slice):
        # cpu + --slice: a dry run of a TPU job's placement on a (fake) slice, one CPU worker per chip
        slice_keys, resolved_slice = slice_defaults(settings.slice)
        settings = replace(settings, slice=resolved_slice)
        defaults.update(slice_keys)
    elif settings.slice:
        raise BadInputError(f"rl_tpu.slice (--slice) applies to --backend tpu (or cpu, as a dry run), not {backend}")
    merged = [_normalized_path(o) for o in merge_overrides(defaults, file_overrides, cli_overrides)]
    keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in merged}

    experiment = keys.get("trainer.experiment_name", "grpo_smollm2").strip("\"'")
    out = Path(args.output_dir or Path("outputs") / experiment).resolve()
    what = "--output-dir" if args.output_dir else "run folder"
    if out.exists() and not out.is_dir():
        raise BadInputError(f"{what} {out} is a file, not a folder: give a folder path (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInputError(f"{what} {out}: cannot create it ({exc.strerror}); give a folder that can be written") \
            from None
    if not args.print_config:
        _fork_server_here(backend, fork_server, settings)  # first: while this process has one thread and no Ray
        lock_run_folder(out)
    extra = _model_path(keys) + _prepare_data(keys, settings, out)
    if "trainer.default_local_dir" not in keys:
        extra.append(f"trainer.default_local_dir={out / 'checkpoints'}")
    config = compose_config(merged + extra)
    check_whole_numbers(config)
    if config_path == DEFAULT_CONFIG:
        fit_default_micro_batches(config, {o.split("=", 1)[0].lstrip("+~") for o in cli_overrides})
    from verl_backend.bypass_guard import guard_bypass

    guard_bypass(config, {o.split("=", 1)[0].lstrip("+~") for o in file_overrides + cli_overrides})
    from_slice = slice_keys and all(keys.get(k) == v for k, v in slice_keys.items())
    check_batch_sizes(config, workers_from=(f"rl_tpu.slice={settings.slice}" if getattr(args, "slice", None) or
                                            "slice" in cli_ours or "slice" in file_ours else
                                            "$TPU_ACCELERATOR_TYPE") if from_slice else "")
    from omegaconf import OmegaConf, open_dict

    settings = job_settings.mirror_from_config(settings, config)
    with open_dict(config):
        config.rl_tpu = job_settings.as_dict(settings)  # printed, saved in config.yaml; workers get the record
    if args.print_config:
        print(OmegaConf.to_yaml(config))
        return 0

    from verl_backend.data import validate_rl_parquet

    for key in ("train_files", "val_files"):
        files = _data_files(config.data.get(key))
        if not files:
            raise BadInputError(f"data.{key} is empty: give one or more parquet files (or leave data.train_files "
                                "and data.val_files unset for the built-in rl_tpu.* data)")
        for f in files:
            if not Path(f).is_file() and f"data.{key}" not in keys:
                raise BadInputError(f"data.{key} is VeRL's default {f}, which does not exist: set data.{key} too "
                                    "when you set data.train_files or data.val_files")
            validate_rl_parquet(f)
    _check_prompt_lengths(config)
    check_user_reward(config)
    check_native_rollout(config)
    fit_epochs_to_steps(config)
    prepare_run_folder(config, out)

    env = {
        "VERL_PLATFORM": os.environ["VERL_PLATFORM"],
        "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"),
        "TENSORBOARD_DIR": str(out / "tensorboard"),
        "TOKENIZERS_PARALLELISM": "false",
        # the job's rl_tpu settings, for every Ray worker on every host (verl_backend.settings.current)
        job_settings.RECORD_ENV: job_settings.record(settings),
        # Ray starts a spare worker per CPU slot when the driver connects; none is ever used here (~0.05 GiB each)
        "RAY_prestart_worker_first_driver": "0",
        # ... and keeps up to num_cpus (16 here, see below) idle workers alive (~0.1 GiB each): here they end after
        # Ray's 1 s idle threshold, and a later task starts a new one (about a second from the fork server)
        "RAY_num_workers_soft_limit": os.environ.get("RAY_num_workers_soft_limit", "0"),
        # TransferQueue's copy threads (default 8): at most the cores there are (it warns on every put otherwise)
        "TQ_NUM_THREADS": os.environ.get("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1))),
    }
    from rl_tpu.device import HOST_MALLOC_ENV

    for k in ("OMP_NUM_THREADS", "TORCH_DEVICE_BACKEND_AUTOLOAD", "TPU_SKIP_MDS_QUERY", "RL_TPU_CACHE",
              *HOST_MALLOC_ENV):
        if k in os.environ:
            env[k] = os.environ[k]
    os.environ.update(env)
    _apply_tq_num_threads(env["TQ_NUM_THREADS"])
    print(f"[rl-tpu] settings record {job_settings.digest(env[job_settings.RECORD_ENV])} goes to every worker "
          "with the job", flush=True)
    with open_dict(config):
        runtime_env = config.ray_kwargs.ray_init.setdefault("runtime_env", {})
        runtime_env["env_vars"] = {**dict(runtime_env.get("env_vars") or {}), **env}
        if not os.environ.get("RAY_ADDRESS") and config.ray_kwargs.ray_init.get("num_cpus") is None:
            # VeRL's TaskRunner, TransferQueue, agent-loop and reward actors each need a CPU slot to be
            # scheduled; on a 2-core machine Ray's default (one slot per core) leaves the job waiting forever.
            config.ray_kwargs.ray_init.num_cpus = max(16, os.cpu_count() or 1)
        config.ray_kwargs.ray_init.setdefault("include_dashboard", False)
        if fork_server.get("socket") and not runtime_env.get("py_executable"):
            from verl_backend.zygote import worker_py_executable

            runtime_env["py_executable"] = worker_py_executable(fork_server["socket"])
    OmegaConf.save(config, out / "config.yaml")

    from verl_backend.report import write_report

    import gc

    from rl_tpu.device import trim_host_heap

    gc.collect()  # what set-up read (data checks, tokenizer) is not needed while the driver waits on Ray
    trim_host_heap()
    start = time.time()
    _run_with_restarts(config, max_restarts=int(getattr(args, "max_restarts", 0) or 0),
                       task_runner=settings.task_runner)
    summary = write_report(out, wall_s=time.time() - start)
    print(summary)
    return 0


ACTOR_FAILURES = ("ActorDiedError", "ActorUnavailableError", "RayActorError", "WorkerCrashedError",
                  "OutOfMemoryError", "NodeDiedError", "ObjectLostError", "OwnerDiedError")


def _actor_failure(exc: BaseException) -> BaseException | None:
    """The Ray actor/worker failure somewhere in ``exc``'s cause chain, or ``None``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(type(exc).__name__.startswith(n) or f"({n})" in type(exc).__name__ for n in ACTOR_FAILURES):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


# Not RAY_KILL: VeRL itself ray.kill()s its TransferQueue actors when a run ends, failed or not.
UNEXPECTED_DEATHS = ("WORKER_DIED", "OUT_OF_MEMORY", "NODE_DIED", "SYSTEM_ERROR")


def _dead_actor_in_cluster() -> str | None:
    """Class name of an actor of this job that died unexpectedly (killed, crashed, OOM, node lost), or ``None``.

    VeRL's agent loop catches a dead rollout server's ``ActorDiedError`` and raises a generic ``RuntimeError``
    ("no materializable trajectories"), so the exception alone cannot tell a dead actor from a bug; Ray's actor
    table (GCS) can.
    """
    import ray

    try:
        table = ray._private.state.actors()
    except Exception:
        return None
    for info in table.values():
        if info.get("State") == "DEAD" and any(k in str(info.get("DeathCause", "")) for k in UNEXPECTED_DEATHS):
            return info.get("ActorClassName") or "actor"
    return None


class ActorFailedError(RuntimeError):
    """A Ray actor of the run died (killed, crashed, OOM, node lost) with no restart left; the message names it and
    the checkpoint to resume from. ``verl`` prints the cause's traceback, then this line, and exits 1."""


def _fork_server_here(backend: str, fork_server: dict, settings) -> None:
    """Fork :mod:`verl_backend.zygote`'s server from this process for a local CPU job (its pid and socket go into
    ``fork_server``); nothing where it does not apply: another backend, a Ray cluster (``RAY_ADDRESS``), not Linux,
    ``rl_tpu.fork_server=false``, or Ray already imported here (the workers then start as plain processes)."""
    from verl_backend import zygote

    if not settings.fork_server or backend != "cpu" or os.environ.get("RAY_ADDRESS") \
            or not sys.platform.startswith("linux"):
        return
    started = zygote.fork_here()
    if started is not None:
        fork_server["pid"], fork_server["socket"] = started


def _run_with_restarts(config, max_restarts: int, task_runner: str = "driver") -> None:
    """Run VeRL; after a dead actor, start again from the last checkpoint (VeRL's ``resume_mode=auto``).

    Only failures of Ray actors/workers (killed, crashed, out of memory, node lost) are retried; a bug or bad
    input fails at once. Each restart tears the job's actors down (``ray.shutdown``) so their placement groups
    are released, then VeRL finds ``latest_checkpointed_iteration.txt`` and continues from that step.
    """
    import ray
    from omegaconf import open_dict

    for attempt in range(max_restarts + 1):
        try:
            _run_verl(config, task_runner)
            return
        except Exception as exc:
            recorded = recorded_bad_input()  # a worker's bad input that VeRL's agent loop logged and went past
            if recorded is not None:
                raise BadInputError(recorded) from exc
            failure = _actor_failure(exc)
            name = type(failure).__name__ if failure is not None else _dead_actor_in_cluster()
            if name is None:
                raise
            step = last_checkpoint_step(Path(config.trainer.default_local_dir))
            step = "none (starting over)" if step is None else step
            if attempt == max_restarts:
                dead = _dead_actor_in_cluster() or name
                raise ActorFailedError(
                    f"a Ray actor of this run failed ({dead}) and no restart is left (--max-restarts {max_restarts}); "
                    f"last checkpoint: step {step}; run the same command again to resume from it"
                ) from exc
            print(f"[rl-tpu] a Ray actor failed ({name}); restarting from checkpoint step {step} "
                  f"(restart {attempt + 1} of {max_restarts})", flush=True)
            ray.shutdown()
            with open_dict(config):
                config.trainer.resume_mode = "auto"


def _apply_tq_num_threads(threads: str) -> None:
    """TransferQueue reads ``TQ_NUM_THREADS`` once, at import. With VeRL's TaskRunner in this process it may be
    imported before the variable is set, and Ray ships its storage actor's methods with this process's module
    globals, so set the value where it was already read (else every put and get warns that 8 threads exceed the
    cores)."""
    import sys

    if not threads.strip().isdigit():
        return  # TransferQueue's own int() names it
    for name in ("transfer_queue.client", "transfer_queue.storage.simple_storage"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "TQ_NUM_THREADS"):
            module.TQ_NUM_THREADS = int(threads)


class _TaskRunnerInDriver:
    """VeRL's ``TaskRunner`` class as ``run_ppo`` uses it (``.remote()``, then ``ray.get(runner.run.remote(config))``),
    but run in this process instead of as a Ray actor.

    The TaskRunner only orchestrates: it builds the worker groups, TransferQueue and the agent loop, then drives the
    trainer's loop, while the driver waits on it. As an actor it is one more process that imports torch and VeRL
    (0.45-0.5 GiB at the default job's peak); here it shares the driver's. Its ``run`` is VeRL's, unchanged.
    """

    def __init__(self, actor_class) -> None:
        # Ray 2.60 keeps the undecorated class here (ray/actor.py, _modify_class); the class cannot be called as is
        self._cls = actor_class.__ray_metadata__.modified_class.__ray_actor_class__

    def options(self, **_):  # run_ppo's nsight branch (CUDA profiling) asks for actor options
        return self

    def remote(self):
        import ray

        from verl_backend import preemption

        # ray.init (just run by run_ppo) leaves its core worker's failure handler on SIGTERM: a crash dump and
        # SIGABRT (exit 134). Here it ends the run at the next step boundary with a checkpoint (preemption).
        preemption.install()
        runner = self._cls()

        class _Run:
            @staticmethod
            def remote(config):
                runner.run(config)
                return ray.put(None)  # what run_ppo's ray.get waits on

        return type("TaskRunnerInDriver", (), {"run": _Run})()


def task_runner_class(where: str = "driver"):
    """The ``task_runner_class`` for VeRL's ``run_ppo``: in this process unless ``where`` is ``"actor"``
    (``rl_tpu.task_runner``), or a Ray without the undecorated class where this looks for it."""
    from verl.trainer.main_ppo import TaskRunnerV1

    metadata = getattr(TaskRunnerV1, "__ray_metadata__", None)
    if where == "actor" or \
            not hasattr(getattr(metadata, "modified_class", None), "__ray_actor_class__"):
        return TaskRunnerV1
    return _TaskRunnerInDriver(TaskRunnerV1)


def _run_verl(config, task_runner: str = "driver") -> None:
    """VeRL's own entry (``verl.trainer.main_ppo.main``'s body): device check, config validation, ``run_ppo``."""
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=task_runner_class(task_runner))
