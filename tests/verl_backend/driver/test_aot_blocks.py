"""Every kind of block on the TPU path (issue #43 item 4): a mixture of experts compiles for v5e and v6e and runs on
XLA:CPU equal to torch eager with transformers' ``batched_mm`` experts (the TPU job's, ``rl_tpu.expert_slices``),
while its default ``grouped_mm`` (``torch.cumsum`` -> ``chlo.scan``) is refused in one line naming the op; a model
whose first block is dense and the others MoE gets a graph for each kind of block; a failure several graphs share is
one line. The lowering tests skip where ``.venv-aot`` (torch-tpu) is missing, as ``test_aot.py``'s do.
"""

from __future__ import annotations

import dataclasses

import pytest

from verl_backend.driver.aot import run as aot_run
from verl_backend.driver.aot.graphs import GraphRequest

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    attention_dropout=0.0,
)
#: Qwen3-MoE whose first block is dense (``mlp_only_layers=[0]``) and the other two MoE: 4 experts, 2 a token
DENSE_FIRST_MOE = {
    **TINY,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}
BLOCKS = {
    "trainer.block[2x16|dense].fwd",
    "trainer.block[2x16|dense].bwd",
    "trainer.block[2x16|moe].fwd",
    "trainer.block[2x16|moe].bwd",
}
DECODE = "sampler.decode[2x1|cache 48]"


def _graphs(*requests):
    return [dataclasses.asdict(r) for r in requests]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    try:
        python = aot_run.aot_python()
    except aot_run.AotError as exc:
        pytest.skip(f"torch-tpu is not installed: {exc}")
    block, decode = GraphRequest("block", 2, 16), GraphRequest("decode", 2, 1, 48)
    base = {"config": DENSE_FIRST_MOE, "model_type": "qwen3_moe"}
    jobs = [  # the TPU job's experts (batched_mm, the default here), bf16 as the job trains
        {**base, "label": "moe", "dtype": "bfloat16", "attention": "sdpa", "graphs": _graphs(block, decode)},
        # negative control: transformers' default experts, grouped_mm (torch.cumsum -> chlo.scan)
        {
            **base,
            "label": "grouped_mm",
            "dtype": "bfloat16",
            "attention": "sdpa",
            "experts": "grouped_mm",
            "graphs": _graphs(block, decode),
        },
        # XLA:CPU against torch eager: fp32, math attention, real random weights
        {
            **base,
            "label": "numerics",
            "dtype": "float32",
            "attention": "eager",
            "numerics": {},
            "graphs": _graphs(block, GraphRequest("prefill", 2, 16, 48), decode),
        },
    ]
    return aot_run.lower_and_compile(
        jobs,
        ["v6e:2x2", "v5e:2x2", "cpu"],
        tmp_path_factory.mktemp("moe"),
        python=python,
        lower_timeout_s=600,
        compile_timeout_s=600,
    )


def _rows(result, topo, label):
    return {g["graph"]: g for g in result.compiled[topo]["graphs"] if g["label"] == label}


def test_a_dense_first_moe_model_gets_a_graph_for_each_kind_of_block(moe):
    """The dense block (layer 0) and the MoE blocks (layers 1-2) are traced apart, each named by its kind and
    counted (``block_layers``); before, only ``layers[0]`` (dense) was, so the experts never met the compiler."""
    lowered = {r["graph"]: r for r in moe.lowered if r["label"] == "moe"}
    assert set(lowered) == BLOCKS | {DECODE}
    assert all(r["error"] is None for r in lowered.values()), [r["error"] for r in lowered.values()]
    assert lowered["trainer.block[2x16|dense].fwd"]["block_layers"] == 1
    assert lowered["trainer.block[2x16|moe].fwd"]["block_layers"] == 2
    for topo in ("v6e:2x2", "v5e:2x2"):
        rows = _rows(moe, topo, "moe")
        assert set(rows) == BLOCKS | {DECODE}
        for name, g in rows.items():
            assert g["error"] is None and g["flops"] > 0, (topo, name, g["error"])
        # the MoE block is another program than the dense one: the router and the gathered experts
        assert rows["trainer.block[2x16|moe].fwd"]["flops"] != rows["trainer.block[2x16|dense].fwd"]["flops"]


def test_moe_with_batched_mm_runs_on_xla_cpu_equal_to_torch_eager(moe):
    from verl_backend.driver.aot.compile import RTOL

    rows = _rows(moe, "cpu", "numerics")
    assert set(rows) == BLOCKS | {DECODE, "sampler.prefill[2x16|cache 48]"}
    for name, g in rows.items():
        assert g["error"] is None, g["error"]
        assert g["ok"] and g["max_abs_diff"] <= RTOL * g["max_abs_ref"] and g["max_abs_ref"] > 1, (name, g)


