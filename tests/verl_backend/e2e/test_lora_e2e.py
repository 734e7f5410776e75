"""End to end: ``verl train --backend cpu`` with VeRL's LoRA keys (``lora_rank=8 lora_alpha=16``) on a tiny random
Llama (weights far from zero: peaked distributions), 2 GRPO steps, on the CPU default's path and on the TPU
engine's (FSDP2-wrapped, padded micro batches, the sampler in the trainer worker). Each sync sends the adapter only;
the rollout merges it onto its base weights and samples on the merged model, so its log-probs are the trainer's (whose
forward runs the adapter unmerged) after every sync: VeRL's own merged export (bfloat16) gave rollout_probs_diff_max
7e-4 and per-sequence log-prob differences up to 0.011 at step 1 on this model, a full fine-tuning run 8e-9 and 1e-6."""

from __future__ import annotations

import math
import re

import pytest
import torch
from e2e_helpers import train_rows, verl_train, write_reward
from families import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return build_tiny_model("llama", default_model_dir, tmp_path_factory.mktemp("llama"))


def assert_adapter_synced_and_exact(train: list[dict]) -> None:
    """Every step synced the adapter alone (rank 8 on 2 layers x 7 matrices of the 64-wide model: under 0.2 MB, not
    the model's bytes), its merge computed the trainer's probe, and the rollout's log-probs were the trainer's."""
    assert len(train) == 2
    for m in train:
        if "weight_sync/bytes" in m:
            assert 0 < m["weight_sync/bytes"] <= 0.2e6, m["weight_sync/bytes"]
            assert m["weight_sync/verified"] == 1.0, m  # the merged adapter computes the trainer's probe
    assert abs(train[0]["actor/ppo_kl"]) <= 1e-6  # rollout and trainer computed the same log-probs
    for m in train:
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        # step 2 sampled on the weights step 1's update merged and synced
        assert m["training/rollout_probs_diff_max"] < 1e-5
        assert max(abs(m["rollout_corr/log_ppl_diff_max"]), abs(m["rollout_corr/log_ppl_diff_min"])) < 1e-4


def checkpoint_logprobs(actor, model_dir, seed: int):
    """Log-probs of 40 random tokens under the checkpoint's ``huggingface/`` (merged), the base model, and the base
    model with ``lora_adapter/`` applied by peft: ``(merged, base, base + adapter)``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(actor / "huggingface", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = merged(ids).logits.log_softmax(-1)
        before = base(ids).logits.log_softmax(-1)
        adapted = PeftModel.from_pretrained(base, actor / "lora_adapter").eval()
        want = adapted(input_ids=ids).logits.log_softmax(-1)
    return (merged, got), before, (adapted, want), ids


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("lora_e2e")
    proc = verl_train(
        out,
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=1",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-2",  # an adapter step large enough to move the merged model
        # recompute old log-probs (no bypass) so the rollout's log-probs can be checked against the trainer's
        "algorithm.rollout_correction.bypass_mode=false",
        *write_reward(out),
    )
    return out, proc


def test_lora_run_trains_and_syncs_merged_weights(run):
    out, proc = run
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert re.search(
        r"weight sync to rollout replica 0: .* MB in [0-9.]+ s \(adapter only, LoRA rank 8, [0-9.]+ MB",
        proc.stdout + proc.stderr,
    )
    # the adapter's forward takes the trainer's fast paths: one copy of each prompt per GRPO group, LM head at the
    # response positions only (the peft model's forward hands logits_to_keep to the model it wraps)
    assert "[rl-tpu] shared-prefix forward: a micro batch of" in proc.stdout + proc.stderr
    assert_adapter_synced_and_exact(train_rows(out))


def test_the_checkpoint_is_the_merged_model_and_the_adapter_moved_it(run, model_dir):
    """``huggingface/`` of the step-1 checkpoint loads in transformers as the merged model (the same log-probs as
    the base model with ``lora_adapter/`` applied by peft), and step 1's update moved it enough that a rollout left
    on the base weights (or on bfloat16 merged ones) would have shown in step 2's comparison (the check above could
    fail)."""
    out, _ = run
    (merged, got), before, (adapted, want), ids = checkpoint_logprobs(
        out / "checkpoints/global_step_1/actor", model_dir, seed=0
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert float((got - before).abs().max()) > 1e-2
    greedy = lambda m: m.generate(input_ids=ids[:, :8], max_new_tokens=8, do_sample=False)[0].tolist()
    assert greedy(merged) == greedy(adapted)


@pytest.fixture(scope="module")
def tpu_path_run(tmp_path_factory, model_dir):
    """The TPU backend's code path, as far as it runs on a CPU: the module FSDP2-wrapped (``rl_tpu.plain_module=false``;
    on a chip one rank never runs unwrapped), padded micro batches (the tpu profile's ``use_remove_padding=false``)
    and the sampler inside the trainer worker, synced in process by the native checkpoint engine (the tpu profile's
    ``sampler_placement=worker``)."""
    out = tmp_path_factory.mktemp("lora_tpu_path")
    proc = verl_train(
        out,
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "algorithm.rollout_correction.bypass_mode=false",
        "rl_tpu.plain_module=false",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.use_prefix_grouper=false",
        "+actor_rollout_ref.rollout.engine_kwargs.native={sampler_placement:worker}",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=native",
        *write_reward(out),
    )
    return out, proc


def test_lora_on_the_tpu_engines_path_trains_syncs_merged_and_checkpoints(tpu_path_run, model_dir):
    """LoRA through the FSDP2-wrapped engine, padded batches and the in-worker sampler: the sync line says merged
    weights, the rollout's log-probs are the trainer's at both steps, and the step-2 checkpoint holds the adapter
    (``lora_adapter/``) and the merged model (``huggingface/``), which loads in transformers as base + adapter."""
    out, proc = tpu_path_run
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "[rl-tpu] actor: FSDP2 wraps the model (rl_tpu.plain_module=false)" in log
    assert re.search(
        r"weight sync to rollout replica 0: in process, loaded on the trainer worker's device, "
        r"\d+ MB in [0-9.]+ s \(adapter only, LoRA rank 8, [0-9.]+ MB",
        log,
    )
    assert_adapter_synced_and_exact(train_rows(out))
    actor = out / "checkpoints/global_step_2/actor"
    assert (actor / "lora_adapter/adapter_config.json").is_file()
    (_, got), before, (_, want), _ = checkpoint_logprobs(actor, model_dir, seed=1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert float((got - before).abs().max()) > 1e-2  # the adapter trained: a base-model checkpoint would fail above
