"""End to end: ``verl train --backend cpu`` on a tiny random Qwen3-MoE (4 experts, each expert matrix 1.06 MiB)
with the weight sync through the Ray object store in 1 MiB buckets (``rl_tpu.shared_weights=false``): VeRL 0.9.1
exports the experts per expert (``unfuse_moe_params``), each larger than a bucket, and the rollout writes them into
its fused expert tensors. After each sync the rollout's log-probs are the trainer's."""

from __future__ import annotations

import re

import pytest
from e2e_helpers import train_rows, verl_train, write_reward
from families import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory, default_model_dir):
    out = tmp_path_factory.mktemp("moe_e2e")
    model = build_tiny_model(
        "qwen3_moe",
        default_model_dir,
        out / "model",
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=1088,
    )
    proc = verl_train(
        out / "run",
        f"actor_rollout_ref.model.path={model}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "algorithm.rollout_correction.bypass_mode=false",
        "rl_tpu.shared_weights=false",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
        *write_reward(out),
    )
    return out / "run", proc


def test_moe_syncs_per_expert_through_1mib_buckets_and_rollout_matches_trainer(run):
    out, proc = run
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    line = re.search(
        r"weight sync to rollout replica 0: object store, rl_tpu.shared_weights=false, (\d+) MB",
        proc.stdout + proc.stderr,
    )
    assert line and int(line.group(1)) > 50  # the whole model, in 1 MiB buckets
    train = train_rows(out)
    assert len(train) == 2
    assert abs(train[0]["actor/ppo_kl"]) <= 1e-6
    for m in train:  # step 2 sampled on the experts step 1 updated and synced (measured: 1.3e-5 and 2.0e-5, float32
        # rounding of 256-wide expert products; per-sequence log-prob differences <= 7e-6)
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert max(abs(m["rollout_corr/log_ppl_diff_max"]), abs(m["rollout_corr/log_ppl_diff_min"])) < 1e-4