def test_without_batched_mm_moe_is_refused_in_one_line_naming_chlo_scan(moe):
    """The control: transformers' default experts lower (their chlo.scan too) but libtpu refuses every graph that
    holds an MoE block's forward, naming the op; the dense block and the MoE backward (no scan) compile. The four
    refusals share one cause: ``errors`` says it once."""
    for topo in ("v6e:2x2", "v5e:2x2"):
        rows = _rows(moe, topo, "grouped_mm")
        refused = {name for name, g in rows.items() if g["error"]}
        assert refused == {"trainer.block[2x16|moe].fwd", DECODE}, (topo, refused)
        for name in refused:
            error = rows[name]["error"]
            assert "\n" not in error and "its chlo.scan, TorchTPU's lowering of torch.cumsum" in error, error
    lines = [ln for ln in aot_run.errors(moe) if "chlo.scan" in ln]
    assert len(lines) == 2, lines  # one per topology, each naming the other graph it stopped
    assert all("(also 1 more graph: " in ln for ln in lines), lines


def test_a_failure_several_graphs_share_is_one_line():
    """``errors`` keeps one line per cause: the same op and module failing in a prefill and three decode buckets is
    the first graph's line and the count of the others; a different cause keeps its own line (the control)."""

    def row(graph, op="aten.cumsum.default"):
        return {
            "graph": graph,
            "label": "x",
            "error": f"TorchTPU cannot lower {op} in model.layers.1.mlp (Moe) of graph {graph}: no lowering",
        }

    graphs = ["sampler.prefill[4x16|cache 48]"] + [f"sampler.decode[{b}x1|cache 48]" for b in (4, 2, 1)]
    result = aot_run.AotResult(
        [row(g) for g in graphs] + [row("trainer.block[2x16].fwd", "aten.sort.default")], {}, None
    )
    lines = aot_run.errors(result)
    assert lines == [
        row(graphs[0])["error"] + " (also 3 more graphs: sampler.decode[4x1|cache 48], "
        "sampler.decode[2x1|cache 48], ...)",
        row("trainer.block[2x16].fwd", "aten.sort.default")["error"],
    ]


def test_a_tracing_failure_names_the_op_and_the_module():
    """A dynamo failure's message names neither op nor module in its first line (``IndexError: Dimension out of
    range``, the control); :func:`tracing_failure` finds both in the user code it quotes."""
    import torch

    from verl_backend.driver.aot.lower import tracing_failure

    class Experts(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=5)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

        def forward(self, x):
            return self.experts(x) + 1

    torch.compiler.reset()
    with pytest.raises(Exception) as caught:
        torch.compile(Block(), backend="aot_eager", fullgraph=True)(torch.zeros(2, 3, device="meta"))
    first = str(caught.value).strip().splitlines()[0]
    assert "cumsum" not in first and "Experts" not in first  # the control
    op, where, why = tracing_failure(caught.value)
    assert op == "torch.cumsum" and where.startswith("Experts (test_aot_blocks.py:"), (op, where)
    assert "\n" not in why and why.startswith("IndexError")


