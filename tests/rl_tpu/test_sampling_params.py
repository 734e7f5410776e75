"""Repetition penalty, min tokens and the log-prob request: parity with Hugging Face's logits processors on a tiny
random Llama, on the sampler's fast paths (packed prefill, lean decode, packed weights) and its plain bucketed path;
and the request table that honours or refuses every key of a vLLM-style sampling request."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from rl_tpu.sampler import Sampler, SamplerError, SamplingParams, choose_tokens
from rl_tpu.sampler.params import DEFAULT_ONLY, HONOURED, NO_EFFECT, REQUEST_KEYS, request_params
from rl_tpu.sampler.processing import LogitsProcessors

from test_sampler import EOS, PAD, VOCAB, random_prompts, reference_logprobs, tiny_llama

torch.set_num_threads(1)

STOPS = list(range(3, 30))  # with EOS about a quarter of the vocabulary: completions end within a few tokens
ENDS = sorted({EOS, *STOPS})


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def fast(model, **kw) -> Sampler:
    """The CPU default: packed prefill, lean decode, oneDNN-packed weights, shrinking batches."""
    return Sampler(model, pad_token_id=PAD, eos_token_ids=[EOS], **kw)


def plain(model, **kw) -> Sampler:
    """What a TPU runs: left-padded bucketed prefill, the model's own forward (batches still shrink in powers of two;
    each row draws from its own stream, so sampled runs compare equal whatever the batch sizes)."""
    return Sampler(
        model,
        pad_token_id=PAD,
        eos_token_ids=[EOS],
        packed_prefill=False,
        lean_decode=False,
        packed_weights=False,
        **kw,
    )


def hf_processors(prompt_len: int, penalty: float, min_tokens: int, temperature: float) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty))
    if min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, min_tokens, ENDS))
    if temperature > 0:
        procs.append(TemperatureLogitsWarper(temperature))
    return procs


# ------------------------------------------------------------------------------------------- the processors
@pytest.mark.parametrize("penalty", [1.7, 0.6], ids=["discourage", "encourage"])
def test_processors_equal_hf_logits_processors(penalty: float) -> None:
    """Rows of different prompt lengths (left-padded), at several generated counts: our batched processors give
    HF's RepetitionPenalty + MinNewTokensLength processors' scores bit for bit, row by row."""
    g = torch.Generator().manual_seed(0)
    prompts = random_prompts([3, 9, 1, 6], seed=1)
    width = max(map(len, prompts))
    ids = torch.full((4, width), PAD)
    mask = torch.zeros((4, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    procs = LogitsProcessors.build(penalty, 3, ids, mask, torch.tensor(ENDS), VOCAB)
    history = [list(p) for p in prompts]
    for t in range(5):
        logits = torch.randn((4, VOCAB), generator=g) * 3
        ours = procs(logits, t)
        for i, row in enumerate(history):
            ref = hf_processors(len(prompts[i]), penalty, 3, 0)(torch.tensor([row]), logits[i : i + 1].clone())
            assert torch.equal(ours[i], ref[0]), f"row {i} step {t}"
        assert torch.isinf(ours[:, ENDS]).all() == (t < 3)
        tok = torch.randint(0, VOCAB, (4,), generator=g)
        procs.chose(tok)
        for i in range(4):
            history[i].append(int(tok[i]))
    assert LogitsProcessors.build(1.0, 0, ids, mask, torch.tensor(ENDS), VOCAB) is None  # off: nothing built


# ------------------------------------------------------------------------------------------- greedy path
@pytest.mark.parametrize("build", [fast, plain], ids=["fast-path", "plain-path"])
def test_greedy_with_processors_matches_hf_generate(model, build) -> None:
    prompts = random_prompts([4, 11, 23, 7], seed=2)
    params = SamplingParams(
        temperature=0, max_new_tokens=14, repetition_penalty=1.6, min_tokens=5, stop_token_ids=STOPS
    )
    sampler = build(model)
    outs = sampler.generate(prompts, params)
    if build is fast:
        assert sampler.lean is not None and sampler.packed is not None, "the fast paths did not engage"
    for prompt, out in zip(prompts, outs):
        hf = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=14,
            do_sample=False,
            repetition_penalty=1.6,
            min_new_tokens=5,
            pad_token_id=PAD,
            eos_token_id=ENDS,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == hf
        assert len(out.token_ids) >= 5 and not set(ENDS) & set(out.token_ids[:4])
        # the log-prob stays the model's, not the penalised distribution's
        torch.testing.assert_close(
            torch.tensor(out.logprobs), reference_logprobs(model, prompt, out.token_ids, 0), atol=1e-4, rtol=0
        )
    # the processors changed something: without them completions are shorter and other tokens are chosen
    off = build(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=14, stop_token_ids=STOPS))
    assert min(len(o.token_ids) for o in off) < 5
    assert [o.token_ids for o in off] != [o.token_ids for o in outs]


def test_repetition_penalty_alone_matches_hf_generate(model) -> None:
    """No stop tokens: long completions, where a random model repeats itself and the penalty bites."""
    prompts = random_prompts([6, 15], seed=4)
    outs = fast(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, repetition_penalty=1.3))
    base = fast(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=24))
    for prompt, out, b in zip(prompts, outs, base):
        hf = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == hf
        assert len(set(out.token_ids)) >= len(set(b.token_ids))  # fewer repeats than without the penalty
    assert [o.token_ids for o in outs] != [b.token_ids for b in base]


# ------------------------------------------------------------------------------------------- sampled path
@pytest.mark.parametrize("build", [fast, plain], ids=["fast-path", "plain-path"])
@pytest.mark.parametrize("top_k", [-1, 20])
def test_sampled_with_processors_matches_hf_processors_step_by_step(model, build, top_k: int) -> None:
    """One prompt per call: the tokens are those drawn, with the row's own uniforms (rl_tpu.sampler.seeds: sample 0
    of prompt 0 of seed s), from HF's RepetitionPenalty, MinNewTokensLength and Temperature processors applied to a
    cache-free forward."""
    from rl_tpu.sampler.seeds import row_uniforms, sample_seed

    new, temp, penalty, min_tokens = 12, 0.8, 1.4, 4
    for seed, prompt in enumerate(random_prompts([5, 13, 8], seed=5)):
        params = SamplingParams(
            temperature=temp,
            top_k=top_k,
            max_new_tokens=new,
            repetition_penalty=penalty,
            min_tokens=min_tokens,
            stop_token_ids=STOPS,
            seed=seed,
        )
        out = build(model).generate([prompt], params)[0]
        u, row, want = row_uniforms([sample_seed(seed, 0, 0)], new)[0], list(prompt), []
        procs = hf_processors(len(prompt), penalty, min_tokens, temp)
        for t in range(new):
            with torch.no_grad():
                logits = model(torch.tensor([row])).logits[:, -1].float()  # (1, vocab)
            scores = procs(torch.tensor([row]), logits)
            tok, _ = choose_tokens(
                scores, temperature=1.0, top_k=top_k, top_p=1.0, generator=None, uniforms=u[t : t + 1]
            )
            want.append(int(tok))
            row.append(int(tok))
            if int(tok) in ENDS:
                break
        assert out.token_ids == want, f"seed {seed}"
        assert len(out.token_ids) >= min_tokens
        torch.testing.assert_close(
            torch.tensor(out.logprobs), reference_logprobs(model, prompt, want, temp), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_fast_paths_equal_plain_path_with_processors(model, temperature: float) -> None:
    """Prompts sharing a prefix, n samples each, rows finishing at different steps (the fast path shrinks the
    batch): packed prefill + lean decode + packed weights give the bucketed plain path's tokens and log-probs."""
    prefix = random_prompts([8], seed=7)[0]
    prompts = [prefix + p for p in random_prompts([2, 12, 5, 20], seed=8)]
    params = SamplingParams(
        n=2,
        temperature=temperature,
        top_p=0.95,
        max_new_tokens=16,
        repetition_penalty=1.5,
        min_tokens=3,
        stop_token_ids=STOPS,
        seed=3,
    )
    sampler = fast(model)
    a = sampler.generate(prompts, params)
    b = plain(model, prompt_buckets=(32, 64), gen_buckets=(16,)).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    assert len({len(o.token_ids) for o in a}) > 1 and min(len(o.token_ids) for o in a) >= 3
    assert min(batch for batch, q, _ in sampler.shapes_seen if q == 1) < 8, "the batch never shrank"


