"""End to end, VeRL 0.9.1's ``colocate_async`` trainer on ``verl train --backend cpu``: the rollout of the next step
runs while the actor updates (``trainer.v1.trainer_mode=colocate_async``, one warm-up batch), within VeRL's staleness
bound (``trainer.v1.sampler.max_off_policy_threshold``), with VeRL's off-policy correction (the CPU default's bypass
mode: the PPO ratio is pi_theta over the policy that sampled, not over the current one)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from e2e_helpers import train_rows, verl_train, write_reward
from families import build_tiny_model

pytestmark = pytest.mark.slow

BOUND = 2  # trainer.v1.sampler.max_off_policy_threshold: a sample spans at most 2 versions, so staleness <= 1
STALE = "training/off_policy/trajectory_staleness_worst/max"


def test_colocate_async_trains_within_the_staleness_bound(tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    model = build_tiny_model("llama", default_model_dir, tmp_path / "model")
    out = tmp_path / "run"
    proc = verl_train(
        out,
        f"actor_rollout_ref.model.path={model}",
        "trainer.v1.trainer_mode=colocate_async",
        f"trainer.v1.sampler.max_off_policy_threshold={BOUND}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        *write_reward(tmp_path),
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["trainer"]["v1"]["trainer_mode"] == "colocate_async"
    assert config["algorithm"]["rollout_correction"]["bypass_mode"] is True
    train = train_rows(out)
    assert len(train) == 2
    for m in train:
        assert 0 <= m[STALE] <= BOUND - 1, m[STALE]  # VeRL's drop strategy keeps every sample within the bound
        assert m["training/off_policy/trajectory_staleness/max"] <= m[STALE]
        assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/grad_norm"))
        if m[STALE] == 0:  # sampled on the weights being updated: the ratio starts at 1
            assert abs(m["actor/ppo_kl"]) <= 1e-5, m
    # the warm-up batch was sampled on the first weights and trained on after the first update: one version stale,
    # and its PPO ratio is against the policy that sampled it (not 1)
    assert train[1][STALE] == 1
    assert abs(train[1]["actor/ppo_kl"]) > 1e-5
    ckpt = AutoModelForCausalLM.from_pretrained(
        out / "checkpoints/global_step_2/actor/huggingface", dtype=torch.float32
    )
    before = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(ckpt.state_dict().values(), before.state_dict().values()))
