"""Task accuracy of a ``.litertlm`` bundle in the LiteRT-LM runtime beside PyTorch, item by item.

``--eval FILE.jsonl``: one JSON object per line with ``prompt`` (a string, sent as one user turn, or a message list
ending with a user turn) and ``answer`` (the expected answer); ``data_source`` and ``extra_info`` are passed on to
scorers that take them. Both the runtime (greedy, CPU) and PyTorch (greedy, same stop tokens) answer every item in
at most ``max_tokens`` tokens, and one scorer scores both answers:

- ``exact``: 1 when the answer, stripped, equals the expected text;
- ``number`` (default): 1 when the last number in the answer equals the expected one (GSM8K ``#### 42`` accepted);
- ``package.module:function`` or ``path/to/file.py:function``: ``function(answer, expected)``, or VeRL's
  ``compute_score(data_source, solution_str, ground_truth, extra_info)`` when its parameters are named so (e.g. the
  project's reasoning-gym and GSM8K scorer ``verl_backend.data.rewards:compute_score``, imported by name only when asked
  for). A function that returns VeRL's dict form is scored by its ``acc`` (the accuracy VeRL validates on) where it has
  one, else by its ``score`` (a reward, which may give partial credit for the format).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import os
import re

from edge_export.errors import BAD_SOURCE, ExportError
from edge_export.runtime_chat import open_engine, runtime_turn, torch_greedy

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.split("####")[-1] if "####" in text else text)
    try:
        return float(found[-1].rstrip(".").replace(",", "")) if found else None
    except ValueError:
        return None


def score_number(answer: str, expected: str) -> float:
    got, want = _last_number(answer), _last_number(str(expected))
    return float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-6))


def score_exact(answer: str, expected: str) -> float:
    return float(answer.strip() == str(expected).strip())


SCORERS = {"number": score_number, "exact": score_exact}


def load_scorer(name: str):
    """A scorer ``(answer, expected, item) -> float`` for ``name`` (see the module docstring).

    Raises:
        ExportError(BAD_SOURCE): not a built-in name and not an importable ``module:function``.
    """
    if name in SCORERS:
        fn = SCORERS[name]
        return lambda answer, expected, item: fn(answer, expected)
    module_name, _, attr = name.rpartition(":") if name.count(":") > 1 else name.partition(":")
    try:
        if module_name.endswith(".py"):  # a reward file, as VeRL's custom_reward_function.path names one
            spec = importlib.util.spec_from_file_location(f"_scorer_{abs(hash(module_name))}", module_name)
            if spec is None or not os.path.isfile(module_name):
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            fn = getattr(module, attr, None) if attr else None
        else:
            fn = getattr(importlib.import_module(module_name), attr) if attr else None
    except ImportError as exc:
        raise ExportError(
            BAD_SOURCE,
            f"--scorer '{name}': cannot import {module_name} ({exc}); give "
            f"{' or '.join(SCORERS)} or package.module:function",
        ) from exc
    if not callable(fn):
        raise ExportError(
            BAD_SOURCE, f"--scorer '{name}' is not a function; give {' or '.join(SCORERS)} or package.module:function"
        )
    if "solution_str" in inspect.signature(fn).parameters:
        return lambda answer, expected, item: _as_accuracy(
            fn(
                data_source=item.get("data_source", ""),
                solution_str=answer,
                ground_truth=str(expected),
                extra_info=item.get("extra_info"),
            )
        )
    return lambda answer, expected, item: _as_accuracy(fn(answer, expected))


def _as_accuracy(result) -> float:
    """A scorer's result as a number: itself, or of VeRL's dict form its ``acc``, else its ``score``."""
    if isinstance(result, dict):
        return float(result["acc"] if "acc" in result else result["score"])
    return float(result)


def read_items(path: str) -> list[dict]:
    """The JSONL items, each with a message list under ``messages``.

    Raises:
        ExportError(BAD_SOURCE): missing file, a line that is not JSON, or an item without prompt/answer.
    """
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ExportError(
            BAD_SOURCE,
            f'--eval \'{path}\': {exc.strerror}; give a JSONL file of {{"prompt": ..., "answer": ...}} lines',
        ) from exc
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ExportError(BAD_SOURCE, f"--eval {path}:{number} is not JSON ({exc.msg})") from exc
        if not isinstance(item, dict) or "prompt" not in item or "answer" not in item:
            raise ExportError(BAD_SOURCE, f"--eval {path}:{number} needs keys 'prompt' and 'answer'")
        prompt = item["prompt"]
        item["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        items.append(item)
    if not items:
        raise ExportError(BAD_SOURCE, f"--eval '{path}' has no items")
    return items


def evaluate_bundle(
    path: str,
    model,
    tokenizer,
    items: list[dict],
    *,
    stop_ids: tuple[int, ...],
    scorer: str,
    max_tokens: int = 128,
    cache_length: int = 256,
    num_threads: int = 1,
    max_drop_points: float = 5.0,
) -> dict:
    """Score the runtime's and PyTorch's greedy answers on ``items`` with ``scorer``.

    Returns:
        dict with ``items`` (per item: both answers and scores), ``runtime_accuracy`` and ``torch_accuracy`` (in
        %), ``drop_points`` (PyTorch minus runtime), ``disagreements`` (items scored differently), ``passed``
        (drop within ``max_drop_points``) and ``failures``.
    """
    from edge_export.chat_template import hf_prompt_ids

    score = load_scorer(scorer)
    engine = open_engine(path, cache_length, num_threads)
    rows = []
    for item in items:
        turn = runtime_turn(engine, item["messages"], max_tokens)
        ids = torch_greedy(model, hf_prompt_ids(tokenizer, item["messages"]), max_tokens, stop_ids)
        torch_answer = tokenizer.decode([t for t in ids if t not in stop_ids])
        runtime_answer = turn.get("text", "")
        rows.append(
            {
                "prompt": item["prompt"],
                "expected": item["answer"],
                "runtime_answer": runtime_answer,
                "torch_answer": torch_answer,
                "runtime_error": turn.get("error"),
                "runtime_score": score(runtime_answer, item["answer"], item) if "text" in turn else 0.0,
                "torch_score": score(torch_answer, item["answer"], item),
            }
        )
    runtime_accuracy = 100 * sum(r["runtime_score"] for r in rows) / len(rows)
    torch_accuracy = 100 * sum(r["torch_score"] for r in rows) / len(rows)
    drop = torch_accuracy - runtime_accuracy
    failures = []
    if drop > max_drop_points:
        failures.append(
            f"task accuracy in the runtime {runtime_accuracy:.1f}% vs PyTorch {torch_accuracy:.1f}% on "
            f"{len(rows)} items: {drop:.1f} points lost, {max_drop_points:g} allowed"
        )
    errors = [r for r in rows if r["runtime_error"]]
    if errors:
        failures.append(f"the runtime could not answer {len(errors)} items: {errors[0]['runtime_error']}")
    return {
        "scorer": scorer,
        "max_tokens": max_tokens,
        "items": rows,
        "runtime_accuracy": runtime_accuracy,
        "torch_accuracy": torch_accuracy,
        "drop_points": drop,
        "disagreements": sum(r["runtime_score"] != r["torch_score"] for r in rows),
        "passed": not failures,
        "failures": failures,
    }