@pytest.mark.parametrize("procs", [{}, {"repetition_penalty": 1.2, "min_tokens": 2}], ids=["plain", "processors"])
def test_logprobs_off_returns_none_and_the_same_tokens(model, procs) -> None:
    prompts = random_prompts([5, 9], seed=9)
    for temperature in (0.0, 1.0):
        on = fast(model).generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=8, seed=1, **procs))
        off = fast(model).generate(
            prompts, SamplingParams(temperature=temperature, max_new_tokens=8, seed=1, logprobs=False, **procs)
        )
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert all(o.logprobs is None for o in off) and all(len(o.logprobs) == len(o.token_ids) for o in on)


# ------------------------------------------------------------------------------------------- the request table
def test_request_params_honours_every_sampling_key() -> None:
    got = request_params(
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "max_tokens": 99,
            "stop_token_ids": [7, 5, 7],
            "repetition_penalty": 1.1,
            "min_tokens": 3,
            "logprobs": True,
            "seed": 4,
            "detokenize": False,
            "skip_special_tokens": False,
            "presence_penalty": 0.0,
            "n": 1,
            "stop": None,
            "ignore_eos": False,
        },
        max_tokens=64,
    )
    assert got == SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        max_new_tokens=64,
        stop_token_ids=(5, 7),
        repetition_penalty=1.1,
        min_tokens=3,
        logprobs=True,
        seed=4,
    )
    # VeRL's agent loop request; SGLang's names; vLLM's top_k=0; logprobs as VeRL's vLLM adapter reads it
    verl = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    assert request_params(verl, max_tokens=32) == SamplingParams(max_new_tokens=32, logprobs=False)
    sglang = request_params({"max_new_tokens": 5, "min_new_tokens": 2, "top_k": 0, "logprobs": 1}, max_tokens=32)
    assert (sglang.max_new_tokens, sglang.min_tokens, sglang.top_k, sglang.logprobs) == (5, 2, -1, True)
    assert request_params({"max_tokens": 0}, max_tokens=32).max_new_tokens == 1  # a resumed, spent budget
    assert hash(request_params(verl, max_tokens=32)) == hash(request_params(dict(verl), max_tokens=32))


