"""Compiled sampler steps (``Sampler(compile=True)``, :mod:`rl_tpu.sampler.compiled`): the same tokens and log-probs
as the eager sampler and a plain Hugging Face forward, no recompile after warm-up (dynamo's ``fail_on_recompile``
stance, which otherwise falls back to eager quietly), at most one graph per bucket shape, one line and eager numbers
when a model does not compile; and the op counter of :mod:`rl_tpu.sampler.opcount`.

One test compiles with inductor (CPU's backend; ~1-2 minutes on two loaded cores); the others use ``aot_eager``,
which traces and guards exactly as inductor does (recompiles and graph breaks are dynamo's) without generating code.
"""

from __future__ import annotations

import pytest
import torch
from address_reuse import tensors_at_one_address
from families import FAMILIES, build_tiny_model
from families import tiny_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rl_tpu.sampler import Sampler, SamplerError, SamplingParams
from rl_tpu.sampler.opcount import GRAPH, OpCounter, decode_step_ops

torch.set_num_threads(1)

VOCAB, PAD, EOS = 97, 0, 1


def tiny_llama(seed: int = 0, cls=LlamaForCausalLM, head_dim: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(
        "llama",
        vocab_size=VOCAB,
        attn_implementation="sdpa",
        head_dim=head_dim or 16,  # 64: a head width rl-tpu's decode attention kernel takes
        max_position_embeddings=1024,
        initializer_range=0.2,  # peaked logits: no near-ties
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    return cls(cfg).eval()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Greedy log-probs of ``tokens`` from one unpadded, cache-free forward over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (new, vocab)
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.fixture(autouse=True)
def fallbacks_said_afresh(monkeypatch):
    from rl_tpu.sampler import fastpaths

    monkeypatch.setattr(fastpaths, "_SAID", set())


def test_inductor_steps_equal_eager_and_do_not_recompile_after_warm_up() -> None:
    model = tiny_llama(head_dim=64)
    lengths = [5, 19, 40, 11]  # one batch: prompt bucket 64, generation bucket 16
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=16, logprobs=True)
    sampler = Sampler(model, pad_token_id=PAD, eos_token_ids=[], compile=True)
    assert sampler.compiled.backend == "inductor"
    sampler.generate(random_prompts(lengths, seed=10), greedy)  # warm-up: compiles both shapes
    assert sampler.compiled.graphs == {"prefill": 1, "decode": 1}
    assert sampler.compiled.total_graphs <= len(sampler.shapes_seen)
    # float32 on the CPU: every linear layer (2 layers x 7, and the LM head) runs on a oneDNN-packed copy
    assert sampler.compiled.packed_linears == {"prefill": 15, "decode": 15}
    # and the decode's attention, in both layers, is rl-tpu's kernel (an opaque op in the graph) where it is built
    from rl_tpu.sampler import panel_kernel

    kernels = 2 if panel_kernel.backend() == "panel" else 0
    assert sampler.compiled.attention_kernels == {"prefill": 0, "decode": kernels}
    prompts = random_prompts(lengths, seed=11)
    with torch.compiler.set_stance("fail_on_recompile"):  # a recompile raises instead of running eagerly
        outs = sampler.generate(prompts, greedy)
        sampler.generate(prompts, SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=16, seed=3))
    assert sampler.compiled.graphs == {"prefill": 1, "decode": 1}

    eager = Sampler(model, pad_token_id=PAD, eos_token_ids=[]).generate(prompts, greedy)  # CPU fast paths on
    for i, (got, want) in enumerate(zip(outs, eager)):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
        ref = reference_logprobs(model, prompts[i // 2], got.token_ids)
        torch.testing.assert_close(torch.tensor(got.logprobs), ref, atol=1e-4, rtol=0)


def test_a_rollout_with_batches_and_shrinking_stays_within_its_shapes_and_sees_new_weights() -> None:
    model = tiny_llama()
    sampler = Sampler(
        model, pad_token_id=PAD, eos_token_ids=[EOS], max_batch_size=4, compile=True, compile_backend="aot_eager"
    )
    prompts = random_prompts([5, 19, 40, 11, 70, 3])  # two prompt buckets (64, 128), three batches of 4 rows
    params = SamplingParams(
        n=2, temperature=1.0, max_new_tokens=40, seed=5, logprobs=True, stop_token_ids=list(range(3, 13))
    )  # rows end at random steps: batches shrink
    first = sampler.generate(prompts, params)
    assert sampler.compiled.total_graphs <= len(sampler.shapes_seen)
    assert any(shape[0] < 4 and shape[1] == 1 for shape in sampler.shapes_seen)  # a batch shrank
    with torch.compiler.set_stance("fail_on_recompile"):
        again = sampler.generate(prompts, params)
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        other = tiny_llama(seed=1)  # a weight sync: new values copied into the same parameters
        sampler.load_state_dict(other.state_dict().items())
        synced = sampler.generate(prompts, params)
        with pytest.raises(RuntimeError, match="Detected recompile"):  # the stance does fail on a new shape
            sampler.generate(random_prompts([200]), params)
    want = Sampler(other, pad_token_id=PAD, eos_token_ids=[EOS], max_batch_size=4).generate(prompts, params)
    assert [o.token_ids for o in synced] == [o.token_ids for o in want]
    assert [o.token_ids for o in synced] != [o.token_ids for o in first]
    for got, ref in zip(synced, want):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)


def test_parameters_rebound_to_other_storage_are_read_without_recompiling() -> None:
    """What the rollout's shared-memory weights do (``param.data = view`` of the trainer's file), after graphs exist."""
    model, other = tiny_llama(), tiny_llama(seed=1)
    sampler = Sampler(model, pad_token_id=PAD, eos_token_ids=[], compile=True, compile_backend="aot_eager")
    prompts, params = random_prompts([5, 19]), SamplingParams(temperature=0, max_new_tokens=8, logprobs=True)
    before = sampler.generate(prompts, params)
    for mine, theirs in zip(model.parameters(), other.parameters()):
        mine.data = theirs.detach().clone()
    with torch.compiler.set_stance("fail_on_recompile"):
        after = sampler.generate(prompts, params)
    want = Sampler(other, pad_token_id=PAD, eos_token_ids=[]).generate(prompts, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in want] != [o.token_ids for o in before]


def test_packed_linears_in_the_graphs_give_the_plain_graphs_numbers_and_follow_weight_writes() -> None:
    """The compiled CPU graphs' linear layers multiply by packed copies kept outside the graph
    (:mod:`rl_tpu.sampler.compiled_packed`): the same tokens and log-probs as graphs on the plain weights, before
    and after weights are written in place (a stale copy would give the old weights' numbers), and after
    ``weights_changed`` drops the copies."""
    model = tiny_llama()
    prompts = random_prompts([5, 19, 40])
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, logprobs=True)
    packed = Sampler(model, pad_token_id=PAD, eos_token_ids=[], compile=True, compile_backend="aot_eager")
    plain = Sampler(
        model, pad_token_id=PAD, eos_token_ids=[], compile=True, compile_backend="aot_eager", packed_weights=False
    )

    def both():
        got, want = packed.generate(prompts, params), plain.generate(prompts, params)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        return [o.token_ids for o in got]

    before = both()
    assert packed.compiled.packed_linears == {"prefill": 15, "decode": 15} and packed.compiled.packs.nbytes > 0
    assert plain.compiled.packed_linears == {"prefill": 0, "decode": 0} and plain.compiled.packs is None
    with torch.compiler.set_stance("fail_on_recompile"), torch.no_grad():
        for mine, theirs in zip(model.parameters(), tiny_llama(seed=1).parameters()):
            mine.copy_(theirs)  # in place, not announced: the version counters moved
        after = both()
        packed.weights_changed()
        assert packed.compiled.packs.nbytes == 0
        assert both() == after != before


