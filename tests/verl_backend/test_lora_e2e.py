"""End to end: ``verl train --backend cpu`` with VeRL's LoRA keys (``lora_rank=8 lora_alpha=16``) on a tiny random
Llama (weights far from zero: peaked distributions), 2 GRPO steps. The rollout samples on the merged model (base +
adapter) that each sync sends, so its log-probs are the trainer's (whose forward runs the adapter unmerged) after
every sync: VeRL's own merged export (bfloat16) gave rollout_probs_diff_max 7e-4 and per-sequence log-prob
differences up to 0.011 at step 1 on this model, a full fine-tuning run 8e-9 and 1e-6."""

from __future__ import annotations

import json
import math
import os
import re
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return build_tiny_model("llama", default_model_dir, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("lora_e2e")
    reward = out / "length_reward.py"
    reward.write_text(REWARD)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable, "-m", "verl_backend.cli", "train", "--backend", "cpu", "--output-dir", str(out),
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        "trainer.save_freq=1", "rl_tpu.train_size=8", "rl_tpu.val_size=4", "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-2",  # an adapter step large enough to move the merged model
        # recompute old log-probs (no bypass) so the rollout's log-probs can be checked against the trainer's
        "algorithm.rollout_correction.bypass_mode=false",
        f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=compute_score",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    return out, proc


def test_lora_run_trains_and_syncs_merged_weights(run):
    out, proc = run
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert re.search(r"weight sync to rollout replica 0: .* MB in [0-9.]+ s \(merged weights: base \+ LoRA rank 8 "
                     r"adapter\)", proc.stdout + proc.stderr)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r["data"] for r in rows if "actor/pg_loss" in r["data"]]
    assert len(train) == 2
    assert abs(train[0]["actor/ppo_kl"]) <= 1e-6  # rollout and trainer computed the same log-probs
    for m in train:
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        # step 2 sampled on the weights step 1's update merged and synced
        assert m["training/rollout_probs_diff_max"] < 1e-5
        assert max(abs(m["rollout_corr/log_ppl_diff_max"]), abs(m["rollout_corr/log_ppl_diff_min"])) < 1e-4


def _merged(ckpt_hf, base_dir):
    """The step's merged model, built from the adapter checkpoint VeRL saved (peft names) and the base model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(str(ckpt_hf / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, a in saved.items():
            if ".lora_A." not in name:
                continue
            b = saved[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight"
            state[target] += (16 / 8) * (b @ a)  # lora_alpha / r
    return model, saved


def test_the_adapter_moved_the_model_the_rollout_sampled(run, model_dir):
    """Step 1's update changed the merged model enough that a rollout left on the base weights (or on bfloat16
    merged ones) would have shown it in step 2's comparison (the check above could fail)."""
    from transformers import AutoModelForCausalLM

    out, _ = run
    merged, saved = _merged(out / "checkpoints/global_step_1/actor/huggingface", model_dir)
    assert any(".lora_B." in n and float(t.abs().max()) > 0 for n, t in saved.items())
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (merged(ids).logits.log_softmax(-1) - base(ids).logits.log_softmax(-1)).abs().max()
    assert float(gap) > 1e-2
