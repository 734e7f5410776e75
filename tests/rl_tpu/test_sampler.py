"""The native sampler on tiny random Llama models: log-probs, buckets, sampling settings, weight updates."""

from __future__ import annotations

import pytest
import torch
from families import tiny_config
from transformers import LlamaForCausalLM

from rl_tpu.sampler import Sampler, SamplerError, SamplingParams, choose_tokens

torch.set_num_threads(1)

VOCAB, PAD, EOS = 97, 0, 1


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(
        "llama",
        vocab_size=VOCAB,
        attn_implementation="sdpa",
        max_position_embeddings=1024,
        initializer_range=0.2,  # peaked logits: no near-ties
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def make(model: LlamaForCausalLM, **kw) -> Sampler:
    return Sampler(model, pad_token_id=PAD, eos_token_ids=[EOS], **kw)


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a separate, unpadded, cache-free forward, gathered at ``tokens``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (new, vocab)
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=24, seed=1),
        SamplingParams(n=2, temperature=1.3, max_new_tokens=24, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=24),
    ],
    ids=["t0.7-topk-topp", "t1.3", "greedy"],
)
def test_logprobs_equal_a_forward_pass(model, params: SamplingParams) -> None:
    prompts = random_prompts([5, 19, 40, 11])
    outs = make(model).generate(prompts, params)
    assert len(outs) == len(prompts) * params.n
    for i, out in enumerate(outs):
        prompt = prompts[i // params.n]  # prompt-major order
        assert len(out.logprobs) == len(out.token_ids) >= 1
        ref = reference_logprobs(model, prompt, out.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_greedy_matches_hf_generate(model) -> None:
    prompts = random_prompts([3, 8, 30, 64, 65])
    outs = make(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))
    for prompt, out in zip(prompts, outs):
        hf = model.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=PAD, eos_token_id=EOS
        )[0, len(prompt) :].tolist()
        assert out.token_ids == hf


def test_buckets_bound_the_shapes(model) -> None:
    # what an XLA/TPU device runs: packed prefill (CPU only) has one shape per batch
    sampler = make(model, prompt_buckets=(16, 32, 64), gen_buckets=(8, 16), max_batch_size=8, packed_prefill=False)
    lengths = list(range(1, 65, 3))  # 22 different prompt lengths
    for i, batch_size in enumerate([1, 3, 5, 8, 11]):
        prompts = random_prompts([lengths[(i * 7 + j) % len(lengths)] for j in range(batch_size)], seed=i)
        for new in (3, 9, 16):
            sampler.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, seed=i))
    for batch, q, cache in sampler.shapes_seen:
        assert batch in (1, 2, 4, 8)
        assert q == 1 or q in (16, 32, 64)
        assert cache in {p + g for p in (16, 32, 64) for g in (8, 16)}
        assert q == 1 or cache - q in (8, 16)
    # prefill: batch x prompt bucket x gen bucket; decode: batch x cache length
    assert len(sampler.shapes_seen) <= 4 * 3 * 2 * 2


