"""``verl train --aot-only``'s machinery: TorchTPU lowers each graph kind of a tiny Qwen3 job to StableHLO and libtpu
compiles it for v5e and v6e with no chip; an op TorchTPU cannot lower, and a chip libtpu does not know, are one line
each; torch-tpu stays out of the CPU job's interpreter. One lowering subprocess, one compile subprocess per topology.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from verl_backend.driver.aot import run as aot_run
from verl_backend.driver.aot.graphs import GraphRequest, job_graphs

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    attention_dropout=0.0,
)
REQUESTS = [
    GraphRequest("block", 2, 16),
    GraphRequest("lm_head", 2, 16),
    GraphRequest("prefill", 2, 16, 48),
    GraphRequest("decode", 2, 1, 48),
    GraphRequest("block_forward", 2, 16),
    GraphRequest("lm_head_forward", 2, 16),
    GraphRequest("value_head", 2, 16),
    GraphRequest("value_head_forward", 2, 16),
]
KINDS = {
    "trainer.block[2x16].fwd",
    "trainer.block[2x16].bwd",
    "trainer.lm_head[2x16].fwd",
    "trainer.lm_head[2x16].bwd",
    "sampler.prefill[2x16|cache 48]",
    "sampler.decode[2x1|cache 48]",
    # the no-grad log-prob forward (old policy, reference policy) and the critic's value head
    "trainer.block_forward[2x16]",
    "trainer.lm_head_forward[2x16]",
    "critic.value_head[2x16].fwd",
    "critic.value_head[2x16].bwd",
    "critic.value_head_forward[2x16]",
}


def _aot_python():
    try:
        return aot_run.aot_python()
    except aot_run.AotError as exc:
        pytest.skip(f"torch-tpu is not installed: {exc}")


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    python = _aot_python()
    graphs = [dataclasses.asdict(r) for r in REQUESTS]
    jobs = [
        {
            "label": "qwen3",
            "config": TINY,
            "model_type": "qwen3",
            "dtype": "float32",
            "attention": "sdpa",
            "graphs": graphs,
        },
        # negative control: attention dropout in training mode draws random numbers, which need the TPU's
        # generator (no chip): the block's forward must fail in one line naming the op
        {
            "label": "dropout",
            "config": {**TINY, "attention_dropout": 0.5},
            "model_type": "qwen3",
            "dtype": "float32",
            "attention": "eager",
            "train_mode": True,
            "graphs": graphs[:1],
        },
        # numerics: every graph kind again with math attention (no Mosaic) and real random weights, run on
        # XLA:CPU against torch eager; the control lowers a prefill traced with a wrong rsqrt decomposition
        {
            "label": "numerics",
            "config": TINY,
            "model_type": "qwen3",
            "dtype": "float32",
            "attention": "eager",
            "numerics": {},
            "graphs": graphs,
        },
        {
            "label": "wrong",
            "config": TINY,
            "model_type": "qwen3",
            "dtype": "float32",
            "attention": "eager",
            "numerics": {"wrong": "rsqrt"},
            "graphs": graphs[2:3],
        },
    ]
    return aot_run.lower_and_compile(
        jobs,
        ["v6e:2x2", "v5e:2x2", "v7x:2x2x1", "cpu"],
        tmp_path_factory.mktemp("aot"),
        python=python,
        lower_timeout_s=600,
        compile_timeout_s=300,
    )


def test_every_graph_kind_lowers_and_compiles_for_v5e_and_v6e(aot):
    lowered = {r["graph"] for r in aot.lowered if r["label"] == "qwen3" and not r["error"]}
    assert lowered == KINDS
    for topo in ("v6e:2x2", "v5e:2x2"):
        result = aot.compiled[topo]
        assert result["error"] is None
        rows = {g["graph"]: g for g in result["graphs"] if g["label"] == "qwen3"}
        assert set(rows) == KINDS
        for name, g in rows.items():
            assert g["error"] is None, g["error"]
            assert g["flops"] > 0 and g["argument_bytes"] > 0 and g["generated_code_bytes"] > 0, name
        # the backward does about twice the forward's matmul work
        fwd, bwd = rows["trainer.block[2x16].fwd"], rows["trainer.block[2x16].bwd"]
        assert 1.3 < bwd["flops"] / fwd["flops"] < 3.5
        # a decode step (2 tokens) does far less work than a prefill (32 tokens)
        assert rows["sampler.decode[2x1|cache 48]"]["flops"] < rows["sampler.prefill[2x16|cache 48]"]["flops"] / 4
        # the no-grad forward keeps nothing for a backward: it returns the block's output alone, far less than the
        # update's forward (its saved tensors, inputs and parameters)
        nograd = rows["trainer.block_forward[2x16]"]
        assert nograd["output_bytes"] < fwd["output_bytes"] / 4
        assert 0.8 < nograd["flops"] / fwd["flops"] < 1.25
        # the critic's head is one output a token: far less work than the LM head's 256-way one
        assert rows["critic.value_head[2x16].fwd"]["flops"] < rows["trainer.lm_head[2x16].fwd"]["flops"] / 20
    assert {g["device_kind"] for g in (aot.compiled["v6e:2x2"], aot.compiled["v5e:2x2"])} == {
        "TPU v6 lite",
        "TPU v5 lite",
    }
    ours = {
        **aot.compiled["v6e:2x2"],
        "graphs": [g for g in aot.compiled["v6e:2x2"]["graphs"] if g["label"] == "qwen3"],
    }
    table = aot_run.table(ours, "v6e")
    assert len(table.splitlines()) == 2 + len(KINDS)  # header, rule, a row per graph


def test_the_plans_arrays_of_each_graph_are_xlas_for_v5e_and_v6e(aot):
    """What the memory plan says each compiled graph holds (``ModelShape.block_graph``, ``head_graph``,
    ``sampler_graph``: arrays from the model's shapes, each sized by ``tpu_bytes``) against XLA's compile of the tiny
    Qwen3 in fp32, whose 64- and 16-wide minor dimensions all pad: arguments and outputs within 2%, and XLA's own
    per-array sizes (``compile.py``'s ``arguments``/``outputs``, from the layouts it chose) add up to its totals.
    Negative control: the same arrays counted dense miss XLA's numbers by more than 15%."""
    from transformers import Qwen3Config

    from verl_backend.driver.model_shape import arrays_bytes, model_shape

    shape = model_shape(Qwen3Config(**TINY))
    g, h = shape.block_graph(2, 16, 4), shape.head_graph(2, 16, 4)
    pre, dec = shape.sampler_graph(2, 16, 48, 4), shape.sampler_graph(2, 1, 48, 4)
    planned = {  # graph: (arguments, outputs)
        "trainer.block[2x16].fwd": (g["arguments"], g["saved"] + g["returned"]),
        # a backward takes what its forward returned, the gradient of the forward's output standing in for it
        "trainer.block[2x16].bwd": (g["saved"] + g["returned"], g["gradients"]),
        "trainer.lm_head[2x16].fwd": (h["arguments"], h["saved"] + h["returned"]),
        "trainer.lm_head[2x16].bwd": (h["saved"] + h["returned"], h["gradients"]),
        "sampler.prefill[2x16|cache 48]": (pre["arguments"], pre["outputs"]),
        "sampler.decode[2x1|cache 48]": (dec["arguments"], dec["outputs"]),
    }
    dense = lambda arrays: sum(math.prod(s) * b for _, s, b in arrays)  # noqa: E731
    missed = []
    for topo in ("v6e:2x2", "v5e:2x2"):
        rows = {r["graph"]: r for r in aot.compiled[topo]["graphs"] if r["label"] == "qwen3"}
        for name, (args, outs) in planned.items():
            r = rows[name]
            for arrays, total in ((r["arguments"], r["argument_bytes"]), (r["outputs"], r["output_bytes"])):
                assert total - 64 * len(arrays) - 512 <= sum(a[2] for a in arrays) <= total, (topo, name)
            for mine, xla, what in ((args, r["argument_bytes"], "arguments"), (outs, r["output_bytes"], "outputs")):
                assert arrays_bytes(mine) == pytest.approx(xla, rel=0.02), (topo, name, what)
                if abs(dense(mine) / xla - 1) > 0.15:
                    missed.append((topo, name, what))
    assert len(missed) >= 6, missed  # the control: without tiling the plan would miss most graphs


def test_an_op_that_cannot_lower_is_one_line(aot):
    [failed] = [r for r in aot.lowered if r["label"] == "dropout" and r["error"]]
    assert failed["graph"] == "trainer.block[2x16].fwd" and "\n" not in failed["error"]
    assert failed["error"].startswith("TorchTPU cannot lower aten.native_dropout.default in ")
    assert "Qwen3Attention" in failed["error"] and "of graph trainer.block[2x16].fwd" in failed["error"]
    assert "random" in failed["error"]  # says why: the TPU generator needs a chip


def test_a_chip_libtpu_does_not_know_is_one_line(aot):
    refused = aot.compiled["v7x:2x2x1"]
    assert refused["graphs"] == [] and refused["error"].startswith("libtpu cannot compile for v7x:2x2x1")
    assert "\n" not in refused["error"]
    assert refused["error"] in aot_run.errors(aot)


def test_torch_tpu_is_not_loaded_by_import_torch_in_the_cpu_interpreter():
    python = _aot_python()
    probe = "import torch, sys; print('torch_tpu' in sys.modules)"
    here = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert here.stdout.strip() == "False", here.stderr[-500:]
    if python != sys.executable:  # negative control: where torch-tpu is installed, import torch loads it
        there = subprocess.run(
            [python, "-c", probe],
            capture_output=True,
            text=True,
            timeout=180,
            env={**aot_run._env(), "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"},
        )
        assert there.stdout.strip() == "True", there.stderr[-500:]
        assert find_spec("torch_tpu") is None  # kept out of this (the README's) environment


def test_aot_only_is_refused_off_the_tpu_backend(capsys):
    from verl_backend.driver.cli import main

    assert main(["train", "--backend", "cpu", "--aot-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["verl: error: --aot-only compiles a TPU job's graphs: use --backend tpu, not cpu"]


def test_a_lowering_subprocess_dies_with_verl(tmp_path):
    """The lowering and compile subprocesses have sessions of their own (a TorchTPU crash must not signal verl), so
    a `timeout` that ended verl left them lowering for minutes. Now they die with it: verl (here a parent running
    the same _run) is killed while its child sleeps, and the child is gone by the deadline."""
    import os
    import signal
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = (
        "import os, sys; from pathlib import Path; from verl_backend.driver.aot.run import _run; "
        f"_run([sys.executable, '-c', {child!r}], 'a child', 300, Path({str(tmp_path / 'log')!r}), "
        "dict(os.environ))"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child_pid = int(pid_file.read_text())
    os.kill(child_pid, 0)  # alive while its parent is
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child_pid, signal.SIGKILL)
        pytest.fail(f"the child {child_pid} outlived its parent")


def test_slice_names_map_to_libtpu_topologies():
    assert aot_run.jax_topology("v6e-8") == ("v6e:2x4", "v6e", 32)
    assert aot_run.jax_topology("v6e-8:2x4")[0] == "v6e:2x4"
    assert aot_run.jax_topology("v5litepod-4")[0] == "v5e:2x2"


def test_job_graphs_follow_the_config():
    config = {
        "data": {"max_prompt_length": 100, "max_response_length": 200, "train_batch_size": 8},
        "actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 2}, "rollout": {"n": 4, "max_num_seqs": 64}},
    }
    graphs = job_graphs(config, workers=4)
    assert graphs[0] == GraphRequest("block", 2, 512) and graphs[1] == GraphRequest("lm_head", 2, 512)
    # the old policy's log-probs are recomputed (no bypass); with no log-prob micro batch set (VeRL refuses that), at
    # a worker's whole share of the step (8 x 4 over 4 workers), as the memory plan counts it (JobShape)
    assert graphs[2:4] == [GraphRequest("block_forward", 8, 512), GraphRequest("lm_head_forward", 8, 512)]
    assert graphs[4] == GraphRequest("prefill", 8, 100, 300)  # 8x4 rows over 4 workers; the rollout's 100 + 200
    assert [g.batch for g in graphs if g.kind == "decode"] == [8, 4, 2, 1]
    # bypass mode reuses the rollout's log-probs: no forward graph; a KL loss brings the reference's, at its micro
    # batch; GAE the critic's update and values forward (a block shape the actor has is listed once)
    config["algorithm"] = {"rollout_correction": {"bypass_mode": True}}
    assert not [g for g in job_graphs(config, 4) if g.kind.endswith("_forward")]
    config["actor_rollout_ref"]["actor"]["use_kl_loss"] = True
    config["actor_rollout_ref"]["ref"] = {"log_prob_micro_batch_size_per_gpu": 4}
    assert [g for g in job_graphs(config, 4) if g.kind.endswith("_forward")] == [
        GraphRequest("block_forward", 4, 512),
        GraphRequest("lm_head_forward", 4, 512),
    ]
    config["algorithm"]["adv_estimator"] = "gae"
    config["critic"] = {"ppo_micro_batch_size_per_gpu": 2, "forward_micro_batch_size_per_gpu": 4}
    critic = [g for g in job_graphs(config, 4) if g.kind not in ("prefill", "decode")]
    assert critic == [
        GraphRequest("block", 2, 512),
        GraphRequest("lm_head", 2, 512),
        GraphRequest("block_forward", 4, 512),
        GraphRequest("lm_head_forward", 4, 512),
        GraphRequest("value_head", 2, 512),
        GraphRequest("value_head_forward", 4, 512),
    ]
    assert critic[4].name == "critic.value_head[2x512]"
    config["critic"]["enable"] = False  # the control: no critic, no value head
    assert not [g for g in job_graphs(config, 4) if g.kind.startswith("value_head")]


def test_patch_record_pins_torch_tpu():
    from verl_backend.patches.torch_tpu_aot import PATCH

    assert PATCH.supports("0.2.0") and not PATCH.supports("0.2.1")
    assert PATCH.refusal("0.3.0") == (
        "torch-tpu 0.3.0 is outside the tested range ==0.2.0 of rl-tpu's patch "
        "torch_tpu._internal.export.export.fx_to_mlir; install torch-tpu==0.2.0"
    )


def test_numerics_every_graph_kind_matches_torch_eager_on_xla_cpu(aot):
    from verl_backend.driver.aot.compile import RTOL

    rows = {g["graph"]: g for g in aot.compiled["cpu"]["graphs"] if g["label"] == "numerics"}
    assert set(rows) == KINDS  # which graph kinds were compared: all eleven graphs of the eight kinds
    for name, g in rows.items():
        assert g["error"] is None, g["error"]
        assert g["ok"] and g["max_abs_diff"] <= RTOL * g["max_abs_ref"], (name, g)
        assert g["max_abs_ref"] > 1  # real numbers, not zeros
    [control] = [g for g in aot.compiled["cpu"]["graphs"] if g["label"] == "wrong"]
    assert control["error"] is None and not control["ok"]  # negative control: a wrong rsqrt is caught
    assert control["max_abs_diff"] > 100 * RTOL * control["max_abs_ref"]


#: families beyond tests/families.py that the TPU path must take too: a dense-first mixture of experts (two kinds of
#: block), Mixtral and Qwen2-MoE (shared expert), SmolLM3 (blocks without RoPE)
EXTRA_FAMILIES = {
    "qwen3_moe_dense_first": (
        "qwen3_moe",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
            "num_hidden_layers": 3,
        },
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
}


#: the extra families CI compiles (the two kinds of block that are new: dense beside MoE, a block without RoPE);
#: Mixtral and Qwen2-MoE add no kind of block and 4-5 minutes of CI on 2 cores: RL_TPU_AOT_ALL_FAMILIES=1 runs them
#: too (docs/tpu.md's table has all 11)
CI_EXTRA_FAMILIES = ("qwen3_moe_dense_first", "smollm3")


def family_configs() -> dict[str, tuple[str, dict]]:
    """Every family of tests/families.py and :data:`CI_EXTRA_FAMILIES` (all of :data:`EXTRA_FAMILIES` with
    ``RL_TPU_AOT_ALL_FAMILIES=1``): name -> (model_type, config.json dict)."""
    import transformers

    from families import FAMILIES

    out = {}
    for family, (config_class, _, extra) in FAMILIES.items():
        out[family] = (
            getattr(transformers, config_class).model_type,
            {**{k: v for k, v in TINY.items() if k != "head_dim"}, **extra},
        )
    for family, (model_type, extra) in EXTRA_FAMILIES.items():
        if family in CI_EXTRA_FAMILIES or os.environ.get("RL_TPU_AOT_ALL_FAMILIES") == "1":
            out[family] = (model_type, {**{k: v for k, v in TINY.items() if k != "head_dim"}, **extra})
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    python = _aot_python()
    compiled = [dataclasses.asdict(r) for r in (GraphRequest("block", 2, 16), GraphRequest("decode", 2, 1, 48))]
    numerics = compiled  # a prefill runs the decode step's code at more tokens: test_aot_blocks.py runs one
    jobs = []
    for family, (model_type, config) in family_configs().items():
        jobs.append(
            {
                "label": family,
                "config": config,
                "model_type": model_type,
                "dtype": "bfloat16",
                "attention": "sdpa",
                "graphs": compiled,
            }
        )
        jobs.append(
            {
                "label": f"{family}/numerics",
                "config": config,
                "model_type": model_type,
                "dtype": "float32",
                "attention": "eager",
                "numerics": {},
                "graphs": numerics,
            }
        )
    # v6e only here (v5e compiles the same graphs in the other fixtures; docs/tpu.md's table has both): CI time
    return aot_run.lower_and_compile(
        jobs,
        ["v6e:2x2", "cpu"],
        tmp_path_factory.mktemp("families"),
        python=python,
        lower_timeout_s=1800,
        compile_timeout_s=1200,
    )


@pytest.mark.slow
def test_every_family_compiles_for_v6e_and_runs_on_xla_cpu_equal_to_eager(families):
    """Every family of tests/families.py (Llama, Qwen2 with and without a sliding layer, Qwen3, Mistral, Gemma3,
    Qwen3-MoE) and :data:`EXTRA_FAMILIES`: each kind of block's forward and backward and a whole-model decode step,
    in bf16, lowered by TorchTPU and compiled for v6e; in fp32 with math attention, the same graphs run on XLA:CPU
    equal to torch eager. The mixtures of experts run transformers' batched_mm experts (the TPU job's); their
    default grouped_mm is refused naming chlo.scan (test_aot_blocks.py, the control). 1 passed in 842 s with v5e and
    a prefill too, on this shared 2-core machine beside other tests."""
    from verl_backend.driver.aot.compile import RTOL

    failed = aot_run.errors(families)
    assert failed == [], failed
    for family in family_configs():
        lowered = [r for r in families.lowered if r["label"] == family]
        kinds = {r["block"] for r in lowered if r["kind"] == "block"}
        assert len(lowered) == 2 * len(kinds) + 1, (family, [r["graph"] for r in lowered])
        rows = [g for g in families.compiled["v6e:2x2"]["graphs"] if g["label"] == family]
        assert len(rows) == len(lowered) and all(g["flops"] > 0 for g in rows), family
        checked = [g for g in families.compiled["cpu"]["graphs"] if g["label"] == f"{family}/numerics"]
        assert len(checked) == len(lowered), family
        for g in checked:
            assert g["ok"] and g["max_abs_diff"] <= RTOL * g["max_abs_ref"], (family, g)
    # two kinds of block where the model has them
    kinds = {
        f: {r["block"] for r in families.lowered if r["label"] == f and r["kind"] == "block"}
        for f in ("gemma3", "qwen2_sliding", "qwen3_moe_dense_first", "smollm3", "llama")
    }
    assert kinds == {
        "gemma3": {"sliding", "full"},
        "qwen2_sliding": {"full", "sliding"},
        "qwen3_moe_dense_first": {"dense", "moe"},
        "smollm3": {"rope", "norope"},
        "llama": {""},
    }


# One CHLO op a module, as TorchTPU 0.2.0 writes them (from Qwen3-MoE's lowered block forward): which of the ops in
# Qwen3-MoE's failing graphs libtpu's plugin refuses. main's argument is tensor<4x8xf32> or, for the scan,
# tensor<4xi32>.
_CHLO_MODULES = {
    "chlo.scan": (
        "tensor<4xi32>",
        "tensor<4xi32>",
        """%c = stablehlo.constant dense<0> : tensor<i32>
    %0:2 = chlo.scan(%arg0) inits (%c) dimension=0  attributes {is_associative = true, is_reverse = false, """
        """scan_dim_size = 4 : i64} {
    ^bb0(%input: tensor<i32>, %carry: tensor<i32>):
      %1 = stablehlo.add %input, %carry : tensor<i32>
      stablehlo.return %1, %1 : tensor<i32>, tensor<i32>
    } : (tensor<4xi32>, tensor<i32>) -> (tensor<4xi32>, tensor<i32>)
    return %0#0 : tensor<4xi32>""",
    ),
    "chlo.top_k": (
        "tensor<4x8xf32>",
        "tensor<4x2xf32>",
        """%0:2 = chlo.top_k(%arg0, k = 2, is_stable = false) : tensor<4x8xf32> -> (tensor<4x2xf32>, tensor<4x2xi32>)
    return %0#0 : tensor<4x2xf32>""",
    ),
    "chlo.is_neg_inf": (
        "tensor<4x8xf32>",
        "tensor<4x8xi1>",
        """%0 = chlo.is_neg_inf %arg0 : tensor<4x8xf32> -> tensor<4x8xi1>
    return %0 : tensor<4x8xi1>""",
    ),
    "chlo.ragged_dot": (
        "tensor<4x8xf32>",
        "tensor<4x8xf32>",
        """%w = stablehlo.constant dense<1.0> : tensor<2x8x8xf32>
    %g = stablehlo.constant dense<2> : tensor<2xi32>
    %0 = "chlo.ragged_dot"(%arg0, %w, %g) <{precision_config = [#chlo<precision DEFAULT>, #chlo<precision DEFAULT>], """
        "ragged_dot_dimension_numbers = #chlo.ragged_dot<lhs_contracting_dimensions = [1], "
        "rhs_contracting_dimensions = [1], lhs_ragged_dimensions = [0], rhs_group_dimensions = [0]>}> "
        """: (tensor<4x8xf32>, tensor<2x8x8xf32>, tensor<2xi32>) -> tensor<4x8xf32>
    return %0 : tensor<4x8xf32>""",
    ),
}


def test_which_chlo_op_libtpu_refuses(tmp_path):
    """Qwen3-MoE's forward and decode hold four CHLO ops; compiled one a module for v6e, only ``chlo.scan`` (TorchTPU's
    ``torch.cumsum``) is refused, and the error names it and the torch op in one line; the other three compile (the
    control: the refusal is the op's, not any CHLO's)."""
    python = _aot_python()
    records = []
    for i, (op, (arg, ret, body)) in enumerate(_CHLO_MODULES.items()):
        path = tmp_path / f"{i}.mlir"
        path.write_text(f"module {{\n  func.func public @main(%arg0: {arg}) -> {ret} {{\n    {body}\n  }}\n}}\n")
        records.append({"graph": op, "label": "chlo", "kind": "probe", "file": str(path)})
    (tmp_path / "lowered.json").write_text(json.dumps(records))
    out = tmp_path / "compiled.json"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPU_SKIP_MDS_QUERY": "1"}
    proc = subprocess.run(
        [python, "-m", "verl_backend.driver.aot.compile", str(tmp_path / "lowered.json"), "v6e:2x2", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {g["graph"]: g for g in json.loads(out.read_text())["graphs"]}
    assert set(rows) == set(_CHLO_MODULES)
    scan = rows.pop("chlo.scan")["error"]
    assert scan and "\n" not in scan and "its chlo.scan, TorchTPU's lowering of torch.cumsum" in scan, scan
    assert all(g["error"] is None for g in rows.values()), rows