def test_the_packed_linear_op_is_plain_linear_outside_compiled_steps() -> None:
    from rl_tpu.sampler.compiled_packed import PackCache

    x, w, b = torch.randn(5, 3, 8), torch.randn(6, 8), torch.randn(6)
    want = torch.nn.functional.linear(x, w, b)
    assert torch.equal(torch.ops.rl_tpu.packed_linear(x, w, b), want)  # no active cache: F.linear itself
    cache = PackCache()
    with cache.active():
        torch.testing.assert_close(torch.ops.rl_tpu.packed_linear(x, w, b), want, rtol=1e-5, atol=1e-6)
        assert cache.nbytes == 6 * 8 * 4
        with torch.no_grad():
            w.mul_(2)
        torch.testing.assert_close(torch.ops.rl_tpu.packed_linear(x, w, None), x @ w.T, rtol=1e-5, atol=1e-6)
        assert torch.equal(
            torch.ops.rl_tpu.packed_linear(x.bfloat16(), w.bfloat16(), None),
            torch.nn.functional.linear(x.bfloat16(), w.bfloat16()),
        )  # not float32: plain
        # a weight freed and another made at its address, with the same shape and version counter (0): the old
        # copy must not be used
        x2, addresses = x[0, :, :8].repeat(1, 8), set()
        for weight in tensors_at_one_address(32, 64, count=4):
            addresses.add(weight.data_ptr())
            torch.testing.assert_close(
                torch.ops.rl_tpu.packed_linear(x2, weight, None), x2 @ weight.T, rtol=1e-5, atol=1e-5
            )
            del weight
        assert len(addresses) == 1
        kept = [torch.randn(32, 64) for _ in range(2)]  # live weights at their own addresses: a copy each
        for weight in kept:
            cache.packed(weight)
        assert len(cache._packed) >= 3
        del kept, weight
        cache.packed(torch.randn(48, 64))  # the next packing drops the copies of every freed weight
        assert len(cache._packed) == 2  # w's and the new weight's: the freed ones' went