def test_n_samples_are_prompt_major(model) -> None:
    prompts = random_prompts([4, 9, 6])
    outs = make(model).generate(prompts, SamplingParams(n=4, temperature=0, max_new_tokens=8))
    assert len(outs) == 12
    singles = make(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    for i, out in enumerate(outs):
        assert out.token_ids == singles[i // 4].token_ids
    sampled = make(model).generate(prompts, SamplingParams(n=4, temperature=1.5, max_new_tokens=8, seed=0))
    assert len({tuple(o.token_ids) for o in sampled[:4]}) > 1  # the n samples of one prompt differ


def test_stop_tokens_and_eos_end_completions(model) -> None:
    prompts = random_prompts([7, 12, 3, 25, 9, 14])
    stop = list(range(3, 60))  # most of the vocabulary: rows stop early, at different steps
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, stop_token_ids=stop, seed=5)
    outs = make(model).generate(prompts, params)
    ends = set(stop) | {EOS}
    for out in outs:
        if out.finish_reason == "stop":
            assert out.token_ids[-1] in ends
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 16
        assert not ends & set(out.token_ids[:-1]), "a completion went on past a stop token"
    assert sum(o.finish_reason == "stop" for o in outs) >= 6
    # EOS alone (no stop list): a sampler whose EOS is the first greedy token stops at once
    first = make(model).generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=5))[0].token_ids[0]
    out = Sampler(model, pad_token_id=PAD, eos_token_ids=[first]).generate(
        prompts[:1], SamplingParams(temperature=0, max_new_tokens=5)
    )[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_shrinking_the_batch_keeps_results(model) -> None:
    """Greedy with stop tokens: rows finish at different steps; dropping them must not change any row."""
    prompts = random_prompts([5, 9, 13, 17, 21, 25, 29, 33], seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=list(range(3, 40)))
    shrinking = make(model)
    a = shrinking.generate(prompts, params)
    b = make(model, shrink_finished=False).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    assert len({o.token_ids.__len__() for o in a}) > 1
    assert min(batch for batch, q, _ in shrinking.shapes_seen if q == 1) < 8, "the batch never shrank"


def test_samples_of_one_prompt_share_one_prefill(model) -> None:
    prompts = random_prompts([9, 30])
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=4)
    shared = make(model, packed_prefill=False)
    a = shared.generate(prompts, params)
    b = make(model, share_prefix=False, packed_prefill=False).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    prefill_batches = {batch for batch, q, _ in shared.shapes_seen if q > 1}
    assert prefill_batches == {2}  # two distinct prompts prefilled, not eight rows


