"""Weight sync of a mixture of experts whose experts transformers holds fused (3-D), sent per expert as VeRL 0.9.1
exports them (``unfuse_moe_params``), through 1 MiB buckets with expert tensors larger than a bucket, and through
shared memory: afterwards the rollout's weights and log-probs are the trainer's."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rl_tpu.collectives import iter_buckets, pack_bucket, unpack_bucket
from rl_tpu.sampler import Sampler, SamplingParams
from rl_tpu.shared_weights import SharedWeights, SharedWeightsError, SharedWeightsWriter, shared_memory_supported

torch.set_num_threads(1)
BUCKET = 1 << 20  # 1 MiB
VOCAB = 128


def tiny_moe(seed: int) -> Qwen3MoeForCausalLM:
    """2 layers of 4 experts; each expert's gate/up/down matrix is (1088, 256) float32 = 1.06 MiB, the fused
    ``gate_up_proj`` 8.5 MiB: both larger than a bucket."""
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=1088,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return model


def verl_export(model) -> list[tuple[str, torch.Tensor]]:
    """The actor's weights as VeRL 0.9.1's FSDP engine sends them to a rollout: experts unfused, per expert."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    return list(unfuse_moe_params(model.state_dict().items(), "qwen3_moe"))


def max_logprob_gap(rollout: Sampler, trainer) -> float:
    """Greedy completions from the rollout, scored by the trainer's own forward: max |log-prob difference|."""
    prompts = [[5, 9, 17, 33, 4, 71], [12, 3, 88, 40]]
    gap = 0.0
    for prompt, out in zip(prompts, rollout.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))):
        with torch.no_grad():
            logits = trainer(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        gap = max(gap, float((torch.tensor(out.logprobs) - ref).abs().max()))
    return gap


def test_per_expert_tensors_larger_than_a_bucket_sync_into_fused_experts() -> None:
    trainer, rollout_model = tiny_moe(0), tiny_moe(1)
    rollout = Sampler(rollout_model, pad_token_id=0, eos_token_ids=[])
    assert max_logprob_gap(rollout, trainer) > 1e-2  # different weights: the check below can fail
    sent = verl_export(trainer)
    assert any(n.endswith("experts.0.up_proj.weight") for n, _ in sent)  # per expert, not the model's fused names
    assert "model.layers.0.mlp.experts.gate_up_proj" in rollout_model.state_dict()
    staging = torch.empty(BUCKET + (1 << 20), dtype=torch.uint8)  # as the rollout adapter packs
    buckets = list(iter_buckets(sent, BUCKET))
    alone = [b for b in buckets if len(b) == 1 and b[0][1].nbytes > BUCKET]
    assert alone and all(".experts." in b[0][0] for b in alone)  # expert tensors bigger than a bucket: own bucket
    for bucket in buckets:
        fits = sum(t.nbytes for _, t in bucket) <= BUCKET
        flat, meta = pack_bucket(bucket, out=staging if fits else None)
        rollout.load_state_dict(unpack_bucket(flat.numpy(), meta))  # as the server loads a bucket
    want = trainer.state_dict()
    for name, tensor in rollout_model.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    assert max_logprob_gap(rollout, trainer) <= 1e-4


def test_a_name_that_fits_no_fused_expert_is_refused() -> None:
    from rl_tpu.sampler import SamplerError

    rollout = Sampler(tiny_moe(1), pad_token_id=0, eos_token_ids=[])
    with pytest.raises(SamplerError, match="experts.9.up_proj"):  # 4 experts
        rollout.load_state_dict([("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(1088, 256))])
    with pytest.raises(SamplerError, match="shape"):
        rollout.load_state_dict([("model.layers.0.mlp.experts.1.down_proj.weight", torch.zeros(1088, 256))])


@pytest.mark.skipif(not shared_memory_supported(), reason="needs Linux memfd_create and /proc")
def test_per_expert_names_write_the_fused_slot_of_shared_weights() -> None:
    trainer, rollout_model = tiny_moe(0), tiny_moe(1)
    shared = SharedWeights(rollout_model)
    writer = SharedWeightsWriter(shared.handle())
    sent = verl_export(trainer)
    shared.release()  # as while the rollout sleeps: every slot must be written again
    partial = [(n, t) for n, t in sent if ".experts.3." not in n]  # one expert missing from each fused slot
    written, _ = writer.write(partial)
    with pytest.raises(SharedWeightsError, match="experts"):
        shared.mark_written(written)  # a fused slot with an expert unwritten is not complete
    written, nbytes = writer.write(sent)
    shared.mark_written(written)
    assert shared.resident and nbytes == sum(s.nbytes for s in shared.slots)
    want = trainer.state_dict()
    for name, tensor in rollout_model.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    rollout = Sampler(rollout_model, pad_token_id=0, eos_token_ids=[])
    assert max_logprob_gap(rollout, trainer) <= 1e-4
    writer.close()
