"""End to end per family: ``verl train --backend cpu`` for 2 GRPO steps on a tiny random Qwen3 (query/key norms),
Gemma3 (sliding-window and global layers, embedding scale, tied embeddings) and windowed Qwen2 (a full-attention
layer, then a sliding one), each window 5 tokens, shorter than every prompt: the rollout's log-probs are the
trainer's at the first step and after the sync, and the checkpoint loads in transformers and samples greedily what
the native sampler samples on it. Gemma 3's run takes the chunked LM head (``rl_tpu.logits_chunk_mib``)."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import train_rows, verl_train, write_reward
from families import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen2_sliding"])
def test_family_trains_with_the_rollout_on_the_trainers_numbers(family, tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    from rl_tpu.sampler import Sampler, SamplingParams

    model = build_tiny_model(family, default_model_dir, tmp_path / "model")
    out = tmp_path / "run"
    proc = verl_train(
        out,
        f"actor_rollout_ref.model.path={model}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "algorithm.rollout_correction.bypass_mode=false",
        *write_reward(tmp_path),
        # Gemma 3's 262k vocabulary is what the chunked LM head is for: 1 MiB chunks (5 tokens of this tokenizer's
        # 49,152) make every micro batch of this run take several
        *(["rl_tpu.logits_chunk_mib=1"] if family == "gemma3" else []),
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    chunked = "[rl-tpu] chunked LM head: " in proc.stdout + proc.stderr
    assert chunked == (family == "gemma3"), proc.stdout[-3000:]
    assert "chunked LM head off" not in proc.stdout + proc.stderr
    # the log-probs below came through the shared-prefix row (windowed masks where the model has windows), not a
    # fallback to a copy of the prompt per sequence
    assert "[rl-tpu] shared-prefix forward: a micro batch of" in proc.stdout + proc.stderr
    assert "shared-prefix forward off" not in proc.stdout + proc.stderr
    train = train_rows(out)
    assert len(train) == 2
    assert abs(train[0]["actor/ppo_kl"]) <= 1e-6
    for m in train:  # step 2 sampled on the weights step 1 updated and synced
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert max(abs(m["rollout_corr/log_ppl_diff_max"]), abs(m["rollout_corr/log_ppl_diff_min"])) < 1e-4
    ckpt = AutoModelForCausalLM.from_pretrained(
        out / "checkpoints/global_step_2/actor/huggingface", dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    before = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert any(not torch.equal(a, b) for a, b in zip(ckpt.state_dict().values(), before.state_dict().values()))
    prompt = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(0))
    ids = prompt
    with torch.no_grad():  # greedy through the checkpoint's own forward, the whole sequence each step
        for _ in range(10):
            ids = torch.cat([ids, ckpt(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    hf = ids[0, 12:].tolist()
    native = (
        Sampler(ckpt, pad_token_id=0, eos_token_ids=[])
        .generate([prompt[0].tolist()], SamplingParams(temperature=0, max_new_tokens=10))[0]
        .token_ids
    )
    assert native == hf