@pytest.mark.parametrize("budget", [2048, 40], ids=["one-sequence", "several-sequences"])
def test_packed_prefill_equals_padded_prefill(model, budget: int) -> None:
    """Distinct prompts with a common prefix, some repeated (n samples): the unpadded packed prefill must give
    the padded prefill's tokens and log-probs, compute the common prefix once per packed sequence, and keep each
    sequence within the token budget."""
    prefix = random_prompts([10], seed=7)[0]
    prompts = [prefix + p for p in random_prompts([3, 17, 1, 30, 8], seed=8)] + [prefix[:4]]
    for params in (
        SamplingParams(n=2, temperature=0, max_new_tokens=12),
        SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=3),
    ):
        packed = make(model, packed_prefill_tokens=budget)
        a = packed.generate(prompts, params)
        b = make(model, packed_prefill=False).generate(prompts, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
        prefill = sorted(q for batch, q, _ in packed.shapes_seen if q > 1)
        assert all(batch == 1 for batch, q, _ in packed.shapes_seen if q > 1)
        if budget == 2048:
            # one sequence; the shortest prompt (4 tokens) caps the shared prefix at 3 tokens
            assert prefill == [3 + sum(len(p) - 3 for p in prompts)]
        else:
            assert len(prefill) > 1 and max(prefill) <= max(budget, max(map(len, prompts)))
        packed.shapes_seen.clear()
    # without the short prompt the whole 10-token prefix is computed once
    packed = make(model)
    packed.generate(prompts[:-1], SamplingParams(temperature=0, max_new_tokens=2))
    assert max(q for _, q, _ in packed.shapes_seen) == 10 + sum(len(p) - 10 for p in prompts[:-1])


def _tiny(kind: str, **extra) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        kind,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        tie_word_embeddings=False,
        **extra,
    )
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen2", {}),
        ("mistral", {"sliding_window": None}),
        ("qwen3", {}),
        ("llama", {"hidden_act": "gelu"}),
        ("gemma3_text", {"sliding_window": 128, "head_dim": 16, "query_pre_attn_scalar": 32}),
        ("mistral", {"sliding_window": 128}),
    ],
    ids=[
        "llama",
        "llama-bias-rope-scaling",
        "qwen2-bias",
        "mistral",
        "qwen3-qk-norm",
        "llama-gelu-mlp-as-module",
        "gemma3-within-window",
        "mistral-within-window",
    ],
)
def test_lean_decode_equals_the_models_forward(kind: str, extra: dict) -> None:
    """The lean decode step against the model's own forward: same tokens, same log-probs (which the log-prob
    tests also hold to a separate cache-free forward), rows stopping at different steps."""
    from rl_tpu.sampler.lean import LeanDecoder

    model = _tiny(kind, **extra)
    assert LeanDecoder.build(model) is not None
    prompts = random_prompts([5, 19, 40, 11, 2, 27])
    for params in (
        SamplingParams(n=2, temperature=0, max_new_tokens=20, stop_token_ids=list(range(3, 12))),
        SamplingParams(n=2, temperature=1.0, top_k=30, max_new_tokens=20, seed=6),
    ):
        lean = make(model)
        a = lean.generate(prompts, params)
        assert lean.lean is not None and lean.lean_steps > 0
        b = make(model, lean_decode=False).generate(prompts, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        for i, out in enumerate(a[:4]):
            ref = reference_logprobs(model, prompts[i // 2], out.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_lean_decode_refuses_other_structures() -> None:
    """Models the lean step does not compute keep their own forward (the sampler still works)."""
    from rl_tpu.sampler.lean import LeanDecoder

    assert LeanDecoder.build(_tiny("llama").to(torch.bfloat16)) is None
    # sliding windows: the structure is the lean step's, a cache longer than the window is not (per batch)
    for model in (_tiny("gemma3_text", sliding_window=8), _tiny("mistral", sliding_window=8)):
        assert LeanDecoder.build(model) is not None, type(model).__name__
        sampler = make(model)
        out = sampler.generate(random_prompts([6]), SamplingParams(temperature=0, max_new_tokens=4))
        assert len(out[0].token_ids) >= 1 and sampler.lean_steps == 0, type(model).__name__
    # decided per generate: a sampler whose model is cast to bfloat16 afterwards stops using it
    model = _tiny("llama")
    sampler = make(model)
    sampler.generate(random_prompts([6]), SamplingParams(temperature=0, max_new_tokens=2))
    assert sampler.lean is not None
    model.to(torch.bfloat16)
    sampler.generate(random_prompts([6]), SamplingParams(temperature=0, max_new_tokens=2))
    assert sampler.lean is None


def test_models_that_check_sdpa_by_name_keep_it() -> None:
    """Falcon picks its attention by comparing the setting with "sdpa": the sampler must not rename it (Falcon
    then ran its eager branch on a boolean mask, log-probs off by ~2.5), nor pack its prefill."""
    from transformers import FalconConfig, FalconForCausalLM

    from rl_tpu.sampler.attention import dispatches_through_interface

    torch.manual_seed(0)
    cfg = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    model = FalconForCausalLM(cfg).eval()
    assert not dispatches_through_interface(model) and dispatches_through_interface(tiny_llama())
    prompts = random_prompts([5, 12, 3])
    sampler = make(model)
    for out, prompt in zip(sampler.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6)), prompts):
        ref = reference_logprobs(model, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    assert all(batch > 1 for batch, q, _ in sampler.shapes_seen if q > 1)  # padded prefill, not packed


def test_value_heads_narrower_than_query_heads() -> None:
    """DeepSeek-V3's multi-head latent attention: value heads of 8 against query/key heads of 24 (the one-token
    decode attention must take the value's width)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    prompts = random_prompts([5, 3, 9])
    params = SamplingParams(temperature=0, max_new_tokens=6)
    for out, prompt in zip(make(model).generate(prompts, params), prompts):
        ref = reference_logprobs(model, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    assert make(model).generate([], params) == []


def test_gqa_attention_matches_sdpa_and_is_scoped(model) -> None:
    from rl_tpu.sampler.attention import ATTN_NAME, gqa_attention

    ids = torch.tensor(random_prompts([12, 12]))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: the path that makes transformers expand the KV heads
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        with gqa_attention(model) as active:
            assert active and model.config._attn_implementation == ATTN_NAME
            got = model(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got[0, 4:], want[0, 4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    make(model).generate(random_prompts([5]), SamplingParams(max_new_tokens=2))
    assert model.config._attn_implementation == "sdpa"


def test_top_k_1_and_tiny_top_p_equal_greedy(model) -> None:
    prompts = random_prompts([6, 20, 33])
    greedy = make(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    top1 = make(model).generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12, seed=9))
    nucleus = make(model).generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=12, seed=9))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]
    assert [o.token_ids for o in nucleus] == [o.token_ids for o in greedy]


def test_seed_reproducibility(model) -> None:
    prompts = random_prompts([6, 20, 33])
    p = dict(n=2, temperature=1.0, top_p=0.95, max_new_tokens=16)
    a = make(model).generate(prompts, SamplingParams(seed=11, **p))
    b = make(model).generate(prompts, SamplingParams(seed=11, **p))
    c = make(model).generate(prompts, SamplingParams(seed=12, **p))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_max_new_tokens_honoured(model) -> None:
    prompts = random_prompts([6, 20])
    for new in (1, 5, 17):
        for out in make(model).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)):
            assert 1 <= len(out.token_ids) <= new
            assert (len(out.token_ids) == new) == (out.finish_reason == "length")


def test_batches_larger_than_max_batch_size(model) -> None:
    prompts = random_prompts([4, 50, 7, 30, 12])
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10)
    whole = make(model).generate(prompts, params)
    chunked = make(model, max_batch_size=3)
    parts = chunked.generate(prompts, params)
    assert [o.token_ids for o in parts] == [o.token_ids for o in whole]
    assert max(batch for batch, _, _ in chunked.shapes_seen) <= 3


def test_load_state_dict_updates_weights_in_place() -> None:
    target, other = tiny_llama(seed=0), tiny_llama(seed=1)
    prompts = random_prompts([8, 15])
    params = SamplingParams(temperature=0, max_new_tokens=12)
    sampler = make(target)
    before = sampler.generate(prompts, params)
    ptr = target.model.embed_tokens.weight.data_ptr()
    sampler.load_state_dict(other.state_dict().items())
    assert target.model.embed_tokens.weight.data_ptr() == ptr  # same storage
    after = sampler.generate(prompts, params)
    want = make(other).generate(prompts, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in want]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    with pytest.raises(SamplerError, match="no tensor named 'nope'"):
        sampler.load_state_dict([("nope", torch.zeros(1))])
    with pytest.raises(SamplerError, match="lm_head.weight.*shape"):
        sampler.load_state_dict([("lm_head.weight", torch.zeros(3, 3))])


def test_bad_input_is_refused_with_the_fix(model) -> None:
    sampler = make(model, prompt_buckets=(8, 16), gen_buckets=(8,))
    ok = SamplingParams(max_new_tokens=4)
    with pytest.raises(SamplerError, match="prompt 1 has 17 tokens.*prompt_buckets"):
        sampler.generate([[5] * 3, [5] * 17], ok)
    with pytest.raises(SamplerError, match="prompt 0 is empty"):
        sampler.generate([[]], ok)
    with pytest.raises(SamplerError, match=f"token id {VOCAB}"):
        sampler.generate([[3, VOCAB]], ok)
    with pytest.raises(SamplerError, match="max_new_tokens=9.*gen_buckets"):
        sampler.generate([[3]], SamplingParams(max_new_tokens=9))
    for bad in (dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_new_tokens=0)):
        with pytest.raises(SamplerError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_choose_tokens_draws_from_the_truncated_distribution() -> None:
    """Empirical frequencies match top-k then top-p renormalised probabilities (HF/vLLM order)."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, logp = choose_tokens(logits, temperature=0.9, top_k=5, top_p=0.8, generator=g)
    probs = torch.softmax(logits[0] / 0.9, -1)
    topk = probs[:5] / probs[:5].sum()
    keep = (topk.cumsum(0) - topk) < 0.8
    want = torch.zeros(8)
    want[:5] = torch.where(keep, topk, torch.zeros(5))
    want /= want.sum()
    freq = torch.bincount(tokens, minlength=8).float() / tokens.numel()
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)
    # the log-prob is the untruncated tempered one
    torch.testing.assert_close(logp, probs.log()[tokens], atol=1e-6, rtol=0)


def test_two_level_draw_matches_the_weights() -> None:
    """Above 2 * DRAW_BLOCK weights the draw picks a block, then a token in it: frequencies still follow the
    weights, zero weights (inside blocks, whole blocks, and the zero-padded tail of a vocabulary that is not a
    multiple of the block) are never drawn."""
    from rl_tpu.sampler.processing import DRAW_BLOCK, _draw

    vocab = 5 * DRAW_BLOCK + 37
    weights = torch.zeros(vocab)
    hot = torch.tensor([0, 1, DRAW_BLOCK - 1, DRAW_BLOCK, 3 * DRAW_BLOCK + 5, vocab - 1])
    weights[hot] = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 4.0])
    g = torch.Generator().manual_seed(3)
    tokens = _draw(weights.expand(40000, -1), torch.rand(40000, dtype=torch.float64, generator=g))
    assert bool(torch.isin(tokens, hot).all()), "a zero weight was drawn"
    freq = torch.bincount(tokens, minlength=vocab)[hot].float() / tokens.numel()
    torch.testing.assert_close(freq, weights[hot] / weights.sum(), atol=0.01, rtol=0)
    # one row, nearly all mass in one token: the rest still drawn at their rate
    peaked = torch.full((vocab,), 1e-6)
    peaked[DRAW_BLOCK + 3] = 1.0
    tokens = _draw(peaked.expand(20000, -1), torch.rand(20000, dtype=torch.float64, generator=g))
    other = (tokens != DRAW_BLOCK + 3).float().mean()
    want = float((vocab - 1) * 1e-6 / ((vocab - 1) * 1e-6 + 1.0))
    assert abs(float(other) - want) < 0.003


