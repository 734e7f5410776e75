"""Converters to VeRL's RL parquet format.

VeRL 0.9.1's ``RLHFDataset`` reads parquet rows with the columns
``data_source`` (str), ``prompt`` (list of chat messages ``{"role", "content"}``), ``ability`` (str),
``reward_model`` (``{"style": "rule", "ground_truth": str}``) and ``extra_info`` (``{"split", "index", ...}``);
``data_source`` selects the reward function (see :mod:`verl_backend.data.rewards`).

Every converter writes atomically (temporary file, then ``os.replace``) and reports bad rows with the file and
row number instead of dropping them.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from verl_backend.errors import BadInputError

# No example answer in the prompt: with "e.g. <answer>42</answer>" the base model's greedy answer ended in 42 on 64 of
# 200 validation items (accuracy 33.0%); without it, on 1 (43.5%) — benchmarks/bench_recipe.py, docs/recipe.md. The
# fifth screen's " End with the final answer as <answer>N</answer>, where N is the number." drew the tags 4x as often
# at T=0.7, but its seed-1 run with the format reward lost 3.0 points on the report set: not adopted (docs/recipe.md).
PROMPT_SUFFIX = " Give the final answer as a number inside <answer></answer> tags."
REQUIRED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def _write_parquet_atomic(rows: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        pd.DataFrame(rows).to_parquet(tmp, index=False)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def prompt_messages(question: str, shots: Sequence[tuple[str, str]] = ()) -> list[dict[str, str]]:
    """The chat messages of one problem: each worked example as a user turn and the assistant's reply, then the
    question, every user turn ending in :data:`PROMPT_SUFFIX`.

    Args:
        question: the problem's text.
        shots: ``(question, reply)`` worked examples (:func:`few_shot_examples`), shown in order.

    Returns: ``[{"role": "user"|"assistant", "content": str}, ...]``, ``2 * len(shots) + 1`` messages.
    """
    messages: list[dict[str, str]] = []
    for q, a in shots:
        messages += [
            {"role": "user", "content": q.strip() + PROMPT_SUFFIX},
            {"role": "assistant", "content": a},
        ]
    return messages + [{"role": "user", "content": question.strip() + PROMPT_SUFFIX}]


def reasoning_gym_dataset(task: str, size: int, seed: int, cfg: dict[str, Any]):
    """``size`` items of a reasoning-gym task at ``seed`` (``reasoning_gym.create_dataset``).

    Raises:
        BadInputError: unknown task name or bad task config.
    """
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **cfg)
    except (KeyError, ValueError, TypeError, AssertionError) as exc:
        raise BadInputError(
            f"reasoning-gym task {task!r} with config {cfg} cannot be created ({exc}); "
            "check the task name (reasoning_gym.factory.DATASETS) and its config fields"
        ) from None


def few_shot_examples(
    task: str, k: int, *, seed: int, exclude: Iterable[str] = (), task_config: dict[str, Any] | None = None
) -> list[tuple[str, str]]:
    """``k`` worked examples of a reasoning-gym task for the prompt, none of them a problem in ``exclude``.

    They are the first items of the task's own generator at ``seed`` (a stream of its own: the built-in data uses
    ``rl_tpu.seed + 3000``) whose questions are not in ``exclude`` (the training and held-out questions), so no
    example gives away the answer of a problem the run trains or is judged on. The reply works the problem when the
    task's metadata gives its ``expression`` (reasoning-gym's arithmetic tasks): ``"18 + 45 = 63\n<answer>63</answer>"``;
    else it is the tagged answer alone. The working matters: on SmolLM2-135M-Instruct and 96 additions, one example
    with it gave 69% right greedily, one without it 11% (the model copied the bare form and guessed; docs/recipe.md).

    Returns: ``[(question, reply), ...]``, ``k`` pairs.

    Raises:
        BadInputError: the task cannot be created, or fewer than ``k`` questions outside ``exclude`` among
            ``64 * k`` of its items (a task too small to hold examples apart: lower ``rl_tpu.few_shot``).
    """
    if k <= 0:
        return []
    cfg = dict(task_config or {})
    taken = set(exclude)
    shots: list[tuple[str, str]] = []
    for entry in reasoning_gym_dataset(task, 64 * k, seed, cfg):
        if entry["question"] not in taken:
            taken.add(entry["question"])
            answer = str(entry["answer"])
            expression = (entry.get("metadata") or {}).get("expression")
            reply = f"<answer>{answer}</answer>"
            shots.append((entry["question"], f"{expression} = {answer}\n{reply}" if expression else reply))
            if len(shots) == k:
                return shots
    raise BadInputError(
        f"rl_tpu.few_shot={k}: reasoning-gym task {task!r} with config {cfg} gave only {len(shots)} question(s) "
        f"outside the training and held-out items among {64 * k} drawn; lower rl_tpu.few_shot or widen the task"
    )


def _row(
    data_source: str,
    question: str,
    answer: str,
    split: str,
    index: int,
    extra: dict | None = None,
    shots: Sequence[tuple[str, str]] = (),
) -> dict:
    return {
        "data_source": data_source,
        "prompt": prompt_messages(question, shots),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, **(extra or {})},
    }


def reasoning_gym_to_parquet(
    task: str,
    path: str | os.PathLike,
    *,
    size: int,
    seed: int,
    split: str = "train",
    task_config: dict[str, Any] | None = None,
    shots: Sequence[tuple[str, str]] = (),
) -> Path:
    """Write ``size`` items of a reasoning-gym task as VeRL RL parquet.

    ``data_source`` is ``"reasoning_gym/<task>"``; ``extra_info`` keeps ``task``, ``seed``, ``size`` and the
    task config so the reward function can rebuild the exact entry and call reasoning-gym's own
    ``score_answer``.

    Args:
        task: a reasoning-gym dataset name, e.g. ``"basic_arithmetic"``.
        path: output ``.parquet`` file.
        size: number of rows.
        seed: dataset seed (use different seeds for train and validation).
        split: value written to ``extra_info.split``.
        task_config: extra keyword arguments for ``reasoning_gym.create_dataset`` (e.g. ``max_terms=2``).
        shots: worked examples put before every question as earlier chat turns (:func:`prompt_messages`).

    Raises:
        BadInputError: unknown task name or bad task config.
    """
    cfg = dict(task_config or {})
    dataset = reasoning_gym_dataset(task, size, seed, cfg)
    rows = [
        _row(
            f"reasoning_gym/{task}",
            entry["question"],
            entry["answer"],
            split,
            i,
            {"task": task, "seed": seed, "size": size, "task_config": json.dumps(cfg)},
            shots,
        )
        for i, entry in enumerate(dataset)
    ]
    return _write_parquet_atomic(rows, path)


def gsm8k_jsonl_to_parquet(src: str | os.PathLike, path: str | os.PathLike, *, split: str = "train") -> Path:
    """Convert GSM8K-format jsonl (``question``, ``answer`` ending in ``#### <number>``) to VeRL RL parquet.

    The ground truth is the number after ``####`` with thousands separators removed; ``data_source`` is
    ``"openai/gsm8k"`` (VeRL's own name for it).

    Raises:
        BadInputError: unreadable file, a row that is not JSON, lacks ``question``/``answer``, or whose answer
            has no ``#### <number>`` line — naming the file and the 1-based row.
    """
    src = Path(src)
    if not src.is_file():
        raise BadInputError(f"{src}: no such GSM8K jsonl file; pass a file with one JSON object per line")
    rows = []
    with src.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadInputError(f"{src}:{lineno}: not valid JSON ({exc.msg}); fix or remove that row") from None
            if not isinstance(item, dict):
                raise BadInputError(f"{src}:{lineno}: expected a JSON object with 'question' and 'answer'")
            missing = [k for k in ("question", "answer") if not isinstance(item.get(k), str)]
            if missing:
                raise BadInputError(
                    f"{src}:{lineno}: missing or non-string field(s) {missing}; each row needs 'question' and 'answer'"
                )
            match = GSM8K_ANSWER.search(item["answer"].strip())
            if match is None:
                raise BadInputError(
                    f"{src}:{lineno}: answer does not end in '#### <number>'; GSM8K answers end with the final number"
                )
            truth = match.group(1).replace(",", "")
            rows.append(_row("openai/gsm8k", item["question"], truth, split, len(rows)))
    if not rows:
        raise BadInputError(f"{src}: no rows; the file is empty")
    return _write_parquet_atomic(rows, path)


def validate_rl_parquet(path: str | os.PathLike) -> int:
    """Check a parquet file has VeRL's RL columns and well-formed rows; return the row count.

    Raises:
        BadInputError: missing file, missing columns, or a row whose ``prompt`` is not a non-empty list of
            ``{"role", "content"}`` messages or whose ``reward_model`` lacks ``ground_truth`` (file and row named).
    """
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"{p}: data file not found; set data.train_files/data.val_files to existing parquet files")
    try:
        df = pd.read_parquet(p)
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise BadInputError(f"{p}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise BadInputError(
            f"{p}: missing column(s) {missing}; VeRL needs {list(REQUIRED_COLUMNS)} "
            "(write it with verl_backend.data.gsm8k_jsonl_to_parquet or reasoning_gym_to_parquet, or use "
            "rl_tpu.gsm8k_jsonl=FILE / rl_tpu.task=NAME for the built-in conversion)"
        )
    for i, row in enumerate(df.itertuples(index=False)):
        prompt = row.prompt
        ok = (
            prompt is not None
            and len(prompt) > 0
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        )
        if not ok:
            raise BadInputError(f"{p}: row {i}: 'prompt' must be a non-empty list of {{role, content}} messages")
        rm = row.reward_model
        if not isinstance(rm, dict) or rm.get("ground_truth") in (None, ""):
            raise BadInputError(f"{p}: row {i}: 'reward_model' must be a dict with a non-empty 'ground_truth'")
    if len(df) == 0:
        raise BadInputError(f"{p}: no rows")
    return len(df)
