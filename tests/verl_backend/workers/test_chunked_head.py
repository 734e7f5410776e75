"""The chunked LM head (``rl_tpu.logits_chunk_mib``) computes each model family's own numbers: log-probs, entropy and
gradients equal a plain Hugging Face forward of every sequence on its own, with chunks small enough that every micro
batch takes several; a model whose logits are not its head's plain linear map is found and keeps the whole logits."""

from __future__ import annotations

import pytest
import torch
from families import build_tiny_model, tiny_config
from test_shared_prefix import _group_batch, _plain_forward, _weights

pytest.importorskip("verl")

FAMILIES = ["llama", "qwen3", "gemma3", "mistral", "qwen2_sliding", "qwen3_moe"]


def _chunked_forward(model, td, chunk_tokens: int, shared: bool):
    """The engine's chunked path: the head passed through for one forward, then VeRL's FusedLinearForPPO in chunks."""
    from verl_backend.workers.response_logits import HeadPassThrough, chunked_response_log_probs, response_logit_indices
    from verl_backend.workers.shared_prefix import attention_kinds, shared_prefix_inputs

    model.zero_grad(set_to_none=True)
    keep = response_logit_indices(td)
    if shared:
        inputs, row_keep = shared_prefix_inputs(td, attention_kinds(model), torch.float32)
    else:
        inputs = {
            "input_ids": td["input_ids"].values().unsqueeze(0),
            "position_ids": td["position_ids"].values().unsqueeze(0),
        }
        row_keep = keep
    head = HeadPassThrough(model.get_output_embeddings())
    head.arm()
    hidden = model(**inputs, use_cache=False, logits_to_keep=row_keep).logits
    assert "forward" not in head.head.__dict__  # the pass-through removed itself
    labels = torch.roll(td["input_ids"].values(), shifts=-1)
    out = chunked_response_log_probs(
        hidden, head.head.weight, labels, 1.0, keep, td["input_ids"].offsets(), chunk_tokens, entropy=True
    )
    lp, ent = out["log_probs"].values()[keep], out["entropy"].values()[keep]
    (lp * _weights(lp.numel())).sum().backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shared", [False, True])
