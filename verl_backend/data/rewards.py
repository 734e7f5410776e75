"""Reward functions with VeRL's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` signature.

- ``reasoning_gym/<task>``: the answer is scored by the task's own ``score_answer`` on the exact entry, rebuilt from
  the seed and index in ``extra_info`` (reasoning-gym's score, in [0, 1]).
- ``openai/gsm8k``: numeric equality of the answer with the ``####`` ground truth (1.0 or 0.0).

The prompt asks for the answer inside ``<answer></answer>`` tags, and the reward asks for it too: the answer inside
the last tags earns the task's full score; without tags the last number of the response is scored and earns
``bare_answer_credit`` of it (``reward.custom_reward_function.reward_kwargs.bare_answer_credit``; 1.0 by default:
no format reward). Below 1, under GRPO's group normalisation a group of bare answers learns the arithmetic as before,
and a tagged right answer beside bare ones gets the larger advantage; measured at 0.5 it did not teach the 135M model
the tags in 12 steps (docs/recipe.md, the fifth screen), so the default job keeps 1.0.

Accuracy is not the reward: :func:`compute_score` returns VeRL's dict form, ``{"score": reward, "acc": lenient,
"acc_strict": strict, "tagged": ...}``. VeRL takes ``acc`` as the validation's core metric and writes every key
into its per-item rollout and validation dumps, where the console and the report read them:

- *strict* (``acc_strict``): the answer inside the last ``<answer>`` tags has the task's full score;
- *lenient* (``acc``): the tagged answer, else the last number, has the task's full score.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from verl_backend.errors import BadInputError, record_bad_input

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")
BARE_ANSWER_CREDIT = (
    1.0  # the share of the task's score an answer outside the <answer> tags earns (1: no format reward)
)


def extract_final_answer(solution_str: str) -> str | None:
    """The text inside the last ``<answer>`` tags, else the last number in ``solution_str``, else ``None``."""
    return split_answer(solution_str)[0]


def split_answer(solution_str: str) -> tuple[str | None, bool]:
    """``(answer, tagged)``: the text inside the last ``<answer></answer>`` tags (reasoning-gym's ``extract_answer``)
    and ``True``; else the last number of ``solution_str`` and ``False``; else ``(None, False)``."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(solution_str)
    if tagged is not None:
        return tagged, True
    numbers = _NUMBER.findall(solution_str)
    return (numbers[-1].rstrip(".").replace(",", ""), False) if numbers else (None, False)


@functools.lru_cache(maxsize=32)
def _dataset(task: str, seed: int, size: int, task_config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(task_config or "{}"))


def _to_float(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except (ValueError, AttributeError):
        return None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    bare_answer_credit: float = BARE_ANSWER_CREDIT,
    **kwargs,
) -> dict[str, float]:
    """Score one response: the reward, and the accuracies apart from it.

    Args:
        data_source: ``"reasoning_gym/<task>"`` or ``"openai/gsm8k"``.
        solution_str: the decoded response (no prompt).
        ground_truth: the expected answer string.
        extra_info: for reasoning-gym rows, ``task``, ``seed``, ``size``, ``index`` and ``task_config`` as
            written by :func:`verl_backend.data.reasoning_gym_to_parquet`.
        bare_answer_credit: the share of the task's score an answer outside ``<answer>`` tags earns, in [0, 1]
            (VeRL passes ``reward.custom_reward_function.reward_kwargs``).

    Returns:
        ``{"score": reward in [0, 1], "acc": 1.0 if the tagged answer, else the last number, is fully right (lenient),
        "acc_strict": 1.0 if the tagged answer is fully right (strict), "tagged": 1.0 if the response has an answer
        in tags}``.

    Raises:
        BadInputError: an unknown ``data_source``, a reasoning-gym row without its ``extra_info`` keys, or a
            ``bare_answer_credit`` outside [0, 1].
    """
    try:
        credit = float(bare_answer_credit)
    except (TypeError, ValueError):
        credit = float("nan")
    if not 0.0 <= credit <= 1.0:
        raise BadInputError(
            f"reward.custom_reward_function.reward_kwargs.bare_answer_credit={bare_answer_credit!r} is not a number "
            "in [0, 1]; give the share of the reward an answer outside <answer> tags earns (1.0: no format reward)"
        )
    answer, tagged = split_answer(solution_str)
    correctness = _task_score(data_source, answer, ground_truth, extra_info)
    return {
        "score": correctness if tagged else credit * correctness,
        "acc": float(correctness >= 1.0),
        "acc_strict": float(tagged and correctness >= 1.0),
        "tagged": float(tagged),
    }


def _task_score(data_source: str, answer: str | None, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
    """The task's own score of ``answer`` in [0, 1] (0 for no answer).

    Raises:
        BadInputError: see :func:`compute_score`.
    """
    if data_source.startswith("reasoning_gym/"):
        info = extra_info or {}
        missing = [k for k in ("task", "seed", "size", "index") if k not in info]
        if missing:
            raise BadInputError(
                f"reasoning-gym row for {data_source} lacks extra_info {missing}; regenerate the parquet with "
                "verl_backend.data.reasoning_gym_to_parquet"
            )
        dataset = _dataset(info["task"], int(info["seed"]), int(info["size"]), info.get("task_config") or "{}")
        entry = dataset[int(info["index"])]
        if str(entry["answer"]) != str(ground_truth):
            raise BadInputError(
                f"{data_source} row {info['index']}: ground_truth {ground_truth!r} does not match the rebuilt "
                f"entry {entry['answer']!r}; the parquet was written with another reasoning-gym version or config"
            )
        if answer is None:
            return 0.0
        score = float(dataset.score_answer(answer, entry))
    elif data_source in ("openai/gsm8k", "gsm8k"):
        got, want = _to_float(answer) if answer is not None else None, _to_float(ground_truth)
        score = 1.0 if got is not None and want is not None and math.isclose(got, want, abs_tol=1e-6) else 0.0
    else:
        raise BadInputError(
            f"no reward function for data_source {str(data_source)!r}; use 'reasoning_gym/<task>' or 'openai/gsm8k', "
            "or set reward.custom_reward_function.path to your own compute_score"
        )
    if not math.isfinite(score):
        raise BadInputError(f"reward for {data_source} is {score} (not finite) for answer {answer!r}")
    return score


def guarded_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    user_fn_path: str | None = None,
    user_fn_name: str = "compute_score",
    **kwargs,
) -> float | dict:
    """Call the reward function (ours, or the user's from ``user_fn_path``) and police its result: a number, or VeRL's
    dict form with a finite ``score`` (returned as it came, so its other keys reach VeRL's metrics and dumps).

    ``verl train`` routes ``reward.custom_reward_function`` through this wrapper so that a reward function that
    raises, or returns NaN/inf, stops the run with one line naming the function, the sample and the fix, instead
    of a stack trace from inside a Ray reward worker or a silently poisoned advantage.

    The error is also recorded for ``verl train``'s driver (:func:`verl_backend.errors.record_bad_input`): VeRL's
    agent loop, which calls this through its reward worker, logs a failed reward and marks the prompt group failed
    rather than passing the error on.

    Raises:
        BadInputError: the function raised, or returned a non-finite or non-numeric score.
    """
    try:
        return _police_score(data_source, solution_str, ground_truth, extra_info, user_fn_path, user_fn_name, **kwargs)
    except BadInputError as exc:
        record_bad_input(exc)
        raise


@functools.lru_cache(maxsize=8)
def load_user_reward(path: str, name: str):
    """The user's reward function ``name`` from the Python file (or ``pkg://module``) ``path``, as VeRL loads it
    (``verl.utils.import_utils.load_extern_object``), once per process: VeRL's loader runs the file again on every
    call, and the reward is called per sample. A failure is not cached.

    Raises:
        BadInputError: the file is missing, does not import (its error's first line), or lacks ``name``.
    """
    from verl.utils.import_utils import load_extern_object

    try:
        return load_extern_object(module_path=path, object_name=name)
    except Exception as exc:
        while exc.__cause__ is not None:  # VeRL wraps an import failure in a RuntimeError
            exc = exc.__cause__
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise BadInputError(
            f"reward.custom_reward_function.path={path} (name={name}) cannot be loaded: {type(exc).__name__}: {text}; "
            "fix the file, or the path and name of its compute_score-style function"
        ) from None


def _police_score(data_source, solution_str, ground_truth, extra_info, user_fn_path, user_fn_name, **kwargs) -> float:
    if user_fn_path:
        fn = load_user_reward(user_fn_path, user_fn_name)
        where = f"{user_fn_path}:{user_fn_name}"
    else:
        fn, where = compute_score, "verl_backend.data.rewards:compute_score"
    index = (extra_info or {}).get("index", "?")
    try:
        result = fn(data_source, solution_str, ground_truth, extra_info, **kwargs)
    except BadInputError:
        raise
    except Exception as exc:
        raise BadInputError(
            f"reward function {where} raised {type(exc).__name__}: {exc} (data_source={data_source}, row "
            f"{index}); fix the function or its data"
        ) from None
    score = result.get("score") if isinstance(result, dict) else result
    try:
        value = float(score)
    except (TypeError, ValueError):
        raise BadInputError(
            f"reward function {where} returned {score!r} (data_source={data_source}, row {index}); "
            "it must return a number or a dict with 'score'"
        ) from None
    if not math.isfinite(value):
        raise BadInputError(
            f"reward function {where} returned {value} (data_source={data_source}, row {index}); return a finite number"
        )
    return result
