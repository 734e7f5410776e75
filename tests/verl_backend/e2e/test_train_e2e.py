"""End to end: ``verl train --backend cpu`` runs VeRL's own GRPO trainer for 2 steps on a tiny random Llama.

Real parts only: Ray, VeRL 0.9.1's trainer, the native rollout server, FSDP2 on gloo, the real SmolLM2
tokenizer and reasoning-gym data. The reward is a user function (length-based) so that GRPO advantages are
non-zero even for a random model, and it goes through the guarded-reward path.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from e2e_helpers import train_rows, verl_train, write_reward

from verl_backend.driver.report import GROUPS_REPLACED_KEY
from verl_backend.patches.verl import KEPT_GROUPS_KEY, REPLACED_GROUPS_KEY, REPLACED_SCORE_SUM_KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("e2e")
    proc = verl_train(
        out,
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"critic.model.path={tiny_model_dir}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "rl_tpu.train_size=16",
        "rl_tpu.val_size=8",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        # recompute old log-probs (no bypass) so the rollout's log-probs can be checked against the trainer's
        "algorithm.rollout_correction.bypass_mode=false",
        *write_reward(out, accuracy=True),
        default_console=True,
    )
    return out, proc


def everything(out, proc) -> str:
    """All the run printed: its console and ``train.log`` (where the default console leaves the rest)."""
    return proc.stdout + proc.stderr + (out / "train.log").read_text()


def test_run_exits_cleanly_and_reports(run):
    out, proc = run
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "validation accuracy: before" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["training_steps"] == 2
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert any((out / "tensorboard").rglob("events.out.tfevents.*"))
    # the workers were started by the fork server (verl_backend.host_memory.fork_server), and the run worked
    runtime_env = yaml.safe_load((out / "config.yaml").read_text())["ray_kwargs"]["ray_init"]["runtime_env"]
    assert "fork_client.py" in runtime_env["py_executable"]
    assert runtime_env["env_vars"]["RAY_num_workers_soft_limit"] == "0"  # idle workers end (~0.1 GiB each)


def test_console_is_short_and_quiet_and_train_log_has_the_rest(run):
    """The default console (issue #30): the settings line, a line per step, the summary with the paired
    interval; at most 60 lines (split on \\n and \\r), none error-looking, none twice. The rest is in train.log."""
    from verl_backend.driver.console import console_lines, console_problems

    out, proc = run
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    console = proc.stdout + proc.stderr
    assert console_problems(console) == [], console
    lines = console_lines(console)
    assert lines[0].startswith("[rl-tpu] GRPO on ") and "train.log" in lines[0], lines[0]
    assert sum(line.startswith("[rl-tpu] step ") for line in lines) == 2, lines
    assert re.search(
        r"validation accuracy: before [\d.]+% -> after [\d.]+% \([+-][\d.]+ points, 95% CI "
        r"[+-][\d.]+ to [+-][\d.]+(, no item changed \(rule of three\))?; paired over the same 8 items\)",
        console,
    ), console
    assert "strict (answer in <answer> tags)" in console
    log = (out / "train.log").read_text()
    for quiet in ("engine is not available", "Started a local Ray instance", "Training Progress", "(WorkerDict pid="):
        assert quiet in log and quiet not in console, quiet
    assert sorted(p.name for p in (out / "validation").glob("*.jsonl")) == ["0.jsonl", "2.jsonl"]


def test_metrics_have_finite_losses_and_rollout_logprobs_match_trainer(run):
    out, proc = run
    log = everything(out, proc)
    train = train_rows(out)
    assert len(train) == 2
    for m in train:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert math.isfinite(m[key]), key
        assert m["actor/grad_norm"] > 0  # the length reward gives non-zero GRPO advantages
        # the native rollout's log-probs are the trainer's own (same weights after each sync): this is what
        # makes the CPU default's bypass mode (old log-probs = rollout log-probs) exact
        assert m["training/rollout_probs_diff_max"] < 1e-3
        # every sync's figures, the same names on every transport (route 1: trainer_memory, zero copy)
        assert m["weight_sync/route"] == 1.0 and m["weight_sync/bytes"] > 0 and m["weight_sync/seconds"] >= 0
        # every sync verified (verl_backend/weight_sync/verify.py): the trainer's probe, scored through the sampler's
        # own prefill and decode on the in-place weights, within the float32 bound
        assert m["weight_sync/verified"] == 1.0, m
        assert 0 <= m["weight_sync/verify_max_abs_diff"] < 1e-3 and m["weight_sync/verify_seconds"] > 0
    assert "weight sync route: planned trainer_memory, took trainer_memory, because " in log
    # trainer and rollout share this host, one FSDP rank: the rollout computes on the trainer's own parameters in
    # shared memory, nothing is copied (step 2's log-probs above were sampled from the weights the optimizer
    # updated in place)
    assert re.search(
        r"weight sync to rollout replica 0: shared memory, in place: the rollout computes on the "
        r"trainer's parameters, 0 MB copied",
        log,
    )
    # GRPO's 4 samples per prompt share one copy of it in the trainer's packed rows (the log-probs checked above
    # came through that path)
    assert re.search(r"shared-prefix forward: a micro batch of \d+ sequences packs to \d+ tokens", log)
    # rl_tpu.trim_backward is off by default (bench_host_memory.py: no lower peak beside plain_module)
    assert "heap pages handed back" not in log
    # one CPU rank: the actor and the reference policy (both float32) run their modules unwrapped (no FSDP2 copies)
    unwrapped = re.findall(r"\[rl-tpu\] ([a-z ]+): one CPU rank, so the model runs unwrapped", log)
    assert sorted(unwrapped) == ["actor", "reference policy"], unwrapped
    # TransferQueue's copy threads are capped at the cores in every process, the driver's TaskRunner included
    # (it warned on every put and get: hundreds of lines per run)
    assert "should not exceed total physical CPU cores" not in log


def test_step_lines_and_dumps_count_accuracy_apart_from_the_reward(run):
    """The reward function's ``acc`` / ``acc_strict`` reach VeRL's training rollout dump (patched
    ``_log_rollout_data``; VeRL 0.9.1 drops them there) and its validation dump, and the console's step line counts
    them, not the reward (here a length reward whose accuracies are other functions of the length)."""
    out, proc = run
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    for step in (1, 2):
        rows = [json.loads(line) for line in (out / "rollouts" / f"{step}.jsonl").read_text().splitlines() if line]
        assert rows and all(r["acc"] in (0.0, 1.0) and r["acc_strict"] in (0.0, 1.0) for r in rows), rows[0]
        strict, lenient = (100 * sum(r[k] for r in rows) / len(rows) for k in ("acc_strict", "acc"))
        line = next(l for l in proc.stdout.splitlines() if l.startswith(f"[rl-tpu] step {step}/2 "))
        assert f"accuracy strict {strict:.1f}% lenient {lenient:.1f}%" in line, (line, strict, lenient)
    validation = [json.loads(line) for line in (out / "validation" / "2.jsonl").read_text().splitlines() if line]
    assert all("acc" in r and "acc_strict" in r for r in validation)
    summary = json.loads((out / "summary.json").read_text())
    lenient = sum(r["acc"] for r in validation) / len(validation)
    assert summary["val_change"]["lenient"]["after"] == pytest.approx(lenient)


def test_checkpoint_loads_and_weights_changed(run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out, _ = run
    ckpt = out / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    assert (ckpt / "config.json").is_file()
    # VeRL 0.9.1 labels the config bfloat16 over float32 weights; the engine relabels it (match_saved_config_dtype)
    assert AutoModelForCausalLM.from_pretrained(ckpt).dtype == torch.float32
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    deltas = [
        (a - b).abs().max().item() for (_, a), (_, b) in zip(trained.state_dict().items(), initial.state_dict().items())
    ]
    assert max(deltas) > 1e-4
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_checkpoint_written_by_verl_train_exports_to_litert(run, tmp_path):
    """The design's third way in: the model ``verl train`` improved goes to LiteRT with no manual step."""
    from edge_export import export_checkpoint

    out, _ = run
    ckpt = out / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    result = export_checkpoint(
        str(ckpt),
        str(tmp_path / "policy.tflite"),
        quantize="none",
        prefill_lengths=(32,),
        cache_length=64,
        verify_steps=4,
        quiet=True,
    )
    assert (tmp_path / "policy.tflite").stat().st_size > 0
    report = json.loads((tmp_path / "policy.tflite.report.json").read_text())
    assert report["kind"] != "module" and report["installed"] is True
    assert report["verification"]["passed"] is True
    assert report["verification"]["max_abs_error"] < 1e-2
    assert result.output.endswith("policy.tflite")


def test_sampler_inside_trainer_worker_placement(tmp_path, tiny_model_dir):
    """``sampler_placement=worker`` (the TPU default: a worker owns its chip) run here on CPU: the rollout server
    forwards batches to the trainer worker, whose in-process sampler is synced by an on-device copy."""
    proc = verl_train(
        tmp_path,
        "--max-restarts",
        "0",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "+actor_rollout_ref.rollout.engine_kwargs.native={sampler_placement:worker}",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=native",
        "algorithm.rollout_correction.bypass_mode=false",
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    step = train_rows(tmp_path)
    assert len(step) == 1
    assert step[0]["training/rollout_probs_diff_max"] < 1e-3
    assert step[0]["response_length/mean"] > 0


def test_ppo_with_a_critic_trains_on_cpu(tmp_path, tiny_model_dir):
    """examples/ppo_cpu.yaml: GAE advantages from a learned critic (VeRL's value-head engine, packed rows, sdpa;
    VeRL 0.9.1 would load the critic with flash-attn only). Two steps on the tiny model."""
    proc = verl_train(
        tmp_path,
        "--config",
        "examples/ppo_cpu.yaml",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"critic.model.path={tiny_model_dir}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "rl_tpu.train_size=16",
        "rl_tpu.val_size=8",
        "data.max_response_length=16",
        timeout=1200,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    train = train_rows(tmp_path, key="critic/vf_loss")
    assert len(train) == 2
    for m in train:
        for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "critic/values/mean"):
            assert math.isfinite(m[key]), key
        assert m["critic/grad_norm"] > 0


def _one_step_no_restart(model_dir) -> tuple[str, ...]:
    """A job of one step on ``model_dir`` without validation or checkpoints, its failure not retried: for the tests
    of how a run ends."""
    return (
        "--max-restarts",
        "0",
        f"actor_rollout_ref.model.path={model_dir}",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "rl_tpu.val_size=4",
        "data.max_response_length=8",
    )


def test_reward_function_that_raises_in_a_worker_is_one_line(tmp_path, tiny_model_dir):
    """VeRL 0.9.1's agent loop logs a failed reward and marks its prompt group failed; the driver then fails in
    the replay buffer ("no materializable trajectories"). ``verl train`` must end on the reward's own line."""
    reward = tmp_path / "raising_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    raise RuntimeError('boom in my reward')\n"
    )
    proc = verl_train(
        tmp_path / "o",
        *_one_step_no_restart(tiny_model_dir),
        "rl_tpu.train_size=8",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        timeout=1200,
        default_console=True,
    )
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-5000:])
    from verl_backend.driver.console import console_lines

    assert len(console_lines(proc.stdout + proc.stderr)) <= 10, proc.stdout + proc.stderr  # the rest: train.log
    assert "boom in my reward" in (tmp_path / "o" / "train.log").read_text()
    lines = [l for l in proc.stderr.splitlines() if l.startswith("verl: error:")]  # Ray may forward worker logs after
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "raising_reward.py:compute_score raised RuntimeError: boom in my reward" in lines[0], lines[0]
    assert "no materializable trajectories" not in proc.stderr.split("verl: error:")[-1]  # no driver traceback


