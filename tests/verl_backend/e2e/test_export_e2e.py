"""Train, then ship, in one command: ``verl train --backend cpu --export OUT.litertlm`` on a tiny random Llama.

Real parts only: VeRL's trainer on Ray, then ``litert export`` of the final checkpoint in its own process, verified
through the LiteRT-LM runtime (litert-lm-api) and scored on the run's held-out items with the run's reward function,
the runtime's answers beside PyTorch's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (len(solution_str) % 7) / 7.0
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("export_e2e")
    reward = out / "length_reward.py"
    reward.write_text(REWARD)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    env.pop("RAY_ADDRESS", None)
    bundle = out / "ship" / "policy.litertlm"
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out / "run"),
        "--export",
        str(bundle),
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        "trainer.save_freq=1",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=6",
        "data.max_response_length=16",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1500)
    return out / "run", bundle, proc


def test_final_checkpoint_is_exported_verified_and_scored(run):
    out, bundle, proc = run
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert bundle.stat().st_size > 1_000_000
    entry = json.loads((out / "summary.json").read_text())["export"]
    assert entry["status"] == "written" and entry["exit_code"] == 0
    assert entry["checkpoint"].endswith("global_step_1/actor/huggingface")
    assert entry["eval_items"] == 6
    assert entry["top1_agreement"] == 1.0  # fp32: the runtime's greedy tokens are PyTorch's at every step
    assert entry["scorer"].endswith("length_reward.py:compute_score")  # the run's own reward function
    assert f"held-out accuracy through LiteRT-LM {entry['runtime_accuracy']:.1f}%" in proc.stdout
    with open(entry["report"]) as fh:
        report = json.load(fh)
    items = report["eval"]["items"]
    assert len(items) == 6
    # the runtime answered each held-out prompt (the run's own chat messages) as PyTorch did, token for token
    assert [i["runtime_answer"] for i in items] == [i["torch_answer"] for i in items]
    assert all(i["runtime_error"] is None for i in items)
    assert abs(report["eval"]["runtime_accuracy"] - report["eval"]["torch_accuracy"]) < 1e-9
    held_out = [json.loads(line) for line in (out / "export" / "heldout.jsonl").read_text().splitlines()]
    assert [h["prompt"] for h in held_out] == [i["prompt"] for i in items]


def test_config_records_the_export_keys(run):
    import yaml

    out, bundle, _ = run
    recorded = yaml.safe_load((out / "config.yaml").read_text())["rl_tpu"]
    assert recorded["export"] == str(bundle) and recorded["export_quantize"] == "none"
