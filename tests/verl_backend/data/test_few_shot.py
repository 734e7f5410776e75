"""``rl_tpu.few_shot``: worked examples before every built-in question, none of them a trained or held-out problem,
the same in the training and held-out files, refused where it cannot take effect."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from verl_backend.data import PROMPT_SUFFIX, few_shot_examples, prompt_messages
from verl_backend.driver.data_prep import builtin_shots, prepare_data
from verl_backend.errors import BadInputError
from verl_backend.settings import RlTpuSettings

ADDITION = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}


def _settings(**kw) -> RlTpuSettings:
    return dataclasses.replace(RlTpuSettings(), **{"train_size": 24, "val_size": 8, **kw})


def test_prompt_messages_put_each_example_as_a_user_and_a_tagged_assistant_turn():
    shots = [("Calculate 4 + 4.", "4 + 4 = 8\n<answer>8</answer>"), ("Calculate 1 + 6.", "<answer>7</answer>")]
    msgs = prompt_messages("Calculate 2 + 3.", shots)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert [msgs[1]["content"], msgs[3]["content"]] == [r for _, r in shots]
    assert all(m["content"].endswith(PROMPT_SUFFIX) for m in msgs if m["role"] == "user")
    assert msgs[-1]["content"] == "Calculate 2 + 3." + PROMPT_SUFFIX
    assert prompt_messages("Calculate 2 + 3.") == msgs[-1:]  # no examples: the one user turn of before


def test_examples_skip_every_excluded_question_and_are_deterministic():
    first = few_shot_examples("basic_arithmetic", 3, seed=7, task_config=ADDITION)
    assert len(first) == 3 and first == few_shot_examples("basic_arithmetic", 3, seed=7, task_config=ADDITION)
    # excluding the first example's question moves the draw past it (negative control: without, it is drawn)
    again = few_shot_examples("basic_arithmetic", 3, seed=7, exclude={first[0][0]}, task_config=ADDITION)
    assert first[0][0] not in {q for q, _ in again} and again[:2] == first[1:]
    for q, reply in first:  # the reply works the task's own expression to its own answer, in the tags
        expression = q.removeprefix("Calculate ").rstrip(".")
        assert reply == f"{expression} = {eval(expression)}\n<answer>{eval(expression)}</answer>"


def test_a_task_without_an_expression_gets_the_tagged_answer_alone():
    ((q, reply),) = few_shot_examples("word_sorting", 1, seed=3)
    assert reply.startswith("<answer>") and reply.endswith("</answer>") and "=" not in reply


def test_a_task_too_small_for_its_examples_is_one_line():
    from verl_backend.data.converters import reasoning_gym_dataset

    every = {e["question"] for e in reasoning_gym_dataset("basic_arithmetic", 128, 1, ADDITION)}
    with pytest.raises(BadInputError, match=r"rl_tpu.few_shot=2: .* only 0 question.*lower rl_tpu.few_shot"):
        few_shot_examples("basic_arithmetic", 2, seed=1, exclude=every, task_config=ADDITION)
    assert len(few_shot_examples("basic_arithmetic", 2, seed=1, exclude=set(list(every)[2:]), task_config=ADDITION))


def test_built_in_files_carry_the_same_examples_and_none_is_a_trained_or_held_out_question(tmp_path):
    settings = _settings(few_shot=2, task_config=ADDITION, train_size=96)
    extra = prepare_data({}, settings, tmp_path)
    files = dict(o.split("=", 1) for o in extra)
    train, val = (pd.read_parquet(files[k]) for k in ("data.train_files", "data.val_files"))
    shots = builtin_shots(settings)
    assert len(shots) == 2
    for df in (train, val):
        for prompt in df["prompt"]:
            assert len(prompt) == 5
            assert [(prompt[0]["content"], prompt[1]["content"]), (prompt[2]["content"], prompt[3]["content"])] == [
                (q + PROMPT_SUFFIX, reply) for q, reply in shots
            ]
    asked = {p[-1]["content"].removesuffix(PROMPT_SUFFIX) for df in (train, val) for p in df["prompt"]}
    assert not asked & {q for q, _ in shots}
    # 1-digit sums repeat: the plain draw at seed + 3000 hits a trained question, which the examples skip
    plain = few_shot_examples("basic_arithmetic", 2, seed=settings.seed + 3000, task_config=ADDITION)
    assert plain != shots and set(q for q, _ in plain) & asked


def test_without_examples_the_files_are_as_before(tmp_path):
    extra = prepare_data({}, _settings(task_config=ADDITION), tmp_path)
    train = pd.read_parquet(dict(o.split("=", 1) for o in extra)["data.train_files"])
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in train["prompt"])


@pytest.mark.parametrize(
    "keys, kw, named",
    [
        ({"data.train_files": "mine.parquet"}, {}, "data.train_files"),
        ({}, {"gsm8k_jsonl": "gsm8k.jsonl"}, "rl_tpu.gsm8k_jsonl"),
    ],
)
def test_examples_are_refused_where_they_cannot_take_effect(tmp_path, keys, kw, named):
    with pytest.raises(BadInputError, match=rf"rl_tpu.few_shot=1 applies to the built-in .* {named} is set"):
        prepare_data(keys, _settings(few_shot=1, **kw), tmp_path)
    assert not (tmp_path / "data").exists()  # nothing written


def test_prompts_the_examples_make_too_long_name_the_setting(tmp_path):
    """Three worked examples pass the default job's 128-token prompt limit: preflight's one line says so and names
    rl_tpu.few_shot (negative control: one example fits, and nothing is raised)."""
    from omegaconf import OmegaConf

    from verl_backend.driver.preflight import check_prompt_lengths
    from verl_backend.models import ensure_default_model

    model = str(ensure_default_model())
    for k, fits in ((3, False), (1, True)):
        files = dict(o.split("=", 1) for o in prepare_data({}, _settings(few_shot=k), tmp_path / str(k)))
        config = OmegaConf.create(
            {
                "data": {
                    "max_prompt_length": 128,
                    "filter_overlong_prompts": True,
                    "train_files": files["data.train_files"],
                    "val_files": files["data.val_files"],
                },
                "actor_rollout_ref": {"model": {"path": model}},
            }
        )
        if fits:
            check_prompt_lengths(config)
        else:
            with pytest.raises(BadInputError, match=r"all 24 prompts .* lower rl_tpu.few_shot \(now 3 worked"):
                check_prompt_lengths(config)