def test_dapo_step_past_max_num_gen_batches_is_one_line(tmp_path, tiny_model_dir):
    """DAPO's dynamic sampling (``algorithm.filter_groups.enable=true``) on a random model: the default reward is 0
    for every sample, so no group has a reward spread and VeRL 0.9.1's V1 replay buffer would refill the step
    forever. VeRL's own ``max_num_gen_batches`` bounds it (:func:`verl_backend.patches.verl.bounded_refill`), and the
    run ends on one line naming the key."""
    proc = verl_train(
        tmp_path / "o",
        *_one_step_no_restart(tiny_model_dir),
        "rl_tpu.train_size=16",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=reward",
        "algorithm.filter_groups.max_num_gen_batches=2",
        timeout=1200,
        default_console=True,
    )
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-5000:])
    lines = [l for l in proc.stderr.splitlines() if l.startswith("verl: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "algorithm.filter_groups.max_num_gen_batches=2: step 1 has generated 2 batches" in lines[0], lines[0]


# a reward of 0 or 1 (an even length): with 2 samples a prompt about half the groups tie, all right or all wrong
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    right = float(len(solution_str) % 2 == 0)
    return {"score": right, "acc": right, "acc_strict": 0.0}
"""


def test_dapo_dynamic_sampling_trains_only_on_groups_with_a_spread(tmp_path, tiny_model_dir):
    """``algorithm.filter_groups.enable=true`` on the CPU backend, filtering on the reward as the default job does:
    VeRL's V1 replay buffer replaces each group whose 2 samples score alike (the parity reward: half the groups tie),
    so every group in a step's rollout dump has both scores; the step line says how many groups were replaced and the
    reward of all groups graded; ``summary.json`` counts them as ``metrics.jsonl`` does."""
    out = tmp_path / "o"
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    proc = verl_train(
        out,
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "rl_tpu.train_size=64",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=reward",
        "algorithm.filter_groups.max_num_gen_batches=16",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        default_console=True,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    for step in (1, 2):
        groups: dict[str, set] = {}
        for line in (out / "rollouts" / f"{step}.jsonl").read_text().splitlines():
            row = json.loads(line)
            groups.setdefault(row["input"], set()).add(row["acc"])
        assert groups and all(accs == {0.0, 1.0} for accs in groups.values()), (step, groups)
    rows = {r["step"]: r["data"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    replaced = {s: int(d[GROUPS_REPLACED_KEY]) for s, d in rows.items() if GROUPS_REPLACED_KEY in d}
    summary = json.loads((out / "summary.json").read_text())
    assert dict(summary["groups_replaced_no_spread"]) == replaced
    for step in (1, 2):
        data = rows[step]
        kept, graded = int(data[KEPT_GROUPS_KEY]), int(data[REPLACED_GROUPS_KEY])
        assert graded == replaced.get(step, 0)  # VeRL's count of the groups it replaced, and ours
        assert 0 <= data[REPLACED_SCORE_SUM_KEY] <= graded and data[REPLACED_SCORE_SUM_KEY] == int(
            data[REPLACED_SCORE_SUM_KEY]
        )
        # the groups trained on all have a spread of 0 and 1: their mean score is 0.5, what DAPO's filter keeps
        assert data["critic/score/mean"] == 0.5
        line = next(l for l in proc.stdout.splitlines() if l.startswith(f"[rl-tpu] step {step}/2 "))
        assert f"reward 0.500 of {kept} groups trained on | reward " in line, line
        assert f" of all {kept + graded} graded" in line, line
        if graded:
            assert f"{graded} groups without a reward spread replaced" in line, line
    assert [s for s, _ in summary["graded_reward_curve"]] == [1, 2]
