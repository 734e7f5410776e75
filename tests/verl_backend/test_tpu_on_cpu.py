"""The ``tpu-on-cpu`` compile backend (:mod:`verl_backend.tpu_on_cpu`, issue #43): a compiled region's aot_autograd
graphs lowered to StableHLO by TorchTPU in the lowering server (.venv-aot), compiled and run by XLA:CPU, against torch
eager; each with a negative control. Skipped without torch-tpu (``.ci/aot_venv``).

Bounds, set before looking: fp32 everywhere, so a graph's outputs differ from eager's only by XLA's reduction order:
``max|Δ| <= 1e-5 × max|ref|`` (the ``--aot-only`` numerics check's bound); the sampler's greedy tokens are identical
(the tiny model's logits are peaked, no near-ties) and its log-probs within 1e-4 nats.
"""

from __future__ import annotations

import pytest
import torch

from verl_backend import tpu_on_cpu
from verl_backend.tpu_on_cpu import TpuOnCpu, aot_python_path

pytestmark = pytest.mark.skipif(aot_python_path() is None, reason="torch-tpu is not installed (.ci/aot_venv)")

RTOL = 1e-5


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((got - ref).abs().max()) <= RTOL * float(ref.abs().max())


@pytest.fixture(scope="module", autouse=True)
def lowering_server_closed():
    """The module's lowering server ends with it (a live one holds libtpu; it must not take libtpu's lockfile
    meanwhile: the compile subprocesses of later tests run beside it)."""
    yield
    if TpuOnCpu._lowering is not None:
        TpuOnCpu._lowering.close()
        TpuOnCpu._lowering = None


@pytest.fixture
def said(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(tpu_on_cpu, "_SAID", set())
    monkeypatch.setattr(tpu_on_cpu, "GRAPHS", [])
    torch.compiler.reset()
    yield lines
    torch.compiler.reset()


def tiny_block(seed: int = 0):
    """Block 0 of a tiny Qwen3 (SDPA attention) with its inputs: ``(fn, (x, cos, sin, mask))``, x requiring grad."""
    import transformers
    from families import tiny_config

    torch.manual_seed(seed)
    cfg = tiny_config("qwen3", attn_implementation="sdpa", initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    layer = model.model.layers[0]
    batch, seq = 2, 8
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(seq)[None].expand(batch, seq)
    cos, sin = model.model.rotary_emb(x, pos)
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None].expand(batch, 1, seq, seq)

    def block(x, cos, sin, mask):
        out = layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    return block, (x, cos, sin, mask.contiguous())


def run_block(block, args, backend=None):
    x = args[0]
    x.grad = None
    fn = block if backend is None else torch.compile(block, backend=backend, fullgraph=True, dynamic=False)
    out = fn(*args)
    out.sum().backward()
    return out.detach(), x.grad.clone()


def test_a_block_forward_and_backward_run_as_torch_tpu_graphs_on_xla_cpu(said, tmp_path):
    block, args = tiny_block()
    ref_out, ref_grad = run_block(block, args)
    backend = TpuOnCpu("trainer.block", cache_dir=tmp_path, say=said.append)
    out, grad = run_block(block, args, backend)
    assert [(g.name, g.lowered, g.runs) for g in tpu_on_cpu.GRAPHS] == [
        ("trainer.block.fwd0", "xla-cpu", 1),
        ("trainer.block.bwd0", "xla-cpu", 1),
    ], said
    assert close(out, ref_out) and close(grad, ref_grad)
    assert len(list(tmp_path.glob("*.mlir"))) == 2  # the StableHLO cache

    # the cache: a fresh backend (another rank of the host) lowers nothing and computes the same
    torch.compiler.reset()
    again = TpuOnCpu("trainer.block", cache_dir=tmp_path, say=said.append)
    out2, grad2 = run_block(block, args, again)
    assert [g.cached for g in tpu_on_cpu.GRAPHS[2:]] == [True, True]
    assert torch.equal(out2, out) and torch.equal(grad2, grad)


def test_a_wrong_decomposition_fails_the_comparison(said, tmp_path):
    """The negative control: rsqrt (RMSNorm's) decomposed as 1.01/sqrt in the worker's table moves the numbers past
    the bound; the same check passes above."""
    block, args = tiny_block()
    ref_out, ref_grad = run_block(block, args)
    backend = TpuOnCpu("trainer.block", cache_dir=tmp_path, say=said.append)
    backend.table.update(backend._server().decompositions())
    backend.table[torch.ops.aten.rsqrt.default] = lambda x: 1.01 / x.sqrt()
    out, grad = run_block(block, args, backend)
    assert all(g.lowered == "xla-cpu" for g in tpu_on_cpu.GRAPHS)
    assert not close(out, ref_out)


def test_the_sampler_decodes_the_same_tokens_on_xla_cpu(said, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl_tpu"))
    from test_sampler_compiled import PAD, random_prompts, tiny_llama

    from rl_tpu.sampler import Sampler, SamplingParams

    model = tiny_llama(head_dim=64)
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=16, logprobs=True)
    prompts = random_prompts([5, 19, 40, 11], seed=11)
    ref = Sampler(model, pad_token_id=PAD, eos_token_ids=[]).generate(prompts, greedy)
    backend = TpuOnCpu("sampler", cache_dir=tmp_path, say=said.append)
    sampler = Sampler(
        model, pad_token_id=PAD, eos_token_ids=[], compile=True, compile_backend=backend, packed_weights=False
    )
    out = sampler.generate(prompts, greedy)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    worst = max(max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) for o, r in zip(out, ref))
    assert worst <= 1e-4
    graphs = tpu_on_cpu.GRAPHS
    assert [g.lowered for g in graphs] == ["xla-cpu", "xla-cpu"], said  # prefill, decode: one shape each
    assert graphs[1].runs == 15  # every decode step after the prefill's token ran on XLA:CPU
    assert sampler.compiled.graphs == {"prefill": 1, "decode": 1}

    # another process of the host (a fresh compile, the same cache folder): both graphs from the StableHLO cache,
    # run on XLA:CPU (a cached inference graph's constants once came back as meta tensors and ran eager)
    torch.compiler.reset()
    again = Sampler(
        model,
        pad_token_id=PAD,
        eos_token_ids=[],
        compile=True,
        compile_backend=TpuOnCpu("sampler", cache_dir=tmp_path, say=said.append),
        packed_weights=False,
    )
    assert [o.token_ids for o in again.generate(prompts, greedy)] == [r.token_ids for r in ref]
    assert [(g.cached, g.lowered) for g in tpu_on_cpu.GRAPHS[2:]] == [(True, "xla-cpu")] * 2, said


