"""Converters to VeRL's parquet format and the reward functions, on real reasoning-gym and GSM8K data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from verl_backend.data import (
    compute_score,
    extract_final_answer,
    gsm8k_jsonl_to_parquet,
    reasoning_gym_to_parquet,
    validate_rl_parquet,
)
from verl_backend.data.rewards import guarded_score
from verl_backend.errors import BadInputError

GSM8K = (
    Path(__file__).resolve().parents[2] / "data" / "gsm8k" / "train_200.jsonl"
)  # real sample (MIT, LICENSE beside it)


def test_reasoning_gym_rows_have_verl_columns_and_score_with_reasoning_gym(tmp_path):
    import reasoning_gym

    cfg = {"min_terms": 2, "max_terms": 2, "max_digits": 2}
    path = reasoning_gym_to_parquet("basic_arithmetic", tmp_path / "t.parquet", size=12, seed=3, task_config=cfg)
    assert validate_rl_parquet(path) == 12
    df = pd.read_parquet(path)
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=12, seed=3, **cfg)
    for i, row in enumerate(df.itertuples()):
        assert row.data_source == "reasoning_gym/basic_arithmetic"
        assert row.prompt[0]["role"] == "user" and ds[i]["question"] in row.prompt[0]["content"]
        truth = row.reward_model["ground_truth"]
        assert truth == str(ds[i]["answer"])
        assert compute_score(row.data_source, f"<answer>{truth}</answer>", truth, row.extra_info)["score"] == 1.0
        wrong = str(int(truth) + 1)
        assert compute_score(row.data_source, f"<answer>{wrong}</answer>", truth, row.extra_info)[
            "score"
        ] == ds.score_answer(wrong, ds[i])


def test_unknown_reasoning_gym_task_is_one_clear_error(tmp_path):
    with pytest.raises(BadInputError, match="no_such_task"):
        reasoning_gym_to_parquet("no_such_task", tmp_path / "x.parquet", size=2, seed=0)
    assert not (tmp_path / "x.parquet").exists()


def test_gsm8k_real_sample_converts_with_numeric_ground_truth(tmp_path):
    path = gsm8k_jsonl_to_parquet(GSM8K, tmp_path / "g.parquet")
    df = pd.read_parquet(path)
    assert len(df) == 200
    first = json.loads(GSM8K.read_text().splitlines()[0])
    assert df.iloc[0]["reward_model"]["ground_truth"] == first["answer"].split("####")[-1].strip()
    assert df.iloc[0]["data_source"] == "openai/gsm8k"
    truth = df.iloc[0]["reward_model"]["ground_truth"]
    assert compute_score("openai/gsm8k", f"So the total is <answer>{truth}</answer>.", truth)["score"] == 1.0
    assert compute_score("openai/gsm8k", f"So the total is {truth}.", truth)["acc"] == 1.0
    assert compute_score("openai/gsm8k", "So the total is 1234567.", truth)["acc"] == 0.0


@pytest.mark.parametrize(
    "bad_line, match",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"question": "q"}), "missing or non-string field"),
        (json.dumps({"question": "q", "answer": "no final number"}), "#### <number>"),
    ],
)
def test_gsm8k_bad_row_names_file_and_row_and_writes_nothing(tmp_path, bad_line, match):
    src = tmp_path / "bad.jsonl"
    good = GSM8K.read_text().splitlines()[:2]
    src.write_text("\n".join(good + [bad_line]) + "\n")
    out = tmp_path / "out.parquet"
    with pytest.raises(BadInputError, match=match) as err:
        gsm8k_jsonl_to_parquet(src, out)
    assert f"{src}:3" in str(err.value)
    assert not out.exists()


def test_existing_output_survives_a_failed_conversion(tmp_path):
    out = gsm8k_jsonl_to_parquet(GSM8K, tmp_path / "g.parquet")
    before = out.read_bytes()
    src = tmp_path / "bad.jsonl"
    src.write_text("{oops\n")
    with pytest.raises(BadInputError):
        gsm8k_jsonl_to_parquet(src, out)
    assert out.read_bytes() == before


def test_validate_reports_missing_column_and_bad_row(tmp_path):
    p = tmp_path / "m.parquet"
    pd.DataFrame([{"data_source": "x", "prompt": [{"role": "user", "content": "hi"}]}]).to_parquet(p)
    with pytest.raises(BadInputError, match=r"missing column\(s\) \['ability', 'reward_model', 'extra_info'\]"):
        validate_rl_parquet(p)
    rows = [
        {
            "data_source": "x",
            "prompt": [{"role": "user", "content": "hi"}],
            "ability": "a",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"index": 0},
        },
        {
            "data_source": "x",
            "prompt": [],
            "ability": "a",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"index": 1},
        },
    ]
    pd.DataFrame(rows).to_parquet(p)
    with pytest.raises(BadInputError, match="row 1: 'prompt'"):
        validate_rl_parquet(p)


def test_extract_final_answer_prefers_tags_then_last_number():
    assert extract_final_answer("I think 3 then <answer> 7 </answer>") == "7"
    assert extract_final_answer("3 + 4 = 7.") == "7"
    assert extract_final_answer("1,234 apples") == "1234"
    assert extract_final_answer("no digits") is None


def _addition_row(tmp_path):
    path = reasoning_gym_to_parquet(
        "basic_arithmetic",
        tmp_path / "a.parquet",
        size=4,
        seed=5,
        task_config={"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"]},
    )
    row = next(pd.read_parquet(path).itertuples())
    return row.data_source, row.reward_model["ground_truth"], row.extra_info


@pytest.mark.parametrize(
    "response, score, acc, strict",
    [
        ("{t}", 0.5, 1.0, 0.0),  # a bare right number: half the reward, lenient only
        ("so <answer>{t}</answer>", 1.0, 1.0, 1.0),  # tagged and right: full reward, strict too
        ("<answer>{w}</answer>", 0.0, 0.0, 0.0),  # tagged, wrong number
        ("<answer>{w}</answer> no, <answer>{t}</answer>", 1.0, 1.0, 1.0),  # two tagged answers: the last counts
        ("<answer>{t}</answer> no, <answer>{w}</answer>", 0.0, 0.0, 0.0),
        ("{t} is it, <answer>{w}</answer>", 0.0, 0.0, 0.0),  # the tags win over a bare right number
        ("I do not know", 0.0, 0.0, 0.0),
    ],
)
def test_the_reward_asks_for_the_tags_and_accuracy_stays_apart(tmp_path, response, score, acc, strict):
    source, truth, info = _addition_row(tmp_path)
    wrong = str(int(truth) + 10)
    got = compute_score(source, response.format(t=truth, w=wrong), truth, info, bare_answer_credit=0.5)
    assert (got["score"], got["acc"], got["acc_strict"]) == (score, acc, strict), got
    plain = compute_score(source, response.format(t=truth, w=wrong), truth, info)  # the default: no format reward
    assert (plain["score"], plain["acc"]) == (acc if score == 0.5 else score, acc), plain


def test_bare_answer_credit_is_the_runs_setting_and_checked(tmp_path):
    """``reward.custom_reward_function.reward_kwargs.bare_answer_credit`` reaches compute_score through VeRL's
    reward kwargs and guarded_score; 1.0, the default, is no format reward. A value outside [0, 1] is one line naming
    the key."""
    source, truth, info = _addition_row(tmp_path)
    assert compute_score(source, truth, truth, info)["score"] == 1.0
    assert guarded_score(source, truth, truth, info, bare_answer_credit=0.25)["score"] == 0.25
    for bad in (1.5, -0.1, "half"):
        with pytest.raises(BadInputError, match=r"reward_kwargs.bare_answer_credit=.* in \[0, 1\]"):
            compute_score(source, truth, truth, info, bare_answer_credit=bad)


def test_unknown_data_source_is_refused():
    with pytest.raises(BadInputError, match="no reward function for data_source 'mystery'"):
        compute_score("mystery", "1", "1")


def test_guarded_score_turns_raising_and_nan_rewards_into_one_line(tmp_path):
    mod = tmp_path / "my_reward.py"
    mod.write_text(
        "def bad(*a, **k):\n    raise KeyError('boom')\n\ndef nan(*a, **k):\n    return float('nan')\n"
        "def ok(*a, **k):\n    return 0.5\n"
    )
    with pytest.raises(BadInputError, match=r"my_reward.py:bad raised KeyError.*row 4"):
        guarded_score("openai/gsm8k", "1", "1", {"index": 4}, user_fn_path=str(mod), user_fn_name="bad")
    with pytest.raises(BadInputError, match="returned nan"):
        guarded_score("openai/gsm8k", "1", "1", {"index": 4}, user_fn_path=str(mod), user_fn_name="nan")
    assert guarded_score("openai/gsm8k", "1", "1", {}, user_fn_path=str(mod), user_fn_name="ok") == 0.5
    assert math.isclose(guarded_score("openai/gsm8k", "<answer>2</answer>", "2", {})["score"], 1.0)
    with pytest.raises(BadInputError, match=r"my_reward.py \(name=missing\) cannot be loaded: AttributeError"):
        guarded_score("openai/gsm8k", "1", "1", {}, user_fn_path=str(mod), user_fn_name="missing")


def test_reward_file_that_cannot_be_loaded_is_one_line(tmp_path):
    from verl_backend.data.rewards import load_user_reward

    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(a, b\n")
    with pytest.raises(BadInputError, match=r"broken.py \(name=compute_score\) cannot be loaded: SyntaxError"):
        load_user_reward(str(broken), "compute_score")
    with pytest.raises(BadInputError, match=r"nope.py \(name=compute_score\) cannot be loaded: FileNotFoundError"):
        load_user_reward(str(tmp_path / "nope.py"), "compute_score")


def test_verls_old_top_level_reward_key_is_guarded_too():
    """VeRL 0.9.1 migrates custom_reward_function.* under reward.; passed on as is it was silently lost."""
    from verl_backend.driver.plan import guard_user_reward

    assert guard_user_reward(["custom_reward_function.path=/r.py", "custom_reward_function.name=f", "a.b=1"]) == [
        "+reward.custom_reward_function.reward_kwargs.user_fn_path=/r.py",
        "+reward.custom_reward_function.reward_kwargs.user_fn_name=f",
        "a.b=1",
    ]
    assert guard_user_reward(["reward.custom_reward_function.path=/r.py"]) == [
        "+reward.custom_reward_function.reward_kwargs.user_fn_path=/r.py"
    ]


def test_report_reads_metrics_past_a_line_cut_by_a_kill(tmp_path, capsys):
    from verl_backend.driver.report import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "data": {"a": 1}}\n{"step": 2, "da\n{"step": 2, "data": {"a": 3}}\n')
    assert read_metrics(metrics) == [{"step": 1, "data": {"a": 1}}, {"step": 2, "data": {"a": 3}}]
    assert "metrics.jsonl line 2 is not complete JSON" in capsys.readouterr().out


def test_gsm8k_jsonl_too_small_to_split_is_one_line(tmp_path):
    from verl_backend.driver.data_prep import prepare_data
    from verl_backend.settings import RlTpuSettings

    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    with pytest.raises(BadInputError, match=r"rl_tpu.gsm8k_jsonl=.*one.jsonl: 1 row\(s\), too few to hold out 1"):
        prepare_data({}, RlTpuSettings(gsm8k_jsonl=str(src)), tmp_path / "out")