def test_choose_tokens_top_p_draws_stay_in_each_rows_nucleus() -> None:
    """Top-p over a 5000-token vocabulary with rows from peaked to flat: nuclei of a few, hundreds and thousands
    of tokens (past the partial-sort candidates, so the full-sort fallback runs) in one batch."""
    g = torch.Generator().manual_seed(1)
    scales = torch.linspace(0.05, 6.0, 48)[:, None]
    logits = (torch.randn(48, 5000, generator=g) * scales).repeat(20, 1)  # each row drawn 20 times
    tokens, _ = choose_tokens(logits, temperature=1.0, top_k=-1, top_p=0.5, generator=g)
    probs = torch.softmax(logits, -1)
    sp, si = probs.sort(-1, descending=True)
    nucleus_size = ((sp.cumsum(-1) - sp) < 0.5).sum(-1)  # (rows,)
    assert int(nucleus_size.min()) < 64 and int(nucleus_size.max()) > 1024
    assert bool(((nucleus_size > 64) & (nucleus_size < 1024)).any())
    rank = (si == tokens[:, None]).float().argmax(-1)  # position of the drawn token in the sorted order
    assert bool((rank < nucleus_size).all()), "a draw fell outside its row's nucleus"
    assert int(rank.max()) > 1024  # draws reach beyond the partial-sort candidates


