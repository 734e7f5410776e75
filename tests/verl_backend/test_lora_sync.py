"""LoRA weight sync: the merged model's weights (base + scaling * B @ A, per tensor, trainer's dtype, module left
as it was) loaded into the native sampler give the log-probs of the trainer's peft forward."""

from __future__ import annotations

import pytest
import torch
from families import build_tiny_model
from transformers import AutoModelForCausalLM

from rl_tpu.sampler import Sampler, SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir):
    """(peft-wrapped trainer model with non-zero adapters, a fresh base model for the rollout)."""
    from peft import LoraConfig, get_peft_model

    path = build_tiny_model("qwen3", default_model_dir, tmp_path_factory.mktemp("qwen3"))
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    trainer = get_peft_model(load(), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # as after some training: the adapter moves the model
    return trainer.eval(), load()


def gap(rollout: Sampler, trainer) -> float:
    """Max |log-prob| difference between the rollout's sampled tokens and the trainer's forward over them."""
    prompts = [[17, 400, 9, 2201, 33, 5, 871, 12, 99], [3000, 41, 7, 7, 150]]
    outs = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0))
    worst = 0.0
    for i, o in enumerate(outs):
        p = prompts[i // 2]
        with torch.no_grad():
            logits = trainer(input_ids=torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        worst = max(worst, float((torch.tensor(o.logprobs) - ref).abs().max()))
    return worst


def test_merged_weights_give_the_trainers_logprobs(models) -> None:
    from verl_backend.lora_sync import merged_lora_weights

    trainer, base = models
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    rollout = Sampler(base, pad_token_id=0, eos_token_ids=[])
    assert gap(rollout, trainer) > 1e-2  # base weights: the adapters change the numbers
    sent = list(merged_lora_weights(trainer))
    assert {n for n, _ in sent} == set(base.state_dict())  # the rollout model's own names, every tensor
    assert all(t.dtype == torch.float32 for _, t in sent)
    rollout.load_state_dict(sent)
    assert gap(rollout, trainer) <= 1e-4
    for n, p in trainer.named_parameters():  # the trainer's module is left as it was
        assert torch.equal(p, before[n]), n


def test_bfloat16_merged_weights_would_not_match(models) -> None:
    """Negative control: VeRL 0.9.1's merged export casts to bfloat16; a float32 rollout then samples elsewhere."""
    from verl_backend.lora_sync import merged_lora_weights

    trainer, base = models
    rollout = Sampler(base, pad_token_id=0, eos_token_ids=[])
    rollout.load_state_dict((n, t.to(torch.bfloat16)) for n, t in merged_lora_weights(trainer))
    assert gap(rollout, trainer) > 1e-3
