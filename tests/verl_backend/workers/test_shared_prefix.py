"""The shared-prefix row computes each model family's own numbers: log-probs, entropy and gradients equal a plain
Hugging Face forward of every sequence on its own (prompt + response), sliding-window layers included."""

from __future__ import annotations

import pytest
import torch
from families import build_tiny_model

pytest.importorskip("verl")


def _nested(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.long) for r in rows], layout=torch.jagged)


def _group_batch():
    """Two prompts longer than the 5-token windows, their samples interleaved, responses of 1..9 tokens."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(2)
    pa, pb = torch.randint(10, 1000, (11,), generator=g).tolist(), torch.randint(10, 1000, (7,), generator=g).tolist()
    prompts = [pa, pa, pb, pa, pb]
    responses = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (9, 1, 7, 3, 6)]
    td = TensorDict(
        {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "input_ids": _nested([p + r for p, r in zip(prompts, responses)]),
        },
        batch_size=[5],
    )
    td["position_ids"] = _nested([list(range(len(p) + len(r))) for p, r in zip(prompts, responses)])
    return td, prompts, responses


def _weights(n: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, n)  # an uneven "loss" over the response tokens


def _plain_forward(model, prompts, responses):
    """Log-probs and entropy of each response token, each sequence alone through the model; grads of the loss."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    model.zero_grad(set_to_none=True)
    lps, ents = [], []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids, use_cache=False).logits[0, len(p) - 1 : len(p) + len(r) - 1]
        lps.append(logprobs_from_logits(logits, torch.tensor(r)))
        ents.append(entropy_from_logits(logits))
    lp, ent = torch.cat(lps), torch.cat(ents)
    (lp * _weights(lp.numel())).sum().backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _shared_forward(model, td, kinds):
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from verl_backend.workers.response_logits import response_logit_indices
    from verl_backend.workers.shared_prefix import shared_prefix_inputs

    model.zero_grad(set_to_none=True)
    inputs, row_keep = shared_prefix_inputs(td, kinds, torch.float32)
    keep = response_logit_indices(td)
    logits = model(**inputs, use_cache=False, logits_to_keep=row_keep).logits[0]  # (K, vocab)
    labels = torch.roll(td["input_ids"].values(), shifts=-1)[keep]
    lp = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits(logits)
    (lp * _weights(lp.numel())).sum().backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "family,attn",
    [
        ("llama", "sdpa"),
        ("qwen3", "sdpa"),
        ("gemma3", "sdpa"),
        ("gemma3", "eager"),
        ("mistral", "sdpa"),
        ("qwen2_sliding", "sdpa"),
        ("qwen3_moe", "sdpa"),
    ],
)
def test_shared_prefix_row_equals_each_sequence_alone(tmp_path, default_model_dir, family, attn):
    from transformers import AutoModelForCausalLM

    from verl_backend.workers.shared_prefix import AttentionKinds, attention_kinds

    path = build_tiny_model(family, default_model_dir, tmp_path / family, attn_implementation=attn)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    kinds = attention_kinds(model)
    assert isinstance(kinds, AttentionKinds), kinds
    assert kinds.additive == (attn == "eager")
    td, prompts, responses = _group_batch()
    lp_want, ent_want, grad_want = _plain_forward(model, prompts, responses)
    lp, ent, grad = _shared_forward(model, td, kinds)
    assert (lp - lp_want).abs().max() <= 1e-4 and (ent - ent_want).abs().max() <= 1e-4
    assert grad.keys() == grad_want.keys()
    for name, want in grad_want.items():
        rel = (grad[name].norm() - want.norm()).abs() / want.norm().clamp(min=1e-12)
        assert rel <= 1e-4, (name, float(rel))
        torch.testing.assert_close(grad[name], want, rtol=1e-3, atol=1e-5, msg=name)


def _packed_forward(model, td, response_only: bool):
    """VeRL's own packed row (remove-padding: a copy of the prompt per sequence, ``position_ids`` restarting per
    sequence), with the LM head at every position or, with ``response_only``, only where a response token is
    predicted (``logits_to_keep``)."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from verl_backend.workers.response_logits import response_logit_indices

    model.zero_grad(set_to_none=True)
    keep = response_logit_indices(td)
    ids, pos = td["input_ids"].values().unsqueeze(0), td["position_ids"].values().unsqueeze(0)
    if response_only:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits[0]
    else:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0][keep]
    labels = torch.roll(td["input_ids"].values(), shifts=-1)[keep]
    lp, ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
    (lp * _weights(lp.numel())).sum().backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral", "qwen2_sliding", "qwen3_moe"])
def test_the_packed_row_with_and_without_response_only_logits_equals_each_sequence_alone(
    tmp_path, default_model_dir, family
):
    """The trainer's paths with the shared prefix off (``use_prefix_grouper=false``, or a model it falls back on):
    VeRL's packed row, its LM head at every position (``rl_tpu.response_only_logits=false``) or at response
    positions only, give each model family's own log-probs, entropy and gradients."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(family, default_model_dir, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    td, prompts, responses = _group_batch()
    lp_want, ent_want, grad_want = _plain_forward(model, prompts, responses)
    for response_only in (False, True):
        lp, ent, grad = _packed_forward(model, td, response_only)
        assert (lp - lp_want).abs().max() <= 1e-4 and (ent - ent_want).abs().max() <= 1e-4, response_only
        for name, want in grad_want.items():
            rel = (grad[name].norm() - want.norm()).abs() / want.norm().clamp(min=1e-12)
            assert rel <= 1e-4, (response_only, name, float(rel))


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_a_row_without_the_window_computes_other_numbers(tmp_path, default_model_dir, family):
    """Negative control: the same row with full attention where the model slides its window is measurably off, so
    the test above would catch a lost window."""
    from transformers import AutoModelForCausalLM

    from verl_backend.workers.shared_prefix import AttentionKinds, attention_kinds

    path = build_tiny_model(family, default_model_dir, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    windowed = attention_kinds(model)
    assert any(w is not None for w in windowed.windows.values())
    unwindowed = AttentionKinds(windows={k: None for k in windowed.windows})
    td, prompts, responses = _group_batch()
    lp_want, _, _ = _plain_forward(model, prompts, responses)
    lp, _, _ = _shared_forward(model, td, unwindowed)
    assert (lp - lp_want).abs().max() > 1e-2


def test_attention_the_row_cannot_express_is_refused_with_a_reason(tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    from verl_backend.workers.shared_prefix import attention_kinds

    path = build_tiny_model("gemma3", default_model_dir, tmp_path / "g")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in attention_kinds(model)
    model.config._attn_implementation = "sdpa"
    model.config.use_bidirectional_attention = True
    assert "bidirectional" in attention_kinds(model)
    model.config.use_bidirectional_attention = False
    model.config.layer_types = ["chunked_attention"] * 3
    assert "chunked_attention" in attention_kinds(model)

    class OneMask(torch.nn.Module):  # a decoder whose forward takes one mask, with layer types that differ
        def __init__(self, config):
            super().__init__()
            self.config = config

    config = Llama4TextConfig(num_hidden_layers=2, attention_chunk_size=None)
    config.layer_types = ["sliding_attention", "full_attention"]
    config.sliding_window = 4
    config._attn_implementation = "sdpa"
    assert "takes one mask" in attention_kinds(OneMask(config))
