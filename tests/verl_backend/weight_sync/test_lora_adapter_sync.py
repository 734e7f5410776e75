"""Adapter-only LoRA weight sync: the trainer sends A, B and the scaling per adapted matrix
(:func:`verl_backend.weight_sync.lora.lora_adapter_payload`); the rollout merges them onto the base weights it reads
from the model's own files (:class:`verl_backend.weight_sync.lora.AdapterMerger`). The merged tensors are bitwise the
trainer-side merge's (:func:`merged_lora_weights`), the payload is the adapter's bytes, and what cannot be merged that
way is refused in one line."""

from __future__ import annotations

import pytest
import torch
from families import build_tiny_model
from transformers import AutoModelForCausalLM

from rl_tpu.collectives import iter_buckets, pack_bucket, unpack_bucket
from rl_tpu.sampler import Sampler
from verl_backend.weight_sync.lora import (
    AdapterMerger,
    SafetensorsBase,
    adapter_bytes,
    is_payload,
    lora_adapter_payload,
    merged_lora_weights,
)

torch.set_num_threads(1)


def _trainer(path, seed: int = 1, **lora):
    """A peft-wrapped fp32 model of ``path`` with non-zero B (as after training moved the adapter)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", **lora}
    trainer = get_peft_model(model, LoraConfig(**config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.05)
    return trainer.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # llama: tied embeddings
def family(request, tmp_path_factory, default_model_dir):
    path = build_tiny_model(request.param, default_model_dir, tmp_path_factory.mktemp(request.param))
    return request.param, path


def _receive(trainer, path, bucket_bytes: int = 1 << 14) -> tuple[dict[str, torch.Tensor], AdapterMerger]:
    """The payload through small object-store buckets (A, B and scaling split across them), merged on receipt."""
    merger = AdapterMerger(SafetensorsBase(str(path)))
    got = {}
    for bucket in iter_buckets(lora_adapter_payload(trainer), bucket_bytes):
        flat, meta = pack_bucket(bucket)
        got.update(merger(unpack_bucket(flat.numpy(), meta)))
    assert sorted(merger.finish()) == sorted(got)
    return got, merger


def test_payload_is_the_adapters_bytes(family) -> None:
    name, path = family
    trainer = _trainer(path)
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    payload = list(lora_adapter_payload(trainer))
    assert all(is_payload(n) for n, _ in payload)
    matrices = len([n for n, _ in payload if "@lora_scaling/" in n])
    assert matrices == 7 * trainer.get_base_model().config.num_hidden_layers  # q k v o gate up down
    nbytes = sum(t.numel() * t.element_size() for _, t in payload)
    assert nbytes == adapter_bytes(trainer) + 8 * matrices  # A and B, plus one float64 scaling each
    merged_bytes = sum(t.numel() * t.element_size() for _, t in merged_lora_weights(trainer))
    assert nbytes < merged_bytes / 4
    for n, p in trainer.named_parameters():  # the module is left as it was
        assert torch.equal(p, before[n]), n


def test_merged_on_the_receiver_is_bitwise_the_trainers_merge(family) -> None:
    name, path = family
    trainer = _trainer(path)
    want = dict(merged_lora_weights(trainer))
    got, _ = _receive(trainer, path)
    assert got and set(got) <= set(want)
    base = SafetensorsBase(str(path))
    for hf, tensor in got.items():
        assert tensor.dtype == want[hf].dtype
        assert torch.equal(tensor, want[hf]), hf  # bitwise
        assert not torch.equal(tensor, base.get(hf)), hf  # the adapter moved it
    for hf, tensor in want.items():  # what is not sent is the base, as the rollout loaded it from the files
        if hf not in got and base.get(hf) is not None:
            assert torch.equal(tensor, base.get(hf)), hf


def test_a_rollout_sampler_takes_the_merge_and_can_be_rewritten_whole(family) -> None:
    """Into a sampler: the adapted matrices and, for a rollout that released its pages, the unadapted base too; its
    weights are then every tensor of the trainer-side merge."""
    name, path = family
    trainer = _trainer(path)
    want = dict(merged_lora_weights(trainer))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    rollout = Sampler(model, pad_token_id=0, eos_token_ids=[])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # as after SharedWeights.release()
    merger = AdapterMerger(SafetensorsBase(str(path)))
    rollout.load_state_dict(merger(lora_adapter_payload(trainer)))
    rollout.load_state_dict(merger.unadapted())
    merger.finish()
    for hf, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[hf]), hf


def test_negative_control_a_wrong_scaling_differs(family) -> None:
    name, path = family
    trainer = _trainer(path)
    want = dict(merged_lora_weights(trainer))
    merger = AdapterMerger(SafetensorsBase(str(path)))

    def doubled(stream):
        for n, t in stream:
            yield n, (t * 2 if "@lora_scaling/" in n else t)

    got = dict(merger(doubled(lora_adapter_payload(trainer))))
    assert got and all(not torch.equal(t, want[hf]) for hf, t in got.items())


def test_a_cut_stream_is_refused_naming_the_matrix(family) -> None:
    name, path = family
    trainer = _trainer(path)
    merger = AdapterMerger(SafetensorsBase(str(path)))
    payload = list(lora_adapter_payload(trainer))
    list(merger(payload[:-1]))  # the last scaling never arrives
    with pytest.raises(ValueError, match=r"down_proj.weight' missing its scaling"):
        merger.finish()


def test_tied_embeddings_with_an_embedding_adapter_are_refused(tmp_path, default_model_dir) -> None:
    """LoRA on a tied embed_tokens: the trainer's lm_head uses the unmerged base, a merged rollout would not."""
    path = build_tiny_model("llama", default_model_dir, tmp_path / "llama")
    trainer = _trainer(path, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="tied to .*lm_head.*target_modules"):
        next(lora_adapter_payload(trainer))