class GraphBreakLlama(LlamaForCausalLM):
    """A Llama whose forward has a graph break (as some remote-code models do): no full graph."""

    def forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return super().forward(*args, **kwargs)


def test_a_model_that_does_not_compile_runs_eagerly_said_in_one_line(capfd) -> None:
    model = tiny_llama(cls=GraphBreakLlama)
    prompts = random_prompts([5, 19])
    params = SamplingParams(temperature=0, max_new_tokens=8, logprobs=True)
    sampler = Sampler(model, pad_token_id=PAD, eos_token_ids=[EOS], compile=True, compile_backend="aot_eager")
    outs = sampler.generate(prompts, params)
    lines = [line for line in capfd.readouterr().err.splitlines() if "compiled steps off" in line]
    assert len(lines) == 1 and "GraphBreakLlama" in lines[0] and "run eagerly" in lines[0]
    assert not sampler.compiled.active and sampler.compiled.total_graphs == 0
    want = Sampler(model, pad_token_id=PAD, eos_token_ids=[EOS]).generate(prompts, params)
    for got, ref in zip(outs, want):
        assert got.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)


def test_bfloat16_compiles_as_the_tpu_profile_samples() -> None:
    model = tiny_llama().to(torch.bfloat16)  # the TPU profile's rollout dtype
    prompts = random_prompts([5, 19, 40])
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, logprobs=True)
    sampler = Sampler(model, pad_token_id=PAD, eos_token_ids=[], compile=True, compile_backend="aot_eager")
    sampler.generate(prompts, params)
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = sampler.generate(prompts, params)
    assert sampler.compiled.active and sampler.compiled.graphs == {"prefill": 1, "decode": 1}
    assert sampler.compiled.packed_linears == {"prefill": 0, "decode": 0}  # oneDNN packing is for float32 only
    want = Sampler(model, pad_token_id=PAD, eos_token_ids=[], packed_prefill=False).generate(prompts, params)
    for got, ref in zip(outs, want):
        assert got.token_ids == ref.token_ids
        # bfloat16 rounding: the eager step reads only the written cache slots, the compiled one the whole cache
        # (other matmul shapes, other rounding); measured here max 0.026 nats
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=0.1, rtol=0)


def test_compile_with_a_cpu_fast_path_asked_for_is_refused() -> None:
    with pytest.raises(SamplerError, match="lean_decode=True"):
        Sampler(tiny_llama(), pad_token_id=PAD, eos_token_ids=[EOS], compile=True, lean_decode=True)