def test_a_graph_torch_tpu_cannot_lower_runs_eager_said_once(said, tmp_path):
    """Dropout needs the TPU generator, hence a chip: the graph is refused in one line naming the op and the graph,
    runs as torch eager (the same numbers under the same seed), and the job goes on; the second call says nothing."""

    def noisy(x):
        return torch.nn.functional.dropout(x * 2, p=0.5, training=True).sum(-1)

    x = torch.randn(4, 8)
    backend = TpuOnCpu("noisy", cache_dir=tmp_path, say=said.append)
    fn = torch.compile(noisy, backend=backend, fullgraph=True, dynamic=False)
    torch.manual_seed(3)
    out = fn(x)
    torch.manual_seed(3)
    fn(x)
    assert (
        len(said) == 1 and "noisy.inf0" in said[0] and "needs a chip" in said[0] and "runs as torch eager" in said[0]
    ), said
    assert "bernoulli" in said[0] or "rand" in said[0] or "dropout" in said[0], said
    assert tpu_on_cpu.GRAPHS[0].lowered.startswith("eager:")
    assert out.shape == (4,)


def test_the_backend_is_refused_off_the_cpu_backend():
    from verl_backend.driver.train import _check_tpu_on_cpu
    from rl_tpu.errors import BadInputError
    from verl_backend.settings import RlTpuSettings

    settings = RlTpuSettings(compile_backend="tpu-on-cpu")
    _check_tpu_on_cpu("cpu", settings)
    with pytest.raises(BadInputError, match="use it with --backend cpu"):
        _check_tpu_on_cpu("tpu", settings)


def test_a_kv_cache_slot_shifted_by_one_fails_the_comparison(said, tmp_path):
    """The sampler's negative control: the KV cache's write (``index_copy`` at the cache positions, the static cache's
    update) decomposed to write each token one slot later in the worker's table. The graphs still lower and run on
    XLA:CPU; the decode then attends to a shifted cache, and the greedy tokens of the check above no longer match."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl_tpu"))
    from test_sampler_compiled import PAD, random_prompts, tiny_llama

    from rl_tpu.sampler import Sampler, SamplingParams

    def shifted(x, dim, index, source):
        at = (index + 1).clamp(max=x.shape[dim] - 1)
        return torch.ops.aten.index_put.default(x, [None] * dim + [at], source)

    model = tiny_llama(head_dim=64)
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=16, logprobs=True)
    prompts = random_prompts([5, 19, 40, 11], seed=11)
    ref = Sampler(model, pad_token_id=PAD, eos_token_ids=[]).generate(prompts, greedy)
    backend = TpuOnCpu("sampler", cache_dir=tmp_path, say=said.append)
    backend.table.update(backend._server().decompositions())
    backend.table[torch.ops.aten.index_copy.default] = shifted
    sampler = Sampler(
        model, pad_token_id=PAD, eos_token_ids=[], compile=True, compile_backend=backend, packed_weights=False
    )
    out = sampler.generate(prompts, greedy)
    assert [g.lowered for g in tpu_on_cpu.GRAPHS] == ["xla-cpu", "xla-cpu"], said
    assert [o.token_ids for o in out] != [r.token_ids for r in ref]