def test_an_untied_embedding_adapter_merges_bitwise(tmp_path, default_model_dir) -> None:
    path = build_tiny_model("qwen3", default_model_dir, tmp_path / "qwen3")
    trainer = _trainer(path, target_modules=["q_proj", "embed_tokens"])
    want = dict(merged_lora_weights(trainer))
    got, _ = _receive(trainer, path)
    assert "model.embed_tokens.weight" in got
    for hf, tensor in got.items():
        assert torch.equal(tensor, want[hf]), hf


def test_dora_is_refused_in_one_line(tmp_path, default_model_dir) -> None:
    path = build_tiny_model("qwen3", default_model_dir, tmp_path / "qwen3")
    trainer = _trainer(path, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        next(lora_adapter_payload(trainer))


def test_moe_attention_adapters_merge_and_fused_experts_are_refused(tmp_path, default_model_dir) -> None:
    """Qwen3-MoE: adapters on attention merge bitwise (the fused experts keep their base weights, not sent). With
    ``all-linear`` peft also wraps the fused experts and the router (``ParamWrapper``): refused in one line, by the
    adapter payload and the merged sync alike (the merged sync used to drop an experts-only adapter without a word)."""
    path = build_tiny_model("qwen3_moe", default_model_dir, tmp_path / "moe")
    trainer = _trainer(path, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    want = dict(merged_lora_weights(trainer))
    got, _ = _receive(trainer, path)
    assert len(got) == 4 * 2 and not any(".experts." in n for n in got)
    for hf, tensor in got.items():
        assert torch.equal(tensor, want[hf]), hf
    for lora in ({}, {"target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj"]}):
        wrapped = _trainer(path, **lora)
        for sync in (lora_adapter_payload, merged_lora_weights):
            with pytest.raises(ValueError, match="ParamWrapper layer: the native rollout merges Linear and Embedding"):
                next(sync(wrapped))


def _rollout_on_files(path):
    """A LoRA trainer on ``path``, and a rollout sampler (with its model) whose adapter syncs merge onto the files."""
    from verl_backend.weight_sync import lora

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    lora.set_base_path(str(path))
    return _trainer(path), model, Sampler(model, pad_token_id=0, eos_token_ids=[])


def test_the_receive_seam_counts_the_payload_not_the_merge(family) -> None:
    """:func:`verl_backend.weight_sync.apply.load` (every transport's entry into a sampler) reports the bytes that
    arrived: the adapter's A, B and scalings, not the merged matrices it makes of them (``weight_sync/bytes``)."""
    from verl_backend.weight_sync.apply import live, load

    path = family[1]
    trainer, model, rollout = _rollout_on_files(path)
    payload = list(lora_adapter_payload(trainer))
    n = load(rollout, iter(payload), version=1)
    live(rollout, 1, written_elsewhere=False)
    assert n == sum(t.numel() * t.element_size() for _, t in payload)
    merged = dict(merged_lora_weights(trainer))
    assert n < sum(merged[k].numel() * merged[k].element_size() for k in merged if "proj" in k) / 2
    state = model.state_dict()
    assert all(torch.equal(state[k], merged[k]) for k in merged if "proj" in k)  # and it was merged in


def _mapped(path) -> int:
    """How many mappings of this process are of a file under ``path``."""
    with open("/proc/self/maps") as f:
        return sum(str(path) in line for line in f)


def test_the_files_are_unmapped_between_syncs(family) -> None:
    """The base weights' files are mapped for the merge and unmapped when the sync ends, so the pages read for it
    leave the rollout's memory (page cache only) until the next sync, which maps them again and merges the same."""
    from verl_backend.weight_sync.apply import live, load

    path = family[1]
    trainer, model, rollout = _rollout_on_files(path)
    merged = dict(merged_lora_weights(trainer))
    before = _mapped(path)  # transformers' own loads may keep theirs
    for version in (1, 2):
        stream = load(rollout, iter(list(lora_adapter_payload(trainer))), version=version)
        assert stream > 0 and _mapped(path) > before  # mapped while the sync is open
        live(rollout, version, written_elsewhere=False)
        assert _mapped(path) == before
        state = model.state_dict()
        assert all(torch.equal(state[k], merged[k]) for k in merged if "proj" in k)