@pytest.mark.parametrize(
    "key,value",
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.2),
        ("min_p", 0.05),
        ("ignore_eos", True),
        ("n", 4),
        ("stop", ["\n\n"]),
        ("prompt_logprobs", 0),
        ("logit_bias", {3: 1.0}),
        ("bad_words", ["x"]),
        ("structured_outputs", {"json": {}}),
        ("typical_p", 0.9),
    ],
)
def test_request_params_refuses_what_it_cannot_honour(key, value) -> None:
    with pytest.raises(SamplerError) as err:
        request_params({"temperature": 1.0, key: value}, max_tokens=16)
    msg = str(err.value)
    assert "\n" not in msg and f"{key}={value!r}" in msg and "repetition_penalty, min_tokens" in msg
    request_params(
        {"temperature": 1.0, key: None if key == "typical_p" else REQUEST_KEYS[key][1][0]}, max_tokens=16
    )  # at its default it passes


def test_request_table_is_complete_and_values_are_checked() -> None:
    kinds = {k: how for k, (how, _) in REQUEST_KEYS.items()}
    assert {k for k, how in kinds.items() if how == HONOURED} >= {
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "repetition_penalty",
        "min_tokens",
        "logprobs",
        "stop_token_ids",
    }
    assert all(neutral for k, (how, neutral) in REQUEST_KEYS.items() if how == DEFAULT_ONLY)
    assert kinds["detokenize"] == NO_EFFECT
    for bad in ({"repetition_penalty": 0.0}, {"min_tokens": 9, "max_tokens": 4}, {"top_p": 0.0}):
        with pytest.raises(SamplerError, match=next(iter(bad))):
            request_params(bad, max_tokens=16)
