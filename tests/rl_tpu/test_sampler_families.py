"""The sampler's log-probs per model family against a plain Hugging Face forward over prompt + response, greedy and
sampled, with packed prefill and lean decode each on and off; each fast path taken only where it computes the
model's numbers (tiny random models from ``tests/families.py``, prompts longer than the sliding windows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import build_tiny_model
from transformers import AutoModelForCausalLM

from rl_tpu.sampler import Sampler, SamplingParams
from rl_tpu.sampler.lean import LeanDecoder

torch.set_num_threads(1)

# family -> (lean decode taken, packed prefill taken) on CPU
FAST_PATHS = {
    "llama": (True, True),
    "qwen2": (True, True),
    "qwen3": (True, True),
    "qwen3_moe": (True, True),
    "qwen2_sliding": (False, False),
    "mistral": (False, False),
    "gemma3": (False, False),
}
PARAMS = {
    "greedy": SamplingParams(n=2, temperature=0, max_new_tokens=12),
    "sampled": SamplingParams(n=2, temperature=1.0, top_p=0.95, max_new_tokens=12, seed=1),
}


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    from verl_backend.models import ensure_default_model

    return ensure_default_model()


_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(autouse=True)
def fallbacks_said_afresh(monkeypatch):
    """The sampler says each fast-path fallback once per process; each test here reads what it says itself, so an
    earlier test (this file or another) that met the same model must not have used up the line."""
    from rl_tpu.sampler import fastpaths

    monkeypatch.setattr(fastpaths, "_SAID", set())


def tiny(family: str, tokenizer_dir: Path, tmp_path_factory) -> torch.nn.Module:
    if family not in _MODELS:
        path = build_tiny_model(family, tokenizer_dir, tmp_path_factory.mktemp(family))
        _MODELS[family] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
    return _MODELS[family]


def prompts() -> list[list[int]]:
    """A 9-token common prefix (packed prefill computes it once) and 10-31-token prompts (windows are 5)."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 40000, (9,), generator=g).tolist()
    return [prefix + torch.randint(3, 40000, (n,), generator=g).tolist() for n in (3, 14, 1, 22)]


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` at ``tokens`` from one unpadded, cache-free forward over prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (new, vocab)
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def max_logprob_error(model, sampler: Sampler, params: SamplingParams) -> float:
    ps = prompts()
    outs = sampler.generate(ps, params)
    assert len(outs) == len(ps) * params.n and all(len(o.token_ids) == params.max_new_tokens for o in outs)
    return max(
        float(
            (torch.tensor(o.logprobs) - reference_logprobs(model, ps[i // params.n], o.token_ids, params.temperature))
            .abs()
            .max()
        )
        for i, o in enumerate(outs)
    )


@pytest.mark.parametrize("family", list(FAST_PATHS))
def test_sampler_logprobs_equal_a_plain_forward(family, tokenizer_dir, tmp_path_factory, capfd) -> None:
    model = tiny(family, tokenizer_dir, tmp_path_factory)
    lean_taken, packed_taken = FAST_PATHS[family]
    greedy_tokens = {}
    for packed in (True, False):
        for lean in (True, False):
            for name, params in PARAMS.items():
                sampler = Sampler(model, pad_token_id=0, eos_token_ids=[], packed_prefill=packed, lean_decode=lean)
                err = max_logprob_error(model, sampler, params)
                assert err <= 1e-4, (family, packed, lean, name, err)
                assert (sampler.lean_steps > 0) == (lean and lean_taken), (family, packed, lean)
                prefill = {(b, q) for b, q, _ in sampler.shapes_seen if q > 1}
                packed_used = all(b == 1 for b, _ in prefill)  # one unpadded sequence, not a padded batch
                assert packed_used == (packed and packed_taken), (family, packed, lean, prefill)
                if name == "greedy":
                    greedy_tokens[packed, lean] = [o.token_ids for o in sampler.generate(prompts(), params)]
    assert len({str(v) for v in greedy_tokens.values()}) == 1  # every path, the same greedy tokens
    said = capfd.readouterr().err
    if not lean_taken:  # the fallback is said in one line naming the model and the reason
        assert f"lean decode off for {type(model).__name__} (" in said
    if not packed_taken:
        assert f"packed prefill off for {type(model).__name__} (" in said


def test_a_lean_step_without_qwen3s_query_key_norms_computes_other_numbers(tokenizer_dir, tmp_path_factory) -> None:
    """Negative control: the test above would catch a lean step that skipped Qwen3's query/key norms."""
    model = tiny("qwen3", tokenizer_dir, tmp_path_factory)
    decoder = LeanDecoder(model)
    decoder.qk_norms = [(None, None)] * len(decoder.layers)
    sampler = Sampler(model, pad_token_id=0, eos_token_ids=[], packed_prefill=False)
    sampler.fast_paths.lean = lambda: decoder  # skip the decision
    assert max_logprob_error(model, sampler, PARAMS["greedy"]) > 1e-2


def test_a_model_whose_forward_differs_from_its_structure_keeps_its_forward(
    tokenizer_dir, tmp_path_factory, capfd
) -> None:
    """A Qwen3 whose first decoder layer has a forward hook (the structure is the lean step's, the computation is
    not): the probe step finds the difference, decode runs through the model's forward, the numbers stay exact."""
    from rl_tpu.sampler.lean import lean_blocker, probe_error

    path = build_tiny_model("qwen3", tokenizer_dir, tmp_path_factory.mktemp("hooked"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.model.layers[0].register_forward_hook(lambda mod, args, out: out + 0.5)
    assert lean_blocker(model) is None and probe_error(model, LeanDecoder(model)) > 1e-2
    sampler = Sampler(model, pad_token_id=0, eos_token_ids=[])
    assert max_logprob_error(model, sampler, PARAMS["sampled"]) <= 1e-4
    assert sampler.lean is None
    assert "lean decode off for Qwen3ForCausalLM (its step differs from the model's forward" in capfd.readouterr().err


def test_lean_blocker_names_what_it_cannot_compute(tokenizer_dir, tmp_path_factory) -> None:
    from rl_tpu.sampler.lean import lean_blocker

    assert "float32" in lean_blocker(tiny("llama", tokenizer_dir, tmp_path_factory).to(torch.bfloat16))
    _MODELS.pop("llama")  # cast in place: rebuilt for any later test
    gemma = tiny("gemma3", tokenizer_dir, tmp_path_factory)
    assert lean_blocker(gemma) is None  # its structure is the lean step's; its 5-token window is a per-batch matter
    assert LeanDecoder(gemma).window_blocker(5) is None
    assert LeanDecoder(gemma).window_blocker(6) == "a KV cache of 6 slots past the sliding window of 5"
    path = build_tiny_model(
        "gemma3",
        tokenizer_dir,
        tmp_path_factory.mktemp("g_cap"),
        final_logit_softcapping=30.0,
        layer_types=["full_attention"] * 3,
        sliding_window=None,
    )
    assert "soft-capping" in lean_blocker(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_window_wider_than_the_prompt_bucket_fills_then_rolls_during_decode(family, tokenizer_dir, tmp_path_factory):
    """Window 40, prompts of 5-31 tokens (bucket 32), 30 new tokens: the static sliding-window cache is written in
    place during the first decode steps, then rolls; the log-probs stay the plain forward's."""
    path = build_tiny_model(family, tokenizer_dir, tmp_path_factory.mktemp(f"{family}_w40"), sliding_window=40)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (12, 23, 31, 5)]
    for params in (
        SamplingParams(n=2, temperature=0, max_new_tokens=30),
        SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=1),
    ):
        sampler = Sampler(model, pad_token_id=0, eos_token_ids=[])
        for i, o in enumerate(sampler.generate(ps, params)):
            ref = reference_logprobs(model, ps[i // 2], o.token_ids, params.temperature)
            assert float((torch.tensor(o.logprobs) - ref).abs().max()) <= 1e-4
        assert {c for _, _, c in sampler.shapes_seen} == {64}  # 32 prompt + 32 generation slots > the window


@pytest.mark.parametrize("family", list(FAST_PATHS))
def test_the_decode_attention_kernel_keeps_each_familys_numbers(family, tokenizer_dir, tmp_path_factory) -> None:
    """At head width 64 (the families' tests above use 16, which the kernel does not take) the CPU sampler's decode
    attention is rl-tpu's kernel (:mod:`rl_tpu.sampler.panel_kernel`), through the lean step or, for the windowed
    families, through the model's own forward with their sliding-window masks: log-probs equal a plain forward."""
    from torch.profiler import profile

    from rl_tpu.sampler import panel_kernel

    if panel_kernel.backend() != "panel":
        pytest.skip("rl-tpu's CPU kernels are not built here (no AVX-512 CPU or no C++ compiler)")
    extra = {"query_pre_attn_scalar": 64} if family == "gemma3" else {}
    path = build_tiny_model(family, tokenizer_dir, tmp_path_factory.mktemp(f"{family}64"), head_dim=64, **extra)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    sampler = Sampler(model, pad_token_id=0, eos_token_ids=[])
    with profile() as prof:
        err = max_logprob_error(model, sampler, PARAMS["greedy"])
    calls = sum(e.count for e in prof.key_averages() if e.key == "rl_tpu_kernels::decode_attention")
    assert calls >= model.config.num_hidden_layers * (PARAMS["greedy"].max_new_tokens - 1), (family, calls)
    assert err <= 1e-4, (family, err)
    assert (sampler.lean_steps > 0) == FAST_PATHS[family][0]


WINDOWED = ["gemma3", "mistral", "qwen2_sliding"]


def _wide(family: str, tokenizer_dir: Path, tmp_path_factory, window: int = 64) -> torch.nn.Module:
    key = f"{family}_w{window}"
    if key not in _MODELS:
        path = build_tiny_model(family, tokenizer_dir, tmp_path_factory.mktemp(key), sliding_window=window)
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
    return _MODELS[key]


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_layers_within_the_window_take_both_fast_paths(family, tokenizer_dir, tmp_path_factory, capfd):
    """Window 64, prompts of 10-31 tokens (bucket 32) and 12 new tokens (bucket 16): a 48-slot cache inside the
    window, where a sliding layer attends as a full one. Packed prefill and lean decode (Gemma 3's four norms and
    two RoPE bases included) are taken and give the plain forward's log-probs, and every path the same greedy
    tokens."""
    model = _wide(family, tokenizer_dir, tmp_path_factory)
    greedy = {}
    for packed in (True, False):
        for lean in (True, False):
            for name, params in PARAMS.items():
                sampler = Sampler(model, pad_token_id=0, eos_token_ids=[], packed_prefill=packed, lean_decode=lean)
                err = max_logprob_error(model, sampler, params)
                assert err <= 1e-4, (family, packed, lean, name, err)
                assert {c for _, q, c in sampler.shapes_seen if q == 1} == {48}  # decode steps' KV cache slots
                assert (sampler.lean_steps > 0) == lean, (family, packed, lean)
                prefill = {(b, q) for b, q, _ in sampler.shapes_seen if q > 1}
                assert all(b == 1 for b, _ in prefill) == packed, (family, packed, lean, prefill)
                if name == "greedy":
                    greedy[packed, lean] = [o.token_ids for o in sampler.generate(prompts(), params)]
    assert len({str(v) for v in greedy.values()}) == 1
    said = capfd.readouterr().err
    assert "lean decode off" not in said and "packed prefill off" not in said


@pytest.mark.parametrize("family", WINDOWED)
def test_a_cache_past_the_window_keeps_the_models_forward_and_says_why(family, tokenizer_dir, tmp_path_factory, capfd):
    """Window 40 against a 48-slot cache: both fast paths step aside for the batch, in one line each naming the
    window, and the log-probs stay the plain forward's."""
    model = _wide(family, tokenizer_dir, tmp_path_factory, window=40)
    sampler = Sampler(model, pad_token_id=0, eos_token_ids=[])
    assert max_logprob_error(model, sampler, PARAMS["sampled"]) <= 1e-4
    assert sampler.lean is not None and sampler.lean_steps == 0
    assert all(b > 1 for b, q, _ in sampler.shapes_seen if q > 1)  # padded prefill
    said = capfd.readouterr().err
    name = type(model).__name__
    assert f"lean decode off for {name} (a KV cache of 48 slots past the sliding window of 40)" in said
    assert f"packed prefill off for {name} (a KV cache of 48 slots past the sliding window of 40)" in said


def test_a_lean_step_without_gemmas_sandwich_norms_computes_other_numbers(tokenizer_dir, tmp_path_factory) -> None:
    """Negative control: the test above would catch a lean step that read Gemma's block as Llama's (no norm after
    the attention or the MLP), or that used one RoPE base for both layer types."""
    model = _wide("gemma3", tokenizer_dir, tmp_path_factory)
    for spoil in ("sandwich", "rope"):
        decoder = LeanDecoder(model)
        if spoil == "sandwich":
            decoder.sandwich = [None] * len(decoder.layers)
        else:
            decoder.rope_types = ["sliding_attention"] * len(decoder.layers)
        sampler = Sampler(model, pad_token_id=0, eos_token_ids=[], packed_prefill=False)
        sampler.fast_paths.lean = lambda d=decoder: d  # skip the decision
        assert max_logprob_error(model, sampler, PARAMS["greedy"]) > 1e-2, spoil