def test_chunked_head_equals_each_sequence_alone(tmp_path, default_model_dir, family, shared):
    """Chunks of 4 tokens over 26 response tokens: 7 chunks, the last one short."""
    from transformers import AutoModelForCausalLM

    from verl_backend.workers.response_logits import HeadPassThrough

    path = build_tiny_model(family, default_model_dir, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    assert HeadPassThrough(model.get_output_embeddings()).exact_for(model, model.config.vocab_size) is None
    td, prompts, responses = _group_batch()
    lp_want, ent_want, grad_want = _plain_forward(model, prompts, responses)
    lp, ent, grad = _chunked_forward(model, td, chunk_tokens=4, shared=shared)
    assert (lp - lp_want).abs().max() <= 1e-4 and (ent - ent_want).abs().max() <= 1e-4
    assert grad.keys() == grad_want.keys()  # the head's (or the tied embedding's) gradient included
    for name, want in grad_want.items():
        rel = (grad[name] - want).norm() / want.norm().clamp(min=1e-12)
        assert rel <= 1e-4, (name, float(rel))


def test_a_soft_capped_head_is_found_and_would_have_given_other_numbers():
    """Negative control: Gemma 2's final-logit soft-cap sits after the head. The probe names it; the same model
    without the cap passes, and with the cap the head's linear map of its inputs is measurably off the logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from verl_backend.workers.response_logits import HeadPassThrough

    torch.manual_seed(0)
    shape = {k: v for k, v in tiny_config("llama").to_dict().items() if k in ("hidden_size", "intermediate_size")}
    capped = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            final_logit_softcapping=0.5,  # small, so the cap bends every logit
            **shape,
        )
    )
    head = HeadPassThrough(capped.get_output_embeddings())
    reason = head.exact_for(capped, 128)
    assert reason is not None and "soft-cap" in reason
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = capped(input_ids=ids).logits
        head.arm()
        mapped = capped(input_ids=ids).logits @ capped.lm_head.weight.t()
    assert (mapped - want).abs().max() > 0.1
    capped.config.final_logit_softcapping = None
    assert head.exact_for(capped, 128) is None


def test_a_head_with_a_bias_or_an_adapter_is_refused():
    from transformers import LlamaForCausalLM

    from verl_backend.workers.response_logits import HeadPassThrough

    model = LlamaForCausalLM(tiny_config("llama"))
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(128))
    assert "bias" in HeadPassThrough(model.lm_head).exact_for(model, 128)
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False))
    assert "not a plain Linear" in HeadPassThrough(model.lm_head).exact_for(model, 128)


def test_an_armed_head_left_by_a_failed_forward_is_cleared():
    from transformers import LlamaForCausalLM

    from verl_backend.workers.response_logits import HeadPassThrough

    model = LlamaForCausalLM(tiny_config("llama"))
    head = HeadPassThrough(model.lm_head)
    head.arm()
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == 64  # passed through once
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == 128  # then the head again
    head.arm()  # armed, and the forward never reached the head
    head.clear()
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == 128
    assert set(model.state_dict()) == set(LlamaForCausalLM(tiny_config("llama")).state_dict())


@pytest.mark.parametrize("vocab,mib,want", [(262_144, 128, 128), (49_152, 128, 682), (262_144, 0, 0), (10**9, 1, 1)])
def test_chunk_tokens_fit_the_budget(vocab, mib, want):
    from verl_backend.workers.response_logits import logits_chunk_tokens

    got = logits_chunk_tokens(vocab, mib)
    assert got == want
    assert got == 0 or got == 1 or got * vocab * 4 <= mib << 20 < (got + 1) * vocab * 4


@pytest.mark.parametrize("want_entropy", [False, True])
def test_the_chunked_function_has_the_gradients_of_its_math(want_entropy):
    """float64 gradcheck of both outputs (log-probs and entropy) against finite differences, chunks of 2 over 5
    tokens at temperature 0.7."""
    from verl_backend.workers.response_logits import ChunkedHeadLogProbs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.tensor([0, 6, 3, 3, 1])

    def f(h, w):
        lp, ent = ChunkedHeadLogProbs.apply(h, w, labels, 0.7, 2, want_entropy)
        return (lp, ent) if want_entropy else lp

    assert torch.autograd.gradcheck(f, (hidden, weight))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_chunked_function_equals_verls_fused_linear_and_the_whole_logits(dtype, tol):
    """Against VeRL's own FusedLinearForPPO and the whole-logits path (log-softmax and entropy of all the logits),
    values and the gradients of a loss over both outputs; bf16 within its rounding."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    from verl_backend.workers.response_logits import ChunkedHeadLogProbs

    g = torch.Generator().manual_seed(1)
    h0 = torch.randn(37, 16, generator=g).to(dtype)
    w0 = (torch.randn(300, 16, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, 300, (37,), generator=g)
    a, b = torch.linspace(0.5, 1.5, 37), torch.linspace(-0.3, 0.2, 37)

    def run(fn):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = fn(h, w)
        ((lp.float() * a).sum() + (ent.float() * b).sum()).backward()
        return lp.float().detach(), ent.float().detach(), h.grad.float(), w.grad.float()

    def whole(h, w):
        lsm = ((h @ w.t()) / 0.7).float().log_softmax(-1)
        return lsm.gather(-1, labels[:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)

    ours = run(lambda h, w: ChunkedHeadLogProbs.apply(h, w, labels, 0.7, 8, True))
    for ref in (run(lambda h, w: FusedLinearForPPO(chunk_size=8)(h, w, labels, 0.7)), run(whole)):
        for got, want in zip(ours, ref):
            assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), (got - want).abs().max()
