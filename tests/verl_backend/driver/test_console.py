"""The console of ``verl train`` (verl_backend/driver/console.py) and the validation interval (report.py), without a
run: the filter, the checker the e2e test applies to a real console, fd capture into train.log, and the paired
interval over per-item validation dumps."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl_backend.driver.console import ConsoleFilter, console_lines, console_problems, step_line
from verl_backend.driver.report import accuracy_lines, paired_difference, validation_change

QUIET = (
    "[rl-tpu] step 2/2 | reward 0.250 (4-step mean 0.375) | accuracy strict 12.5% lenient 25.0% | response 12 "
    "tokens | 3.1 s/step"
)


def test_checker_passes_a_quiet_console():
    assert console_problems("\n".join([QUIET, "[rl-tpu] step 2/2 | reward 0.5"])) == []


def test_checker_fails_on_a_duplicated_warning():  # negative control
    warning = "[rl-tpu] warning: RL_TPU_TASK is deprecated and will be removed; use rl_tpu.task"
    assert any("shown twice" in p for p in console_problems(f"{warning}\n{QUIET}\n{warning}\n"))


@pytest.mark.parametrize(
    "line",
    [
        "Failed to load torchao/_C_mxfp8.so",
        "Traceback (most recent call last):",
        "RuntimeError: boom",
        "an Exception here",
        "ERROR worker died",
    ],
)
def test_checker_fails_on_an_error_looking_line(line):  # negative control
    assert any("error-looking" in p for p in console_problems(f"{QUIET}\n{line}\n"))


def test_checker_counts_progress_redraws_as_lines():
    bar = "".join(f"\rTraining Progress: {i}/100" for i in range(100))
    assert len(console_lines(bar)) == 100
    assert any("lines (at most 60)" in p for p in console_problems(bar))


def test_filter_shows_each_rl_tpu_warning_once_without_rays_prefix():
    f = ConsoleFilter()
    w = "[rl-tpu] warning: X is deprecated"
    assert f.show(f"\x1b[36m(WorkerDict pid=5103)\x1b[0m {w}") == w
    assert f.show(f"(pid=77) {w}") is None
    assert f.show(w) is None
    assert f.show("[rl-tpu] warning: another one") == "[rl-tpu] warning: another one"
    for noise in (
        "UserWarning: megatron engine is not available",
        "INFO worker.py -- Started a local Ray instance",
        "Failed to load /x/torchao/_C_mxfp8.so",
        "[rl-tpu] actor: one CPU rank",
        "Training Progress: 50%",
    ):
        assert f.show(noise) is None, noise
    assert ConsoleFilter(verbose=True).show("anything") == "anything"
    resumed = "[rl-tpu] resuming from the checkpoint of step 6 in /x (VeRL's trainer.resume_mode=auto); ..."
    assert f.show(resumed) == resumed


def test_step_line():
    data = {"critic/score/mean": 0.25, "response_length/mean": 12.4, "timing_s/step": 3.14}
    assert step_line(2, data, 2, accuracy=(0.125, 0.25), reward_mean=0.375) == QUIET
    assert step_line(1, data, 2) == "[rl-tpu] step 1/2 | reward 0.250 | response 12 tokens | 3.1 s/step"
    assert step_line(0, {"val-core/x/acc/mean@1": 0.1}, 2) is None  # a validation-only row
    # DAPO's dynamic sampling: the reward is the kept groups', so the line says how many groups were replaced
    dapo = dict(data, **{"training/filter_groups/evicted_samples": 3.0})
    assert step_line(1, dapo, 2) == (
        "[rl-tpu] step 1/2 | reward 0.250 | 3 groups without a reward spread replaced | response 12 tokens | 3.1 s/step"
    )
    # ... and on the reward, the reward of every group graded beside the kept groups': 4 kept at 0.25, 2 all right
    # and 1 all wrong replaced: (4 * 0.25 + 2) / 7
    graded = dict(
        dapo,
        **{
            "rl_tpu/filter_groups/kept_groups_total": 4,
            "rl_tpu/filter_groups/replaced_groups_total": 3,
            "rl_tpu/filter_groups/replaced_score_sum": 2.0,
        },
    )
    assert step_line(1, graded, 2, reward_mean=0.5) == (
        "[rl-tpu] step 1/2 | reward 0.250 of 4 groups trained on | reward 0.429 of all 7 graded (4-step mean 0.500)"
        " | 3 groups without a reward spread replaced | response 12 tokens | 3.1 s/step"
    )


def test_step_lines_read_strict_and_lenient_apart_from_the_reward_and_a_running_mean(tmp_path):
    """The console's step line from VeRL's metrics and rollout dump: accuracy from the dump's ``acc`` /
    ``acc_strict`` (not the reward, which gives a bare right number half credit), and the reward's running mean.
    Control: a dump without those keys (a user's float reward) counts full-score samples, tags for strict."""
    from verl_backend.driver.console import StepLines

    rollouts, metrics = tmp_path / "rollouts", tmp_path / "metrics.jsonl"
    rollouts.mkdir()
    rows = [
        {"output": "<answer>3</answer>", "score": 1.0, "acc": 1.0, "acc_strict": 1.0},
        {"output": "3", "score": 0.5, "acc": 1.0, "acc_strict": 0.0},
        {"output": "4", "score": 0.0, "acc": 0.0, "acc_strict": 0.0},
        {"output": "<answer>4</answer>", "score": 0.0, "acc": 0.0, "acc_strict": 0.0},
    ]
    (rollouts / "1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = [{"output": "<answer>3</answer>", "score": 1.0}, {"output": "3", "score": 1.0}, {"output": "4", "score": 0}]
    (rollouts / "2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain))
    said = []
    lines = StepLines(metrics, 2, said.append, rollouts=rollouts, poll_s=0.05)  # reads what is written after it
    metrics.write_text(
        "".join(json.dumps({"step": s, "data": {"critic/score/mean": r}}) + "\n" for s, r in ((1, 0.375), (2, 0.625)))
    )
    lines._read()
    assert said[0] == "[rl-tpu] step 1/2 | reward 0.375 | accuracy strict 25.0% lenient 50.0%", said
    assert said[1] == "[rl-tpu] step 2/2 | reward 0.625 (4-step mean 0.500) | accuracy strict 33.3% lenient 66.7%", said


def test_capture_sends_fds_to_the_log_and_only_said_lines_and_warnings_to_the_terminal(tmp_path):
    """A child process captures its own fds 1 and 2 (both phases), prints noise from Python and from a
    subprocess, says two lines; its real stdout must hold only those and the warning, once."""
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from pathlib import Path
        from verl_backend.driver.console import capture
        with capture(Path({str(tmp_path / "train.log")!r})) as console:
            print("phase one noise"); os.write(2, b"Failed to load something\\n")
            console.pump()
            print("python noise", flush=True)
            print("(W pid=1) [rl-tpu] warning: once", flush=True)
            subprocess.run(["sh", "-c", "echo child noise; echo '(W pid=2) [rl-tpu] warning: once' >&2"])
            console.say("[rl-tpu] said")
            sys.stderr.write("\\rbar 1\\rbar 2\\n"); sys.stderr.flush()
        print("after")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout + proc.stderr
    assert console_lines(shown) == ["[rl-tpu] warning: once", "[rl-tpu] said", "after"] or sorted(
        console_lines(shown)
    ) == sorted(["[rl-tpu] warning: once", "[rl-tpu] said", "after"]), shown
    log = (tmp_path / "train.log").read_text()
    for text in (
        "phase one noise",
        "Failed to load something",
        "python noise",
        "child noise",
        "bar 2",
        "[rl-tpu] said",
    ):
        assert text in log, text


def _dump(folder, step, scores, outputs=None):
    folder.mkdir(exist_ok=True)
    rows = [
        {"input": f"q{i}", "output": (outputs or {}).get(i, f"<answer>{s}</answer>"), "score": s}
        for i, s in enumerate(scores)
    ]
    (folder / f"{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_paired_interval_over_the_same_items(tmp_path):
    _dump(tmp_path, 0, [0, 0, 1, 0, 1, 0, 0, 0])
    _dump(tmp_path, 12, [1, 0, 1, 1, 1, 0, 1, 0], outputs={0: "the answer is 1"})  # item 0 right, no tags
    change = validation_change(tmp_path)
    lenient, strict = change["lenient"], change["strict"]
    assert (lenient["n"], lenient["before"], lenient["after"]) == (8, 0.25, 0.625)
    assert lenient["diff"] == pytest.approx(0.375)
    assert lenient["low"] < lenient["diff"] < lenient["high"]
    assert strict["after"] == 0.5  # item 0's bare number counts only leniently
    lines = accuracy_lines({"val_change": change})
    assert lines[0].startswith("[rl-tpu] validation accuracy: before 25.0% -> after 62.5% (+37.5 points, 95% CI")
    assert "paired over the same 8 items" in lines[0] and "strict" in lines[1]
    assert console_problems("\n".join(lines)) == []


def test_validation_accuracy_is_the_dumps_acc_not_the_reward(tmp_path):
    """With the format reward a right bare number scores 0.5: it is right leniently (``acc``), not strictly
    (``acc_strict``). Control: the same items judged by their reward would count it wrong."""
    before = [
        {"input": "q0", "output": "7", "score": 0.5, "acc": 1.0, "acc_strict": 0.0},
        {"input": "q1", "output": "8", "score": 0.0, "acc": 0.0, "acc_strict": 0.0},
    ]
    after = [
        {"input": "q0", "output": "<answer>7</answer>", "score": 1.0, "acc": 1.0, "acc_strict": 1.0},
        {"input": "q1", "output": "<answer>9</answer>", "score": 1.0, "acc": 1.0, "acc_strict": 1.0},
    ]
    for step, rows in ((0, before), (12, after)):
        (tmp_path / f"{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    change = validation_change(tmp_path)
    assert (change["lenient"]["before"], change["lenient"]["after"]) == (0.5, 1.0)
    assert (change["strict"]["before"], change["strict"]["after"]) == (0.0, 1.0)
    for row in before:
        row.pop("acc"), row.pop("acc_strict")
    (tmp_path / "0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before))
    assert validation_change(tmp_path)["lenient"]["before"] == 0.0  # by the reward: 0.5 is not full credit


def test_summary_keeps_strict_apart_and_smooths_the_reward_curve():
    from verl_backend.driver.report import running_mean, summarize

    rows = [
        {
            "step": 0,
            "data": {
                "val-core/rg/acc/mean@1": 0.4,
                "val-aux/rg/acc_strict/mean@1": 0.0,
                "val-aux/rg/reward/mean@1": 0.2,
            },
        }
    ]
    rows += [{"step": s, "data": {"critic/score/mean": r}} for s, r in zip(range(1, 6), (0.2, 0.6, 0.2, 0.6, 1.0))]
    rows += [{"step": 5, "data": {"val-core/rg/acc/mean@1": 0.7, "val-aux/rg/acc_strict/mean@1": 0.5}}]
    summary = summarize(rows)
    assert (summary["val_accuracy_before"], summary["val_accuracy_after"]) == (0.4, 0.7)  # acc, not the reward
    assert summary["val_strict_points"] == [(0, 0.0), (5, 0.5)]
    assert [round(m, 3) for _, m in summary["train_reward_running_mean"]] == [0.2, 0.4, 0.333, 0.4, 0.6]
    assert running_mean([1.0, 0.0], window=1) == [1.0, 0.0]
    assert summary["groups_replaced_no_spread"] == []
    rows[2]["data"]["training/filter_groups/evicted_samples"] = 3.0  # DAPO's dynamic sampling replaced 3 groups
    assert summarize(rows)["groups_replaced_no_spread"] == [(2, 3)]
    assert summarize(rows)["graded_reward_curve"] == []  # no counts of the groups graded: no curve of them


def test_under_dapo_the_curve_and_last_lines_show_the_reward_of_all_groups_graded(tmp_path):
    """DAPO keeps groups with a reward spread, so their reward stays near the middle while the share of all-right
    groups it replaces grows: the summary, the plot and the run's last lines give the reward of all groups graded."""
    from verl_backend.driver.report import graded_reward_line, plot_reward_curve, summarize

    rows = []
    for step in range(1, 9):  # 4 groups kept at 0.5 each step; step s also replaced s-1 all-right groups, 1 all-wrong
        rows.append(
            {
                "step": step,
                "data": {
                    "critic/score/mean": 0.5,
                    "training/filter_groups/evicted_samples": float(step),
                    "rl_tpu/filter_groups/kept_groups_total": 4,
                    "rl_tpu/filter_groups/replaced_groups_total": step,
                    "rl_tpu/filter_groups/replaced_score_sum": float(step - 1),
                },
            }
        )
    summary = summarize(rows)
    graded = [round(v, 3) for _, v in summary["graded_reward_curve"]]
    assert graded == [round((2 + s - 1) / (4 + s), 3) for s in range(1, 9)] and graded[0] < graded[-1]
    assert [v for _, v in summary["train_reward_curve"]] == [0.5] * 8  # flat: what DAPO keeps
    assert len(summary["graded_reward_running_mean"]) == 8
    line = graded_reward_line(summary)[0]
    first, last = sum(graded[:4]) / 4, sum(graded[4:]) / 4
    assert f"first 4 steps {first:.3f} -> last 4 steps {last:.3f}" in line, line
    assert graded_reward_line(summarize(rows[:7])) == []  # too short for two windows apart
    assert plot_reward_curve(summary, tmp_path / "curve.png").stat().st_size > 0


def test_paired_difference_matches_a_t_interval():
    d = paired_difference([0, 0, 0, 0], [1, 0, 1, 0])
    assert d["diff"] == 0.5
    assert d["high"] - d["diff"] == pytest.approx(3.182446 * 0.57735 / 2, rel=1e-4)  # t(0.975, 3) * sd / sqrt(n)


def test_no_dumps_says_there_is_no_interval(tmp_path):
    assert validation_change(tmp_path) is None
    line = accuracy_lines({"val_accuracy_before": 0.1, "val_accuracy_after": 0.2})[0]
    assert "before 10.0% -> after 20.0%" in line and "no interval" in line


def test_a_single_validation_is_not_called_before():
    """With one validation (``trainer.val_before_train=false``), the line names its step and says there is nothing
    to compare; negative control: two validations still give before -> after."""
    one = accuracy_lines({"val_accuracy_before": 0.738, "val_accuracy_after": None, "val_points": [(12, 0.738)]})[0]
    assert "at step 12: 73.8%" in one and "before" not in one, one
    two = accuracy_lines({"val_accuracy_before": 0.5, "val_accuracy_after": 0.7, "val_points": [(0, 0.5), (12, 0.7)]})[
        0
    ]
    assert "before 50.0% -> after 70.0%" in two, two


def test_job_line_names_algorithm_model_data_steps_and_the_log(tmp_path):
    from omegaconf import OmegaConf

    from verl_backend.driver.console import job_line

    config = OmegaConf.create(
        {
            "algorithm": {"adv_estimator": "grpo"},
            "data": {"train_files": "/o/data/basic_arithmetic_train.parquet", "train_batch_size": 4},
            "actor_rollout_ref": {"model": {"path": "/c/SmolLM2-135M-Instruct"}, "rollout": {"n": 4}},
            "trainer": {"total_training_steps": 12},
        }
    )
    assert job_line(config, "cpu", 1, tmp_path) == (
        "[rl-tpu] GRPO on SmolLM2-135M-Instruct, basic_arithmetic: 12 steps of 4 prompts x 4 samples, cpu backend, "
        f"1 thread; full log: {tmp_path / 'train.log'}"
    )
    config.algorithm.filter_groups = {"enable": True, "metric": "reward"}
    assert "12 steps of 4 prompts x 4 samples with a reward spread (DAPO dynamic sampling), cpu backend" in job_line(
        config, "cpu", 1, tmp_path
    )


def test_no_item_changed_gives_the_rule_of_three_not_a_zero_width_interval():
    d = paired_difference([1, 0, 0, 1] * 8, [1, 0, 0, 1] * 8)  # 32 items, none changed
    assert d["unchanged"] and d["diff"] == 0
    assert d["high"] == pytest.approx(1 - 0.05 ** (1 / 32)) and 0.085 < d["high"] < 3 / 32  # about 3/n
    line = accuracy_lines({"val_change": {"lenient": d, "strict": d}})[0]
    assert "+0.0 points, 95% CI -8.9 to +8.9, no item changed (rule of three)" in line, line
