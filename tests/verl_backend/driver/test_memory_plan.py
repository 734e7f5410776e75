"""The per-chip memory plan (``verl_backend/driver/memory_plan.py``): Qwen3-8B's published sizes on TPU slices, how
the terms scale, the refusal before a TPU job starts, and ``--print-config``'s table.

The model is never downloaded: its ``config.json`` is written from transformers' ``Qwen3Config`` with the published
Qwen3-8B sizes, and parameters are counted on the meta device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from verl_backend.driver.memory_plan import (
    GIB,
    USABLE_FRACTION,
    check_memory_fits,
    plan_memory,
)
from verl_backend.driver.plan import compose_config
from verl_backend.driver.profiles import PROFILES
from verl_backend.errors import BadInputError

TPU = PROFILES["tpu"]
# Qwen3-8B (Qwen/Qwen3-8B config.json): 36 layers, hidden 4096, MLP 12288, 32 query / 8 key-value heads of 128,
# vocabulary 151936, untied LM head.
QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
            "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def qwen3_8b_dir(tmp_path_factory):
    from transformers import Qwen3Config

    out = tmp_path_factory.mktemp("qwen3_8b_config")
    Qwen3Config(**QWEN3_8B).save_pretrained(out)  # config.json only: no weights
    return out


def _job(model_dir, chips: int, **keys) -> object:
    """A GRPO job with the TPU profile's defaults on ``chips`` workers (one host of them), composed by VeRL."""
    job = {
        "trainer.nnodes": 1, "trainer.n_gpus_per_node": chips, "algorithm.adv_estimator": "grpo",
        "data.train_batch_size": 16, "actor_rollout_ref.rollout.n": 8, "data.max_prompt_length": 1024,
        "data.max_response_length": 1024, "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1, "actor_rollout_ref.actor.use_kl_loss": "true",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 2, "actor_rollout_ref.model.path": str(model_dir),
        **keys,
    }
    overrides = {**TPU.overrides, **{k: str(v) for k, v in job.items()}}
    return compose_config([f"{k}={v}" for k, v in overrides.items()])


def test_qwen3_8b_counted_on_the_meta_device(qwen3_8b_dir):
    plan = plan_memory(_job(qwen3_8b_dir, 4), "v6e-4", TPU)
    h, kv, i, layers, v = 4096, 8 * 128, 12288, 36, 151936
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h + 2 * 128  # attention, SwiGLU, two norms, q/k norms
    assert plan.model.layer_params == block
    assert plan.model.params == layers * block + 2 * v * h + h  # untied embedding and head, final norm: 8.19e9
    assert plan.model.qk_norm and not plan.model.tied
    assert plan.term("parameters") == plan.model.params * 4 / 4  # fp32 master weights over 4 shards
    assert plan.term("optimizer") == 2 * plan.term("gradients")
    # the sampler inside each worker: its own bf16 copy and a static KV cache of the worker's 32 sequences
    assert plan.term("sampler weights") == plan.model.params * 2
    assert plan.term("sampler KV cache") == 2 * layers * 8 * 128 * (1024 + 1024) * 32 * 2


def test_qwen3_8b_does_not_fit_a_v6e_4_and_is_refused_before_it_starts(qwen3_8b_dir):
    config = _job(qwen3_8b_dir, 4)
    plan = plan_memory(config, "v6e-4", TPU)
    assert plan.hbm_bytes == 32 * GIB and plan.fits is False
    # training state alone (fp32 weights, gradients, AdamW: 16 bytes a parameter, over 4 chips) passes 90% of 32 GiB
    assert plan.term("parameters") + plan.term("gradients") + plan.term("optimizer") > USABLE_FRACTION * 32 * GIB
    with pytest.raises(BadInputError) as err:
        check_memory_fits(config, "v6e-4:2x2", TPU)
    line = str(err.value)
    assert "\n" not in line
    for part in ("Qwen3ForCausalLM", str(qwen3_8b_dir), "v6e-4", f"{plan.peak / GIB:.1f} GiB",
                 "28.8 GiB usable", "biggest term", "more chips (v6e-", "optimizer_offload",
                 "ppo_micro_batch_size_per_gpu"):
        assert part in line, (part, line)
    assert "enable_gradient_checkpointing" not in line  # the TPU profile's job has it on already
    # the CPU backend's dry run of the same slice is held to this host's memory instead: 4 host processes of an 8B
    # model's training state cannot fit any machine this runs on (>= 4 x 16 B x 8.2e9 = 489 GiB)
    with pytest.raises(BadInputError, match=r"needs at least .* GiB on this host \(4 trainer worker\(s\)"):
        check_memory_fits(config, "v6e-4:2x2", PROFILES["cpu"])


def test_qwen3_8b_fits_a_v5p_slice(qwen3_8b_dir):
    config = _job(qwen3_8b_dir, 4)
    plan = plan_memory(config, "v5p-8", TPU)  # 4 chips of 95 GiB
    assert plan.fits is True and plan.peak > 40 * GIB
    check_memory_fits(config, "v5p-8", TPU)  # no refusal


