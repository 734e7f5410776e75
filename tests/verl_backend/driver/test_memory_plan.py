"""The per-chip memory plan (``verl_backend/driver/memory_plan.py``): Qwen3-8B's published sizes on TPU slices, how
the terms scale, the refusal before a TPU job starts, and ``--print-config``'s table.

The model is never downloaded: its ``config.json`` is written from transformers' ``Qwen3Config`` with the published
Qwen3-8B sizes, and parameters are counted on the meta device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from verl_backend.driver.memory_plan import (
    GIB,
    JOB_RUNTIME_BYTES,
    TRAINER_RUNTIME_BYTES,
    USABLE_FRACTION,
    plan_memory,
)
from verl_backend.driver.job_shape import job_shape
from verl_backend.driver.memory_fit import check_memory_fits
from verl_backend.driver.model_shape import arrays_bytes, tpu_bytes
from verl_backend.driver.plan import compose_config
from verl_backend.driver.profiles import PROFILES
from verl_backend.errors import BadInputError

TPU = PROFILES["tpu"]
# Qwen3-8B (Qwen/Qwen3-8B config.json): 36 layers, hidden 4096, MLP 12288, 32 query / 8 key-value heads of 128,
# vocabulary 151936, untied LM head.
QWEN3_8B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def qwen3_8b_dir(tmp_path_factory):
    from transformers import Qwen3Config

    out = tmp_path_factory.mktemp("qwen3_8b_config")
    Qwen3Config(**QWEN3_8B).save_pretrained(out)  # config.json only: no weights
    return out


def _job(model_dir, chips: int, **keys) -> object:
    """A GRPO job with the TPU profile's defaults on ``chips`` workers (one host of them), composed by VeRL."""
    job = {
        "trainer.nnodes": 1,
        "trainer.n_gpus_per_node": chips,
        "algorithm.adv_estimator": "grpo",
        "data.train_batch_size": 16,
        "actor_rollout_ref.rollout.n": 8,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 1024,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.actor.use_kl_loss": "true",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.model.path": str(model_dir),
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
    # the sampler inside each worker: its own bf16 copy, each array as the TPU lays it out (the 1-D norm weights of
    # 128 and 4096 pad to tiles of 256 and 1024 elements: 0.0001% more), and a static KV cache of the worker's 32
    # sequences (2048 slots minor: no padding)
    weights = plan.model.sampler_graph(1, 1, 1, 2)["weights"]
    assert plan.term("sampler weights") == arrays_bytes(weights) == pytest.approx(plan.model.params * 2, rel=1e-5)
    assert plan.term("sampler weights") > plan.model.params * 2
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
    for part in (
        "Qwen3ForCausalLM",
        str(qwen3_8b_dir),
        "v6e-4",
        f"{plan.peak / GIB:.1f} GiB",
        "28.8 GiB usable",
        "biggest term",
        "more chips (v6e-",
        "optimizer_offload",
        "ppo_micro_batch_size_per_gpu",
    ):
        assert part in line, (part, line)
    assert "enable_gradient_checkpointing" not in line  # the TPU profile's job has it on already
    # the CPU backend's dry run of the same slice is held to this host's memory instead: 4 host processes of an 8B
    # model's training state cannot fit any machine this runs on (>= 4 x 16 B x 8.2e9 = 489 GiB)
    with pytest.raises(BadInputError, match=r"needs about .* GiB on this host \(4 trainer worker\(s\)"):
        check_memory_fits(config, "v6e-4:2x2", PROFILES["cpu"])


def test_qwen3_8b_fits_a_v5p_slice(qwen3_8b_dir):
    """4 chips of 95 GiB hold it with a sampler batch of 8; at the worker's 32 sequences the sampler's prefill (its
    math attention's two fp32 score-sized arrays, 32x32x1024x2048 x 4 B = 8 GiB each, as the compiled graph holds
    them) and the rewritten KV cache make generation the largest phase, past the chip."""
    config = _job(qwen3_8b_dir, 4, **{"actor_rollout_ref.rollout.max_num_seqs": 8})
    plan = plan_memory(config, "v5p-8", TPU)
    assert plan.fits is True and plan.peak > 40 * GIB
    check_memory_fits(config, "v5p-8", TPU)  # no refusal
    full = plan_memory(_job(qwen3_8b_dir, 4), "v5p-8", TPU)
    assert full.peak_phase[0] == "generation" and full.fits is False
    assert full.term("sampler temporaries") == pytest.approx(18 * GIB, rel=1e-3)


def test_terms_scale_with_micro_batch_and_shards(qwen3_8b_dir):
    one = plan_memory(_job(qwen3_8b_dir, 4), "v6e-4", TPU)
    two = plan_memory(
        _job(qwen3_8b_dir, 4, **{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2}), "v6e-4", TPU
    )
    # a + b x micro: the parameters the compiled forward returns (a copy of the block's, of the LM head's) do not grow
    block = [a for a in one.model.block_graph(1, 2048, 2)["returned"] if a[0] == "block parameter"]
    head = [a for a in one.model.head_graph(1, 2048, 2)["returned"] if a[0] == "LM head parameter"]
    for term, fixed in (("activations", arrays_bytes(block)), ("LM head logits", arrays_bytes(head))):
        assert two.term(term) - one.term(term) == pytest.approx(one.term(term) - fixed, rel=1e-6), term
    assert two.term("parameters") == one.term("parameters")
    single = plan_memory(_job(qwen3_8b_dir, 1, **{"data.train_batch_size": 4}), "v6e-1", TPU)
    for name in ("parameters", "gradients", "optimizer", "reference policy"):
        assert single.term(name) == 4 * one.term(name), name
    assert single.term("sampler weights") == one.term("sampler weights")  # unsharded either way
    ckpt = plan_memory(
        _job(qwen3_8b_dir, 4, **{"actor_rollout_ref.model.enable_gradient_checkpointing": "false"}), "v6e-4", TPU
    )
    assert ckpt.term("activations") > 10 * one.term("activations")  # 36 blocks kept instead of their inputs
    offload = plan_memory(
        _job(qwen3_8b_dir, 4, **{"actor_rollout_ref.actor.fsdp_config.optimizer_offload": "true"}), "v6e-4", TPU
    )
    assert offload.term("optimizer") == 0 and offload.peak < one.peak


@pytest.mark.slow
def test_print_config_shows_the_plan_as_comments(tmp_path, tiny_model_dir):
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_backend.driver.cli",
            "train",
            "--backend",
            "tpu",
            "--print-config",
            "--slice",
            "v6e-4",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    table = out[out.index("# memory plan per chip: LlamaForCausalLM") :]
    for row in (
        "parameters (fp32)",
        "gradients",
        "optimizer (AdamW",
        "sampler KV cache",
        "activations",
        "LM head logits",
        "peak estimate",
        "usable HBM",
        "90% of 32 GiB per chip: fits",
    ):
        assert row in table, row
    cfg = yaml.safe_load(out[out.index("actor_rollout_ref:") :])  # the plan's lines are comments: still the config
    assert cfg["trainer"]["n_gpus_per_node"] == 4


def test_the_compiled_trainer_plans_its_bucketed_micro_batches(qwen3_8b_dir):
    """rl_tpu.compile_trainer pads each padded micro batch on to a power of two (1024 + 512 tokens -> 2048): the plan
    counts the update's activations and logits at that length, so the HBM refusal stays an upper bound."""
    keys = {"data.max_response_length": 512}
    eager = plan_memory(_job(qwen3_8b_dir, 8, **keys), "v6e-8", TPU)
    compiled = plan_memory(_job(qwen3_8b_dir, 8, **keys, **{"+rl_tpu.compile_trainer": "true"}), "v6e-8", TPU)
    fixed = arrays_bytes([a for a in eager.model.head_graph(1, 2048, 2)["returned"] if a[0] == "LM head parameter"])
    per_token = (eager.term("LM head logits") - fixed) * 2048 / 1536
    assert compiled.term("LM head logits") - fixed == pytest.approx(per_token, rel=1e-6)
    assert compiled.term("activations") > 1.3 * eager.term("activations")  # softmax term grows with the square
    assert compiled.term("parameters") == eager.term("parameters")


# Qwen3-1.7B and Qwen3-0.6B (their config.json) with the default tokenizer's vocabulary (49152), as the scale
# benchmark builds them: 28 layers each; hidden 2048 / 1024, MLP 6144 / 3072, 16 query / 8 key-value heads of 128.
QWEN3_1_7B = {
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
QWEN3_0_6B = {**QWEN3_1_7B, "hidden_size": 1024, "intermediate_size": 3072}
HOST = 23.5 * GIB  # this machine's 24 GiB (MemTotal), fixed so the test does not depend on where it runs


def _cpu_job(model_dir, **keys):
    """The default CPU job (grpo_cpu.yaml's batch, lengths and KL loss) on ``model_dir``, composed by VeRL."""
    cpu = PROFILES["cpu"]
    default = yaml.safe_load(cpu.default_config.read_text())
    aro = default["actor_rollout_ref"]
    job = {
        "trainer.nnodes": 1,
        "trainer.n_gpus_per_node": 1,
        "algorithm.adv_estimator": "grpo",
        "data.train_batch_size": default["data"]["train_batch_size"],
        "actor_rollout_ref.rollout.n": aro["rollout"]["n"],
        "data.max_prompt_length": default["data"]["max_prompt_length"],
        "data.max_response_length": default["data"]["max_response_length"],
        "actor_rollout_ref.actor.ppo_mini_batch_size": aro["actor"]["ppo_mini_batch_size"],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": aro["actor"]["ppo_micro_batch_size_per_gpu"],
        "actor_rollout_ref.actor.use_kl_loss": "true",
        "actor_rollout_ref.model.path": str(model_dir),
        **keys,
    }
    overrides = {**cpu.overrides, **{k: str(v) for k, v in job.items()}}
    return compose_config([f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize("shape,lora,refused", [(QWEN3_1_7B, 0, True), (QWEN3_1_7B, 16, False), (QWEN3_0_6B, 0, False)])
def test_a_cpu_job_past_the_host_memory_is_refused_in_one_line(tmp_path, shape, lora, refused):
    """Qwen3-1.7B-shaped full fine-tuning (fp32 weights, gradients, AdamW and the reference: 20 B a parameter,
    ~29 GiB) cannot fit 24 GiB and is refused naming LoRA; with LoRA, and at 0.6B, it is not."""
    from transformers import Qwen3Config

    from verl_backend.driver.memory_fit import fit_packed_weights, host_refusal

    Qwen3Config(**shape).save_pretrained(tmp_path)
    config = _cpu_job(tmp_path, **({"actor_rollout_ref.model.lora_rank": lora} if lora else {}))
    fit_packed_weights(config, PROFILES["cpu"], host_bytes=HOST)  # as the driver does first (1.7B LoRA: off)
    plan = plan_memory(config, None, PROFILES["cpu"])
    # the whole job on one host: the trainer's peak or its resident terms without gradients beside, while the
    # rollout generates, the server's packed copies and KV cache, or, while it takes a LoRA adapter, the model's
    # files it maps; the server's fp32 copy; the processes' runtime
    server = next(t for t in plan.host_terms if t.name.startswith("rollout server weights"))
    assert server.bytes == plan.model.params * 4, server
    generating = sum(t.bytes for t in plan.host_terms if t.when == "host generation")
    syncing = sum(t.bytes for t in plan.host_terms if t.when == "host sync")
    assert bool(syncing) == bool(lora)
    resident = plan.resident - plan.term("gradients")
    assert plan.host_need == pytest.approx(
        max(plan.peak, resident + generating, resident + syncing)
        + server.bytes
        + TRAINER_RUNTIME_BYTES
        + JOB_RUNTIME_BYTES
    )
    line = host_refusal(plan, str(tmp_path), HOST)
    assert (line is not None) == refused, (plan.format(), line)
    if refused:
        assert "\n" not in line
        for part in (
            "Qwen3ForCausalLM",
            str(tmp_path),
            f"{plan.peak / GIB:.1f} GiB",
            f"{HOST * USABLE_FRACTION / GIB:.1f} GiB usable",
            "biggest term: optimizer",
            "lora_rank=16",
            "use_kl_loss=false",
            "enable_gradient_checkpointing",
        ):
            assert part in line, (part, line)


# What libtpu 0.0.52's compiler reports for a program taking and returning one array of each shape on v6e (argument
# bytes; the layout it chose in the comment): measured here through JAX's compile-only client.
XLA_SIZES = [
    ((1, 1024, 576), 2, 1179648),  # {1,2,0:T(8,128)(2,1)}: the 1024 tokens minor, 576 next: dense
    ((576, 576), 2, 737280),  # {1,0:T(8,128)(2,1)}: 576 -> 640
    ((576, 192), 2, 245760),  # {0,1:...}: 576 minor (-> 640), 192 next
    ((192, 576), 2, 245760),
    ((1536, 576), 2, 1769472),  # {0,1}: 1536 minor, dense
    ((49152, 576), 2, 56623104),
    ((64, 1, 576), 2, 81920),  # {2,0,1}
    ((1, 1024, 3, 64), 4, 786432),  # {1,3,2,0}
    ((64, 3, 1024, 64), 2, 25165824),  # {2,3,1,0}
    ((1, 2048, 32, 1), 4, 262144),  # a q_norm rsqrt: 2048 minor, 32 next
    ((1, 2048, 1), 4, 8192),  # T(1,128)
    ((1, 2048, 1), 2, 8192),  # T(2,128)(2,1): 16-bit rows pair up
    ((3, 64), 4, 2048),  # T(4,128)
    ((2, 7), 4, 1024),  # T(2,128)
    ((12, 1000), 2, 32768),  # 12 rows -> 16
    ((9, 1000), 4, 65536),
    ((3, 1000), 2, 8192),
    ((64, 1), 8, 1024),  # s64
    ((576,), 2, 2048),  # T(1024)
    ((128,), 2, 512),  # T(256)
    ((300,), 2, 1024),  # T(512)
    ((100,), 4, 512),  # T(128)
    ((4096,), 4, 16384),
    ((1, 2048, 151936), 4, 2048 * 151936 * 4),
]


def test_tpu_bytes_is_what_xla_lays_out():
    """``tpu_bytes`` is the HBM size XLA gives each measured shape: it pads the two minor dimensions it picks to 8x128
    tiles (smaller second-minor tiles for 4 rows or fewer) and picks the pair that pads least. Negative control: the
    rule the issue assumed (the last dimension to 128, the one before it to 8: SmolLM2's 192- and 64-wide tensors
    +33-100%) misses most of them."""
    for shape, itemsize, xla in XLA_SIZES:
        assert tpu_bytes(shape, itemsize) == xla, (shape, itemsize)

    def last_two(shape, itemsize):
        *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
        return math.prod(lead) * -(-rows // 8) * 8 * -(-cols // 128) * 128 * itemsize

    wrong = [(s, b) for s, b, xla in XLA_SIZES if last_two(s, b) != xla]
    assert len(wrong) >= 10, wrong
    assert last_two((1, 1024, 576), 2) == 1179648 * 640 // 576  # +11% where XLA pads nothing


# XLA's numbers for the two jobs of docs/tpu.md, as `verl train --backend tpu --aot-only --slice v6e-8` compiled
# them with libtpu 0.0.52 (the per-graph rows of compiled-v6e_2x4.json; per-array sizes kept for the block forward)
XLA_V6E8 = Path(__file__).parent / "fixtures" / "aot_v6e8_compiled.json"
ROWS = {
    "block forward arguments",
    "activations",
    "block backward outputs",
    "update temporaries",
    "LM head forward arguments",
    "LM head logits",
    "LM head backward outputs",
    "sampler weights + KV cache",
    "sampler step outputs",
    "sampler temporaries",
}


def _aot_config(monkeypatch, tmp_path, argv):
    """The config ``verl train --backend tpu --aot-only --slice v6e-8 argv`` composes (nothing runs)."""
    import verl_backend.driver.aot.job as job
    from verl_backend.driver.cli import main

    caught = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(
        job,
        "run_aot_only",
        lambda config, slice_name, model_path=None, all_buckets=False: (
            caught.update(config=config, model_path=model_path) or 0
        ),
    )
    assert (
        main(["train", "--backend", "tpu", "--aot-only", "--slice", "v6e-8", "--output-dir", str(tmp_path), *argv]) == 0
    )
    return caught["config"], caught["model_path"]


@pytest.mark.parametrize("job", ["default", "qwen3-8b"])
def test_the_plan_beside_xla_term_by_term(monkeypatch, tmp_path, default_model_dir, job):
    """Every term of the TPU plan that a compiled graph holds is within 15% of XLA's number for it, for the TPU
    default job (SmolLM2-135M, VeRL's GAE job with the profile's micro batches of 8) and the Qwen3-8B-shaped job on
    v6e-8 (the arrays the graphs take and return within 1%, the temporaries within 15%); the one exception, the 8B
    job's log-prob forward (its block part counts a 32x2048x2048 fp32 score array XLA fuses away: 1.24x), is never
    under XLA's. The terms in no graph are listed as such. Negative control: the 8B plan at the unpadded 1536 tokens
    (rl_tpu.compile_trainer off, as the earlier plan counted) misses XLA's activations and LM head by more than
    15%."""
    from transformers import AutoConfig

    from verl_backend.driver.aot.job import comparison_table, planned_as_compiled
    from verl_backend.driver.aot.run import plan_comparison

    argv = (
        [f"actor_rollout_ref.model.path={default_model_dir}"]
        if job == "default"
        else ["--config", "examples/qwen3_8b_tpu.yaml", "actor_rollout_ref.model.path=examples/models/qwen3-8b"]
    )
    monkeypatch.chdir(Path(__file__).parents[3])  # the repository root
    config, model_path = _aot_config(monkeypatch, tmp_path, argv)
    compiled = json.loads(XLA_V6E8.read_text())[job]
    hf = AutoConfig.from_pretrained(model_path) if model_path else None
    planned, notes = planned_as_compiled(job_shape(config, 8))
    assert notes == []  # the TPU profile compiles the trainer (profiles.TPU_SETTINGS)
    rows = plan_comparison(plan_memory(planned, "v6e-8", TPU, hf_config=hf), compiled, True)
    measured = {name: (plan, xla) for name, plan, xla, _ in rows if xla is not None}
    # the no-grad log-prob forward in both; the critic's (GAE) in the default job only
    assert set(measured) == ROWS | {"log-prob forward"} | ({"critic activations"} if job == "default" else set())
    for name, (plan, xla) in measured.items():
        if job == "qwen3-8b" and name == "log-prob forward":  # its block part an upper bound: XLA fuses the
            assert 1 <= plan / xla <= 1.25, (name, plan / GIB, xla / GIB)  # 32x2048x2048 scores away (docs/tpu.md)
        elif name == "log-prob forward":  # the LM head's logits and log-softmax, and one block's temporaries
            assert abs(plan / xla - 1) <= 0.15, (name, plan / GIB, xla / GIB)
        elif "temporaries" in name:  # XLA's buffer assignment, estimated
            assert abs(plan / xla - 1) <= 0.15, (name, plan / GIB, xla / GIB)
        else:  # arrays the graphs take and return, counted from the shapes: as exact as XLA's own layouts
            assert abs(plan / xla - 1) <= 0.01, (name, plan / GIB, xla / GIB)
    no_graph = [name for name, _, xla, _ in rows if xla is None]
    for term in ("parameters", "gradients", "optimizer", "FSDP2 gather buffers"):
        assert any(n.startswith(term) for n in no_graph), term
    table = comparison_table(rows, notes)
    assert "plan/XLA" in table and all(name in table for name in ROWS)
    if job == "qwen3-8b":  # negative control: planned as the job says, 1536 tokens, not the graphs' 2048 bucket
        eager = config.copy()
        OmegaConf.update(eager, "rl_tpu.compile_trainer", False)
        eager = plan_memory(eager, "v6e-8", TPU, hf_config=hf)
        off = {name: plan / xla for name, plan, xla, _ in plan_comparison(eager, compiled, True) if xla}
        assert off["activations"] < 0.85 and off["LM head logits"] < 0.85, off


def test_aot_only_plans_the_job_it_compiles(monkeypatch, tmp_path, default_model_dir):
    """``--aot-only``'s plan is the job's with the compiled trainer on, and the plan and the graph list read one micro
    batch off the job (``JobShape``): the TPU default job's profile micro batches of 8; where a job sets no actor
    micro batch (VeRL 0.9.1 refuses that outside ``use_dynamic_bsz``), the mini batch's share in both (32 sequences
    on 8 chips), where the graphs took 1 and the plan 32 before. Negative control: a job with the compiled trainer
    off gets the flag turned on, said in a note."""
    import dataclasses

    from verl_backend.driver.aot.graphs import job_graphs
    from verl_backend.driver.aot.job import planned_as_compiled

    model = f"actor_rollout_ref.model.path={default_model_dir}"
    default, _ = _aot_config(monkeypatch, tmp_path / "a", [model])
    planned, notes = planned_as_compiled(job_shape(default, 8))
    assert notes == [] and planned.compile_trainer
    assert "8 seqs" in next(t.how for t in plan_memory(planned, "v6e-8", TPU).terms if t.name == "activations")
    assert job_graphs(planned)[0].batch == 8
    off, notes = planned_as_compiled(dataclasses.replace(planned, compile_trainer=False))
    assert notes == ["rl_tpu.compile_trainer=true"] and off.compile_trainer
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    bare, _ = _aot_config(monkeypatch, tmp_path / "b", [f"{key}=null", model])
    planned, _ = planned_as_compiled(job_shape(bare, 8))
    assert "32 seqs" in next(t.how for t in plan_memory(planned, "v6e-8", TPU).terms if t.name == "activations")
    assert job_graphs(planned)[0].batch == 32


def test_a_cpu_job_that_fits_only_without_packed_weights_samples_on_plain_weights(tmp_path):
    """Qwen3-1.7B-shaped LoRA: measured here at a 21.1 GiB peak with the rollout's packed copies (6.5 GiB while it
    generates), past 90% of 23.5 GiB in the plan; without them it fits, so the driver turns them off in one line. A
    job that fits keeps them; one that was told keeps what it was told."""
    from transformers import Qwen3Config

    from verl_backend.driver.memory_fit import fit_packed_weights
    from verl_backend.rollout.native_kwargs import native_engine_kwargs

    Qwen3Config(**QWEN3_1_7B).save_pretrained(tmp_path)
    lora = {"actor_rollout_ref.model.lora_rank": 16, "actor_rollout_ref.model.target_modules": "all-linear"}
    config = _cpu_job(tmp_path, **lora)
    before = plan_memory(config, None, PROFILES["cpu"])
    assert before.host_phase == "generation" and before.host_need > HOST * USABLE_FRACTION, before.format()
    line = fit_packed_weights(config, PROFILES["cpu"], host_bytes=HOST)
    assert line is not None and "\n" not in line and "packed_weights=true keeps them" in line, line
    assert native_engine_kwargs(config.actor_rollout_ref.rollout).packed_weights is False
    after = plan_memory(config, None, PROFILES["cpu"])
    assert after.host_need <= HOST * USABLE_FRACTION and f"{after.host_need / GIB:.1f} GiB" in line
    # told to keep them: left as told (the job is then refused or not by check_memory_fits, not changed here)
    told = _cpu_job(tmp_path, **lora, **{"+actor_rollout_ref.rollout.engine_kwargs.native.packed_weights": "true"})
    assert fit_packed_weights(told, PROFILES["cpu"], host_bytes=HOST) is None
    assert native_engine_kwargs(told.actor_rollout_ref.rollout).packed_weights is True
    # a job that fits (0.6B-shaped full fine-tuning) keeps them
    Qwen3Config(**QWEN3_0_6B).save_pretrained(tmp_path / "small")
    small = _cpu_job(tmp_path / "small")
    assert fit_packed_weights(small, PROFILES["cpu"], host_bytes=HOST) is None
    assert native_engine_kwargs(small.actor_rollout_ref.rollout).packed_weights is None


def test_the_tpu_default_job_fits_a_v6e_chip_with_the_profiles_micro_batches(monkeypatch, tmp_path, default_model_dir):
    """``verl train --backend tpu`` with no ``--config`` is VeRL's own job (GAE, 1024 prompts) with the TPU profile's
    micro batches of 8 (``profiles.TPU_MICRO_KEYS``) and both compile flags on (``profiles.TPU_SETTINGS``): it fits a
    v6e chip, its log-prob forward 8 sequences. Negative control: with the micro batches unset the log-prob forward
    holds a worker's whole share (128 sequences) and the plan does not fit. A user's VeRL global micro batch replaces
    the profile's per-chip one (VeRL refuses both); a user's compile flag wins over the profile's."""
    from verl_backend.driver.profiles import TPU_MICRO_KEYS

    model = f"actor_rollout_ref.model.path={default_model_dir}"
    config, _ = _aot_config(monkeypatch, tmp_path / "a", [model])
    assert [OmegaConf.select(config, k) for k in TPU_MICRO_KEYS] == [8, 8, 8, 8]
    assert config.rl_tpu.compile_trainer and config.rl_tpu.compile_sampler
    plan = plan_memory(config, "v6e-8", TPU)
    assert plan.fits and plan.peak < 8 * GIB, plan.peak / GIB
    assert next(t.how for t in plan.terms if t.name == "log-prob forward").startswith("8 seqs")

    unset, _ = _aot_config(monkeypatch, tmp_path / "b", [model, *(f"{k}=null" for k in TPU_MICRO_KEYS)])
    control = plan_memory(unset, "v6e-8", TPU)
    assert not control.fits and control.term("log-prob forward") > 30 * GIB
    assert next(t.how for t in control.terms if t.name == "log-prob forward").startswith("128 seqs")

    given, _ = _aot_config(
        monkeypatch,
        tmp_path / "c",
        [model, "actor_rollout_ref.actor.ppo_micro_batch_size=16", "rl_tpu.compile_sampler=false"],
    )
    actor = given.actor_rollout_ref.actor
    assert actor.ppo_micro_batch_size == 16 and actor.ppo_micro_batch_size_per_gpu is None
    assert given.critic.ppo_micro_batch_size_per_gpu == 8  # the other sections keep the profile's
    assert given.rl_tpu.compile_trainer and not given.rl_tpu.compile_sampler


def test_a_lora_cpu_job_plans_the_rollouts_refill_from_the_model_files(tmp_path):
    """Adapter-only LoRA on CPU: the rollout server gives its shared-memory weights back while the actor updates and,
    woken, refills them from the model's safetensors and merges the adapter, with every page of the files mapped (the
    Qwen3-1.7B-shaped job, packed weights off, measured here at a 19.53 GiB peak: the server 5.09 GiB of file pages
    beside its 5.66 GiB of weights). The plan counts that third phase ("sync") at the files' size: 19.2 GiB, within
    15%; the update and generation phases alone said 15.5. Without shared-memory weights the merge still maps the
    files (their size an upper bound). Negative control: no LoRA, no such phase."""
    import dataclasses

    from transformers import Qwen3Config

    from verl_backend.driver.job_shape import job_settings_of

    Qwen3Config(**QWEN3_1_7B).save_pretrained(tmp_path)
    lora = {
        "actor_rollout_ref.model.lora_rank": 16,
        "actor_rollout_ref.model.target_modules": "all-linear",
        "+actor_rollout_ref.rollout.engine_kwargs.native.packed_weights": "false",
    }
    plan = plan_memory(_cpu_job(tmp_path, **lora), None, PROFILES["cpu"])
    [sync] = [t for t in plan.host_terms if t.when == "host sync"]
    assert sync.bytes == plan.model.params * 4  # no files here: the fp32 model's bytes stand in
    assert plan.host_phase == "sync" and abs(plan.host_need / (19.53 * GIB) - 1) <= 0.15, plan.host_need / GIB
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)  # with files, their size
    assert [
        t.bytes
        for t in plan_memory(_cpu_job(tmp_path, **lora), None, PROFILES["cpu"]).host_terms
        if t.when == "host sync"
    ] == [4096]
    full = plan_memory(_cpu_job(tmp_path), None, PROFILES["cpu"])
    assert not [t for t in full.host_terms if t.when == "host sync"] and full.host_phase != "sync"
    config = _cpu_job(tmp_path, **lora)
    unshared = dataclasses.replace(job_settings_of(config), shared_weights=False)
    assert [
        t.bytes
        for t in plan_memory(config, None, PROFILES["cpu"], settings=unshared).host_terms
        if t.when == "host sync"
    ] == [4096]


def test_the_tpu_profiles_micro_batches_yield_to_the_users_and_fit_the_ranks(
    monkeypatch, tmp_path, default_model_dir, capsys
):
    """The TPU profile's micro batches of 8 under what the user says: a VeRL global micro batch with a value replaces
    the per-chip key (a ``null`` one does not: VeRL's own YAML lists them null), and the plan reads the global one
    split over the ranks (it counted a worker's whole share, 41 GiB, and refused the job); a fitted value divides the
    share check_batch_sizes counts (data-parallel ranks under Ulysses), and is said to come from the TPU profile;
    keys VeRL does not read (dynamic batch sizes, the critic without GAE) are left alone."""
    from verl_backend.driver.plan import drop_replaced_micro_batches
    from verl_backend.driver.profiles import TPU_MICRO_KEYS

    actor = "actor_rollout_ref.actor.ppo_micro_batch_size"
    kept = drop_replaced_micro_batches({f"{actor}_per_gpu": "8"}, {actor: "null"})
    assert kept == {f"{actor}_per_gpu": "8"}
    assert drop_replaced_micro_batches({f"{actor}_per_gpu": "8"}, {actor: "64"}) == {}

    model = f"actor_rollout_ref.model.path={default_model_dir}"
    grpo = "algorithm.adv_estimator=grpo"
    globals_ = [
        f"{actor}=64",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=64",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=64",
    ]
    config, _ = _aot_config(monkeypatch, tmp_path / "a", [model, grpo, *globals_])
    plan = plan_memory(config, "v6e-8", TPU)
    assert plan.fits and next(t.how for t in plan.terms if t.name == "log-prob forward").startswith("8 seqs")

    capsys.readouterr()
    sp = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
    small = ["data.train_batch_size=24", "actor_rollout_ref.actor.ppo_mini_batch_size=20", sp]
    config, _ = _aot_config(monkeypatch, tmp_path / "b", [model, grpo, *small])
    out = capsys.readouterr().out
    assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 1  # 20 / 4 ranks = 5 a rank
    assert f"{actor}_per_gpu lowered from 8 (the TPU profile's default) to 1: each of the 4 data-parallel ranks" in out
    assert "critic.ppo_micro_batch_size_per_gpu lowered" not in out  # GRPO: no critic
    dynamic = [
        "data.train_batch_size=48",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
    ]
    config, _ = _aot_config(monkeypatch, tmp_path / "c", [model, grpo, *dynamic])
    # VeRL reads no micro batch under dynamic batch sizes (its log-prob ones follow the actor's): all left at 8,
    # though 8 does not divide the 6 sequences a worker scores
    assert [OmegaConf.select(config, k) for k in TPU_MICRO_KEYS[:3]] == [8, 8, 8]


# Gemma 3 270M (the converted checkpoint's config.json): 262,144 tokens of vocabulary, tied
GEMMA3_270M = {
    "vocab_size": 262_144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("chunk_mib", [128, 32, 0])
def test_the_plan_counts_one_chunk_of_the_lm_head_where_the_engine_chunks_it(tmp_path, chunk_mib):
    """Gemma 3's default-job micro batches (4 sequences a update, 8 a log-prob pass, 64 response tokens): 256 and 512
    response tokens of 262,144-wide fp32 logits, 256 and 512 MiB, past a 128 MiB budget; the plan counts one chunk
    (128 or 32 tokens), and with ``rl_tpu.logits_chunk_mib=0`` the whole logits, as before."""
    from transformers import Gemma3TextConfig

    from verl_backend.settings import resolve

    Gemma3TextConfig(**GEMMA3_270M).save_pretrained(tmp_path)
    config = _cpu_job(tmp_path, **{"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8})
    settings = resolve(cli={"logits_chunk_mib": str(chunk_mib)}, file={}, environ={})
    plan = plan_memory(config, None, PROFILES["cpu"], settings=settings)
    vocab = GEMMA3_270M["vocab_size"]
    head = next(t for t in plan.terms if t.name.startswith("LM head logits"))
    log_prob = next(t for t in plan.terms if t.name.startswith("log-prob forward"))
    if chunk_mib:
        chunk = (chunk_mib << 20) // (4 * vocab)
        assert head.name == "LM head logits (chunked)" and head.bytes == chunk * vocab * (4 + 16), head
        assert f"a {chunk}-token chunk" in log_prob.how
    else:
        assert head.name == "LM head logits" and head.bytes == 256 * vocab * (4 + 8), head
        assert log_prob.bytes >= 512 * vocab * (4 + 4)