# ------------------------------------------------------------------ decode on oneDNN-packed weights (CPU)
def test_packed_linears_match_the_plain_forward_and_are_scoped(model) -> None:
    from rl_tpu.sampler.packed import PackedLinears, packed_linear_supported

    assert packed_linear_supported(), "this torch CPU build has no oneDNN packed linear"
    assert make(model).packed is not None, "a float32 CPU model decodes on packed weights by default"
    assert make(model, packed_weights=False).packed is None
    ids = torch.tensor(random_prompts([9, 9, 9]))
    packed = PackedLinears(model, batch_hint=3)
    assert len(packed.modules) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer and the LM head
    with torch.no_grad():
        want = model(ids).logits
        with packed.applied() as active:
            assert active and all("forward" in m.__dict__ for m in packed.modules)
            got = model(ids).logits
    assert not any("forward" in m.__dict__ for m in packed.modules), "the plain forward is restored on exit"
    assert packed.nbytes == sum(m.weight.numel() * 4 for m in packed.modules)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a fused group: one product on the concatenated q/k/v weights equals the three layers
    attn = model.model.layers[1].self_attn
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(3, 1, 64)
    with torch.no_grad(), packed.applied():
        fused = packed.fused(group)
        got = fused(x)
    want = [torch.nn.functional.linear(x, m.weight, m.bias) for m in group]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert packed.nbytes == sum(m.weight.numel() * 4 for m in packed.modules + list(group))
    packed.release()
    assert packed.nbytes == 0 and packed._packed is None and packed.fused(group) is None