def test_terms_scale_with_micro_batch_and_shards(qwen3_8b_dir):
    one = plan_memory(_job(qwen3_8b_dir, 4), "v6e-4", TPU)
    two = plan_memory(_job(qwen3_8b_dir, 4, **{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2}), "v6e-4",
                      TPU)
    assert two.term("activations") == 2 * one.term("activations")
    assert two.term("LM head logits") == 2 * one.term("LM head logits")
    assert two.term("parameters") == one.term("parameters")
    single = plan_memory(_job(qwen3_8b_dir, 1, **{"data.train_batch_size": 4}), "v6e-1", TPU)
    for name in ("parameters", "gradients", "optimizer", "reference policy"):
        assert single.term(name) == 4 * one.term(name), name
    assert single.term("sampler weights") == one.term("sampler weights")  # unsharded either way
    ckpt = plan_memory(_job(qwen3_8b_dir, 4, **{"actor_rollout_ref.model.enable_gradient_checkpointing": "false"}),
                       "v6e-4", TPU)
    assert ckpt.term("activations") > 10 * one.term("activations")  # 36 blocks kept instead of their inputs
    offload = plan_memory(_job(qwen3_8b_dir, 4, **{"actor_rollout_ref.actor.fsdp_config.optimizer_offload": "true"}),
                          "v6e-4", TPU)
    assert offload.term("optimizer") == 0 and offload.peak < one.peak


@pytest.mark.slow
def test_print_config_shows_the_plan_as_comments(tmp_path, tiny_model_dir):
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run(
        [sys.executable, "-m", "verl_backend.driver.cli", "train", "--backend", "tpu", "--print-config", "--slice",
         "v6e-4", "--output-dir", str(tmp_path), f"actor_rollout_ref.model.path={tiny_model_dir}",
         "algorithm.adv_estimator=grpo",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"],
        check=False, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    table = out[out.index("# memory plan per chip: LlamaForCausalLM"):]
    for row in ("parameters (fp32)", "gradients", "optimizer (AdamW", "sampler KV cache", "activations",
                "LM head logits", "peak estimate", "usable HBM", "90% of 32 GiB per chip: fits"):
        assert row in table, row
    cfg = yaml.safe_load(out[out.index("actor_rollout_ref:"):])  # the plan's lines are comments: still the config
    assert cfg["trainer"]["n_gpus_per_node"] == 4


def test_the_compiled_trainer_plans_its_bucketed_micro_batches(qwen3_8b_dir):
    """rl_tpu.compile_trainer pads each padded micro batch on to a power of two (1024 + 512 tokens -> 2048): the plan
    counts the update's activations and logits at that length, so the HBM refusal stays an upper bound."""
    keys = {"data.max_response_length": 512}
    eager = plan_memory(_job(qwen3_8b_dir, 8, **keys), "v6e-8", TPU)
    compiled = plan_memory(_job(qwen3_8b_dir, 8, **keys, **{"+rl_tpu.compile_trainer": "true"}), "v6e-8", TPU)
    assert compiled.term("LM head logits") == pytest.approx(eager.term("LM head logits") * 2048 / 1536, rel=1e-9)
    assert compiled.term("activations") > 1.3 * eager.term("activations")  # softmax term grows with the square
    assert compiled.term("parameters") == eager.term("parameters")


# Qwen3-1.7B and Qwen3-0.6B (their config.json) with the default tokenizer's vocabulary (49152), as the scale
# benchmark builds them: 28 layers each; hidden 2048 / 1024, MLP 6144 / 3072, 16 query / 8 key-value heads of 128.
QWEN3_1_7B = {"vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}
QWEN3_0_6B = {**QWEN3_1_7B, "hidden_size": 1024, "intermediate_size": 3072}
HOST = 23.5 * GIB  # this machine's 24 GiB (MemTotal), fixed so the test does not depend on where it runs


def _cpu_job(model_dir, **keys):
    """The default CPU job (grpo_cpu.yaml's batch, lengths and KL loss) on ``model_dir``, composed by VeRL."""
    cpu = PROFILES["cpu"]
    default = yaml.safe_load(cpu.default_config.read_text())
    aro = default["actor_rollout_ref"]
    job = {
        "trainer.nnodes": 1, "trainer.n_gpus_per_node": 1, "algorithm.adv_estimator": "grpo",
        "data.train_batch_size": default["data"]["train_batch_size"], "actor_rollout_ref.rollout.n": aro["rollout"]["n"],
        "data.max_prompt_length": default["data"]["max_prompt_length"],
        "data.max_response_length": default["data"]["max_response_length"],
        "actor_rollout_ref.actor.ppo_mini_batch_size": aro["actor"]["ppo_mini_batch_size"],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": aro["actor"]["ppo_micro_batch_size_per_gpu"],
        "actor_rollout_ref.actor.use_kl_loss": "true", "actor_rollout_ref.model.path": str(model_dir), **keys,
    }
    overrides = {**cpu.overrides, **{k: str(v) for k, v in job.items()}}
    return compose_config([f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize("shape,lora,refused", [(QWEN3_1_7B, 0, True), (QWEN3_1_7B, 16, False),
                                                (QWEN3_0_6B, 0, False)])
def test_a_cpu_job_past_the_host_memory_is_refused_in_one_line(tmp_path, shape, lora, refused):
    """Qwen3-1.7B-shaped full fine-tuning (fp32 weights, gradients, AdamW and the reference: 20 B a parameter,
    ~29 GiB) cannot fit 24 GiB and is refused naming LoRA; with LoRA, and at 0.6B, it is not."""
    from transformers import Qwen3Config

    from verl_backend.driver.memory_plan import host_refusal

    Qwen3Config(**shape).save_pretrained(tmp_path)
    config = _cpu_job(tmp_path, **({"actor_rollout_ref.model.lora_rank": lora} if lora else {}))
    plan = plan_memory(config, None, PROFILES["cpu"])
    line = host_refusal(plan, str(tmp_path), HOST)
    assert (line is not None) == refused, (plan.format(), line)
    if refused:
        assert "\n" not in line
        for part in ("Qwen3ForCausalLM", str(tmp_path), f"{plan.peak / GIB:.1f} GiB", f"{HOST * USABLE_FRACTION / GIB:.1f} GiB usable",
                     "biggest term: optimizer", "lora_rank=16", "use_kl_loss=false", "enable_gradient_checkpointing"):
            assert part in line, (part, line)