def test_block_kinds_of_the_families():
    """Which blocks get graphs of their own: dense against MoE (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``), sliding against full attention (Gemma3, Qwen2 with ``max_window_layers``); a model of
    one kind keeps its plain graph names (label ``""``)."""
    import torch

    from verl_backend.driver.aot.lower import block_kinds, build_model

    def kinds(model_type, **config):
        model = build_model({**TINY, **config}, model_type, torch.bfloat16, "sdpa")
        return [(k["label"], k["layer"], k["layers"]) for k in block_kinds(model)]

    moe = {k: DENSE_FIRST_MOE[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    assert kinds("qwen3_moe", **moe, mlp_only_layers=[0]) == [("dense", 0, 1), ("moe", 1, 2)]
    assert kinds("qwen3_moe", **moe, decoder_sparse_step=2, num_hidden_layers=4) == [("dense", 0, 2), ("moe", 1, 2)]
    assert kinds("qwen3_moe", **moe, mlp_only_layers=[]) == [("", 0, 3)]  # all MoE: one kind
    assert kinds(
        "gemma3_text",
        sliding_window=5,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ) == [("sliding", 0, 2), ("full", 1, 1)]
    assert kinds("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1) == [
        ("full", 0, 1),
        ("sliding", 1, 2),
    ]
    assert kinds("llama") == [("", 0, 3)]


def test_the_tpu_job_builds_its_moe_with_batched_mm(tmp_path):
    """The chip job, not only the lowering: VeRL's engine loads the model's config, sets the ``override_config`` keys
    on it (``update_model_config``) and builds the model with ``from_pretrained(config=...)``; with the TPU profile's
    keys (actor, reference and critic) the experts run ``batched_mm``, and the sampler on a ``tpu`` device asks for
    the same. The control: the CPU profile sets no experts key, and transformers builds its default ``grouped_mm``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from verl.utils.model import update_model_config

    from rl_tpu.expert_slices import has_fused_experts, tpu_experts_kwargs
    from rl_tpu.patches.transformers_internals import experts_implementation
    from verl_backend.driver.profiles import profile

    config = {k: v for k, v in DENSE_FIRST_MOE.items() if k != "attention_dropout"}
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).save_pretrained(tmp_path)

    def built(backend: str, model: str = "actor_rollout_ref.model"):
        prefix = f"+{model}.override_config."
        overrides = {k[len(prefix) :]: v for k, v in profile(backend).overrides.items() if k.startswith(prefix)}
        hf = AutoConfig.from_pretrained(tmp_path, attn_implementation=overrides.get("attn_implementation"))
        update_model_config(hf, overrides)  # what VeRL's HFModelConfig does with override_config
        return AutoModelForCausalLM.from_pretrained(tmp_path, config=hf, dtype=torch.float32)

    for model in ("actor_rollout_ref.model", "critic.model"):
        tpu = built("tpu", model)
        assert has_fused_experts(tpu) and experts_implementation(tpu.config) == "batched_mm", model
    assert experts_implementation(built("cpu").config) == "grouped_mm"  # the control
    assert tpu_experts_kwargs("tpu") == {"experts_implementation": "batched_mm"} and tpu_experts_kwargs("cpu") == {}
    sampler = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **tpu_experts_kwargs("tpu"))
    assert experts_implementation(sampler.config) == "batched_mm"
    # batched_mm computes what grouped_mm does (fp32, the dense-first MoE, every token routed to 2 of 4 experts)
    ids = torch.randint(0, config["vocab_size"], (2, 12))
    with torch.no_grad():
        want = built("cpu")(ids).logits
        got = tpu(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


#: Qwen3-30B-A3B's config.json shapes: 48 blocks of 128 experts, 8 a token, expert width 768
QWEN3_30B_A3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
#: libtpu 0.0.52's refusal of Qwen3-30B-A3B's block update graph at 1 x 512 tokens with batched_mm experts, for v6e
#: (docs/tpu.md, "MoE on TPU"): "CompileTimeHbmOom: ... HLO temporaries (61.32G) exceeds available HBM (31.24G)"
XLA_A3B_UPDATE_TEMPORARIES = 61.32e9


def test_the_memory_plan_counts_the_gathered_expert_weights(tmp_path):
    """The TPU plan's update temporaries hold what batched_mm gathers (each token's 8 experts' weights, and their
    gradients): at or over the 61.3 GB libtpu measured for Qwen3-30B-A3B's block at 1 x 512 tokens, within 30%; the
    plan's notes say it in one line. The control: without the gathered weights the plan is under XLA by far."""
    from transformers import Qwen3MoeConfig

    from verl_backend.driver.memory_plan import plan_memory
    from verl_backend.driver.model_shape import arrays_bytes, model_shape
    from verl_backend.driver.plan import compose_config
    from verl_backend.driver.profiles import PROFILES

    Qwen3MoeConfig(**QWEN3_30B_A3B).save_pretrained(tmp_path)  # config.json only
    keys = {
        "trainer.n_gpus_per_node": 8,
        "algorithm.adv_estimator": "grpo",
        "data.train_batch_size": 8,
        "data.max_prompt_length": 256,
        "data.max_response_length": 256,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.model.path": str(tmp_path),
    }
    tpu = PROFILES["tpu"]
    config = compose_config([f"{k}={v}" for k, v in {**tpu.overrides, **{k: str(v) for k, v in keys.items()}}.items()])
    plan = plan_memory(config, "v6e-8", tpu)
    temps = plan.term("update temporaries")
    assert XLA_A3B_UPDATE_TEMPORARIES <= temps <= 1.3 * XLA_A3B_UPDATE_TEMPORARIES, temps / 1e9
    [note] = [n for n in plan.notes if n.startswith("MoE on TPU")]
    assert "batched_mm" in note and "chlo.scan" in note and "\n" not in note
    shape = model_shape(Qwen3MoeConfig(**QWEN3_30B_A3B))
    without = [a for a in shape.block_temporaries(1, 512, 2) if "gathered" not in a[0]]
    assert arrays_bytes(without) < XLA_A3B_UPDATE_TEMPORARIES / 10  # the control