def test_packed_weights_follow_weight_changes() -> None:
    """An in-place write in this process (version counter) repacks by itself; a write the sampler cannot see (another
    process through shared memory, simulated by writing through a numpy view) needs ``weights_changed``."""
    target, other = tiny_llama(seed=0), tiny_llama(seed=1)
    prompts = random_prompts([8, 15])
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = make(other, packed_weights=False).generate(prompts, params)
    sampler = make(target)
    before = sampler.generate(prompts, params)
    assert sampler.packed.nbytes > 0 and [o.token_ids for o in before] != [o.token_ids for o in want]
    with torch.no_grad():
        for p, q in zip(target.parameters(), other.parameters()):
            p.copy_(q)
    assert [o.token_ids for o in sampler.generate(prompts, params)] == [o.token_ids for o in want]

    sampler = make(tiny_llama(seed=0))
    sampler.generate(prompts, params)
    for p, q in zip(sampler.model.parameters(), other.parameters()):
        p.detach().numpy()[...] = q.detach().numpy()  # bypasses the version counter
    sampler.weights_changed()
    assert sampler.packed.nbytes == 0
    after = sampler.generate(prompts, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in want]
    for x, y in zip(after, want):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def _tiny_longrope(switch: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    half = 64 // 4 // 2  # head_dim / 2 factors
    cfg = AutoConfig.for_model(
        "phi3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * switch,
        original_max_position_embeddings=switch,
        initializer_range=0.2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * half,
            "long_factor": [4.0] * half,
            "original_max_position_embeddings": switch,
        },
    )
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_longrope_models_match_below_the_switch_and_are_refused_past_it() -> None:
    """Phi-3-style longrope picks short or long RoPE factors per forward call from the largest position: a sequence
    that crosses the switch was sampled with short-factor keys that a whole-sequence forward computes with long ones
    (log-probs off by ~6.7 nats in this model). Below it the sampler matches a forward pass; past it, a clear error."""
    from rl_tpu.sampler.engine import longrope_switch_length

    model = _tiny_longrope(48)
    assert longrope_switch_length(model.config) == 48 and longrope_switch_length(tiny_llama().config) is None
    prompts = random_prompts([5, 19, 40, 11])  # 40 pads to the 64 prompt bucket on the padded path
    params = SamplingParams(temperature=0, max_new_tokens=8)  # 40 + 8 = 48: at the switch, not past it
    for kw in ({}, {"packed_prefill": False, "lean_decode": False, "packed_weights": False}):
        for i, out in enumerate(make(model, **kw).generate(prompts, params)):
            ref = reference_logprobs(model, prompts[i], out.token_ids, 0.0)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    with pytest.raises(SamplerError, match=r"49 tokens is past 48.*longrope.*<= 48"):
        make(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=9))