SLIDING = ("qwen2_sliding", "mistral", "gemma3")  # a sliding-window layer: transformers' StaticSlidingWindowLayer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_compile_with_their_own_numbers(family, tmp_path_factory, capfd) -> None:
    """Every family's compiled steps give a plain HF forward's log-probs (within 1e-4), their float32 linear layers on
    packed copies of the weights (rl-tpu's op in the graph). Llama, Qwen2, Qwen3 (query/key norms) and Qwen3-MoE
    compile; a family with sliding-window layers counts its static cache's length in a Python int (transformers'
    ``StaticSlidingWindowLayer``), which would compile a decode graph per step: it runs eagerly, said in one line."""
    from verl_backend.models import ensure_default_model

    path = build_tiny_model(family, ensure_default_model(), tmp_path_factory.mktemp(family))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (12, 23, 9)]  # windows are 5
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, logprobs=True)
    sampler = Sampler(model, pad_token_id=0, eos_token_ids=[], compile=True, compile_backend="aot_eager")
    sampler.generate(prompts, params)
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = sampler.generate(prompts, params)
    lines = [line for line in capfd.readouterr().err.splitlines() if "compiled steps off" in line]
    sliding = family in SLIDING
    if sliding:
        assert not sampler.compiled.active and len(lines) == 1 and "cumulative_length_int" in lines[0], lines
    else:
        assert sampler.compiled.active and not lines
        assert sampler.compiled.packed_linears["decode"] > 0  # the graph's linear layers are the packed op
    assert sampler.compiled.total_graphs <= len(sampler.shapes_seen) + sliding
    for i, out in enumerate(outs):
        ref = reference_logprobs(model, prompts[i // 2], out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_the_op_counter_counts_each_dispatched_op() -> None:
    x = torch.ones(3)
    with OpCounter() as counter:
        y = (x + 1) * 2
        y.add_(x)
    assert counter.counts == {"add": 1, "mul": 1, "add_": 1} and counter.total == 3


def test_ops_per_decode_step_bucketed_lean_and_compiled() -> None:
    model = tiny_llama()  # 2 layers: 7 linear layers each, and the LM head
    prompts = random_prompts([5, 19, 30, 11])
    bucketed = Sampler(
        model, pad_token_id=PAD, eos_token_ids=[], packed_weights=False, packed_prefill=False, lean_decode=False
    )
    lean = Sampler(model, pad_token_id=PAD, eos_token_ids=[], packed_weights=False)
    compiled = Sampler(model, pad_token_id=PAD, eos_token_ids=[], compile=True, compile_backend="aot_eager")
    compiled.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))  # compile first
    ops = {
        name: decode_step_ops(s, prompts, temperature=0)
        for name, s in (("bucketed", bucketed), ("lean", lean), ("compiled", compiled))
    }
    assert ops["bucketed"]["linear"] == 2 * 7 + 1  # one decode step's forward, counted once
    assert ops["lean"]["linear"] == 2 * 7 + 1
    assert ops["compiled"][GRAPH] == 1 and "linear" not in ops["compiled"]
    totals = {name: sum(c.values()) for name, c in ops.items()}
    assert totals["compiled"] < totals["lean"] < totals["bucketed"]


def test_the_job_setting_reaches_the_sampler(job_settings_here, tmp_path) -> None:
    from types import SimpleNamespace

    from verl_backend.models import ensure_default_model
    from verl_backend.rollout.sampling import build_sampler
    from verl_backend.settings import rollout_settings

    path = build_tiny_model("llama", ensure_default_model(), tmp_path / "m")
    rollout = SimpleNamespace(prompt_length=32, response_length=16, max_num_seqs=4, dtype="float32")
    # the job's record -> the rollout's section (what the adapter and the server build once) -> the sampler
    assert build_sampler(str(path), rollout, "cpu", settings=rollout_settings(job_settings_here())).compiled is None
    compiled = rollout_settings(job_settings_here(compile_sampler=True))
    sampler = build_sampler(str(path), rollout, "cpu", settings=compiled)
    assert sampler.compiled is not None and sampler.compiled.backend == "inductor"
    assert sampler.packed is None and not sampler.lean_decode and not sampler.packed_prefill
    assert sampler.compiled.packs is not None  # float32 on the CPU: packed weights inside the graphs


@pytest.fixture()
def job_settings_here(monkeypatch):
    """This process as a worker of a ``verl train`` job with the given settings (the record the driver hands it)."""
    from verl_backend import settings

    def install(**values):
        monkeypatch.setenv(settings.RECORD_ENV, settings.record(settings.RlTpuSettings(**values)))
        return settings.current()

    return install
