"""The built-in data of ``verl train``: a reasoning-gym task or a GSM8K jsonl as VeRL's RL parquet files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_backend.errors import BadInputError


def prepare_data(keys: dict[str, str], settings, out: Path) -> list[str]:
    """Overrides for the built-in parquet files (reasoning-gym task or GSM8K jsonl, from the ``rl_tpu.*`` data
    settings), written into ``out/data`` unless the user gave ``data.train_files``."""
    from verl_backend.data import gsm8k_jsonl_to_parquet, reasoning_gym_to_parquet

    extra: list[str] = []
    if settings.few_shot and ("data.train_files" in keys or settings.gsm8k_jsonl):
        given = "data.train_files" if "data.train_files" in keys else "rl_tpu.gsm8k_jsonl"
        raise BadInputError(
            f"rl_tpu.few_shot={settings.few_shot} applies to the built-in reasoning-gym data, and {given} is set: "
            "put the worked examples in your rows' prompt messages instead, or set rl_tpu.few_shot=0"
        )
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
                raise BadInputError(
                    f"rl_tpu.gsm8k_jsonl={src}: {len(df)} row(s), too few to hold out "
                    f"{n_val} for validation (rl_tpu.gsm8k_val_fraction={fraction}) and train on "
                    "the rest; give more rows"
                )
            val = data_dir / "gsm8k_val.parquet"
            df.iloc[-n_val:].to_parquet(val, index=False)
            df.iloc[:-n_val].to_parquet(train, index=False)
        else:
            task, seed, task_config = settings.task, settings.seed, settings.task_config or {}
            shots = builtin_shots(settings)
            train = reasoning_gym_to_parquet(
                task,
                data_dir / f"{task}_train.parquet",
                size=settings.train_size,
                seed=seed,
                split="train",
                task_config=task_config,
                shots=shots,
            )
            val = reasoning_gym_to_parquet(
                task,
                data_dir / f"{task}_val.parquet",
                size=settings.val_size,
                seed=seed + 1000,
                split="test",
                task_config=task_config,
                shots=shots,
            )
        extra += [f"data.train_files={train}", f"data.val_files={val}"]
    return extra


def builtin_shots(settings) -> list[tuple[str, str]]:
    """The ``rl_tpu.few_shot`` worked examples of the built-in task: drawn at ``rl_tpu.seed + 3000``, none of them a
    training (seed) or held-out (seed + 1000) question. Returns ``[(question, answer), ...]``."""
    from verl_backend.data.converters import few_shot_examples, reasoning_gym_dataset

    if not settings.few_shot:
        return []
    cfg = settings.task_config or {}
    seen = {
        e["question"]
        for seed, size in ((settings.seed, settings.train_size), (settings.seed + 1000, settings.val_size))
        for e in reasoning_gym_dataset(settings.task, size, seed, cfg)
    }
    return few_shot_examples(settings.task, settings.few_shot, seed=settings.seed + 3000, exclude=seen, task_config=cfg)


def data_files(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def validate_data_files(config, user_keys) -> None:
    """Check every ``data.train_files`` / ``data.val_files`` parquet against VeRL's RL format (one line per problem).

    Args:
        config: the composed VeRL config.
        user_keys: the override keys the job set (a file VeRL names by default and the user never set is refused
            with the hint to set it).

    Raises:
        BadInputError: no files, a default path that does not exist, or a malformed file (file, row, column, fix).
    """
    from verl_backend.data import validate_rl_parquet

    for key in ("train_files", "val_files"):
        files = data_files(config.data.get(key))
        if not files:
            raise BadInputError(
                f"data.{key} is empty: give one or more parquet files (or leave data.train_files "
                "and data.val_files unset for the built-in rl_tpu.* data)"
            )
        for f in files:
            if not Path(f).is_file() and f"data.{key}" not in user_keys:
                raise BadInputError(
                    f"data.{key} is VeRL's default {f}, which does not exist: set data.{key} too "
                    "when you set data.train_files or data.val_files"
                )
            validate_rl_parquet(f)
