"""End to end per family: ``verl train --backend cpu`` for 2 GRPO steps on a tiny random Qwen3 (query/key norms) and
Gemma3 (sliding-window and global layers, embedding scale, tied embeddings; prompts longer than its 5-token window):
the rollout's log-probs are the trainer's at the first step and after the sync, and the checkpoint loads in
transformers and samples greedily what the native sampler samples on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from families import build_tiny_model

pytestmark = pytest.mark.slow

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (len(solution_str) % 7) / 7.0
'''


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_family_trains_with_the_rollout_on_the_trainers_numbers(family, tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    from rl_tpu.sampler import Sampler, SamplingParams

    model = build_tiny_model(family, default_model_dir, tmp_path / "model")
    (tmp_path / "reward.py").write_text(REWARD)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "verl_backend.cli", "train", "--backend", "cpu", "--output-dir", str(out),
           f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=2", "trainer.test_freq=-1",
           "trainer.save_freq=2", "trainer.val_before_train=false", "rl_tpu.train_size=8", "rl_tpu.val_size=4",
           "data.max_response_length=16", "actor_rollout_ref.actor.optim.lr=1e-3",
           "algorithm.rollout_correction.bypass_mode=false",
           f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
           "reward.custom_reward_function.name=compute_score"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r["data"] for r in rows if "actor/pg_loss" in r["data"]]
    assert len(train) == 2
    assert abs(train[0]["actor/ppo_kl"]) <= 1e-6
    for m in train:  # step 2 sampled on the weights step 1 updated and synced
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert max(abs(m["rollout_corr/log_ppl_diff_max"]), abs(m["rollout_corr/log_ppl_diff_min"])) < 1e-4
    ckpt = AutoModelForCausalLM.from_pretrained(out / "checkpoints/global_step_2/actor/huggingface",
                                                dtype=torch.float32, attn_implementation="sdpa").eval()
    before = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert any(not torch.equal(a, b) for a, b in zip(ckpt.state_dict().values(), before.state_dict().values()))
    prompt = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(0))
    ids = prompt
    with torch.no_grad():  # greedy through the checkpoint's own forward, the whole sequence each step
        for _ in range(10):
            ids = torch.cat([ids, ckpt(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    hf = ids[0, 12:].tolist()
    native = Sampler(ckpt, pad_token_id=0, eos_token_ids=[]).generate(
        [prompt[0].tolist()], SamplingParams(temperature=0, max_new_tokens=10))[0].token_ids
    assert native == hf
