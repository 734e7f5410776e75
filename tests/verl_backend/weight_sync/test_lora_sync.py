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
    from verl_backend.weight_sync.lora import merged_lora_weights

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
    from verl_backend.weight_sync.lora import merged_lora_weights

    trainer, base = models
    rollout = Sampler(base, pad_token_id=0, eos_token_ids=[])
    rollout.load_state_dict((n, t.to(torch.bfloat16)) for n, t in merged_lora_weights(trainer))
    assert gap(rollout, trainer) > 1e-3


def test_a_lora_checkpoint_holds_the_merged_model_and_the_adapter(models, tmp_path) -> None:
    """What VeRL saved in ``huggingface/`` (the peft model's names, which transformers would not load) is replaced by
    the merged model; ``lora_adapter/`` loads with peft onto the base model. Both give the trainer's log-probs."""
    from peft import PeftModel
    from safetensors.torch import save_file

    from verl_backend.workers.lora_checkpoint import save_lora_checkpoint

    trainer, _ = models
    hf = tmp_path / "actor" / "huggingface"
    hf.mkdir(parents=True)
    trainer.get_base_model().config.save_pretrained(hf)
    save_file({"base_model.model.model.norm.weight": torch.ones(64)}, hf / "model.safetensors")  # as VeRL leaves it
    (hf / "tokenizer_config.json").write_text('{"kept": true}')  # VeRL's tokenizer files stay
    hf_dir, adapter_dir = save_lora_checkpoint(trainer, str(tmp_path / "actor"))
    # each folder was written aside and renamed into place: nothing half-written or set aside is left
    assert sorted(p.name for p in (tmp_path / "actor").iterdir()) == ["huggingface", "lora_adapter"]
    assert (hf / "tokenizer_config.json").read_text() == '{"kept": true}'
    merged = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 40000, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trainer(input_ids=ids).logits.log_softmax(-1)
        torch.testing.assert_close(merged(ids).logits.log_softmax(-1), want, atol=1e-4, rtol=0)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)  # the base weights go in below
        plain = {
            k.replace(".base_layer", ""): v
            for k, v in trainer.get_base_model().state_dict().items()
            if "lora_" not in k
        }
        base.load_state_dict(plain)
        reloaded = PeftModel.from_pretrained(base, adapter_dir).eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits.log_softmax(-1), want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_merged_lora_checkpoint_exports_to_litert(models, tmp_path) -> None:
    """The merged ``huggingface/`` folder is an ordinary checkpoint: ``litert export`` converts and verifies it."""
    import json

    from transformers import AutoTokenizer

    pytest.importorskip("litert_torch")
    from edge_export import export_checkpoint

    from verl_backend.workers.lora_checkpoint import save_lora_checkpoint

    trainer, _ = models
    hf = tmp_path / "actor" / "huggingface"
    hf.mkdir(parents=True)
    trainer.get_base_model().config.save_pretrained(hf)
    AutoTokenizer.from_pretrained(trainer.get_base_model().config._name_or_path).save_pretrained(hf)
    hf_dir, _ = save_lora_checkpoint(trainer, str(tmp_path / "actor"))
    export_checkpoint(
        hf_dir,
        str(tmp_path / "merged.tflite"),
        quantize="none",
        prefill_lengths=(32,),
        cache_length=64,
        verify_steps=4,
        quiet=True,
    )
    report = json.loads((tmp_path / "merged.tflite.report.json").read_text())
    assert report["verification"]["passed"] is True and report["verification"]["max_abs_error"] < 1e-2
