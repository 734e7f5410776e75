"""The engine's response-only logits give the log-probs VeRL's own engine gives, on a real (tiny) model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")


def _nested(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.long) for r in rows], layout=torch.jagged)


def _micro_batch(prompts: list[list[int]], responses: list[list[int]]):
    """A micro batch in VeRL 0.9.1's no-padding layout, as its engine receives it (jagged nested tensors)."""
    from tensordict import TensorDict

    return TensorDict(
        {
            "prompts": _nested(prompts),
            "responses": _nested(responses),
            "input_ids": _nested([p + r for p, r in zip(prompts, responses)]),
        },
        batch_size=[len(prompts)],
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_only_log_probs_equal_full_logits_path(tiny_model_dir, temperature):
    from transformers import AutoModelForCausalLM
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    from verl.workers.utils.padding import build_attention_mask_from_nested

    from verl_backend.workers.response_logits import first_response_logit_position, response_log_probs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    plens, rlens = [5, 9, 7], [6, 2, 8]
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in plens]
    responses = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in rlens]
    td = _micro_batch(prompts, responses)
    nested = td["input_ids"]
    L = int(nested.offsets().diff().max())
    # what VeRL's engine feeds the model in its padded path (prepare_model_inputs, use_remove_padding=False)
    ids = torch.nested.to_padded_tensor(nested, padding=0, output_size=(3, L))
    attn = build_attention_mask_from_nested(input_ids=nested, max_seq_len=L)
    pos = torch.arange(L).expand(3, L)
    temp = torch.full((3,), temperature)

    first = first_response_logit_position(td)
    assert first == min(plens) - 1
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits / temperature
        kept = model(
            input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=L - first
        ).logits
    out = response_log_probs(kept, nested, first, temp, entropy=True)
    ours, ent = out["log_probs"], out["entropy"]
    assert ours.is_nested and ours.offsets().tolist() == nested.offsets().tolist()
    assert ent.offsets().tolist() == nested.offsets().tolist()
    for i, (p, r) in enumerate(zip(plens, rlens)):
        seq = ids[i, : p + r]
        want = logprobs_from_logits(full[i, : p + r - 1], seq[1:])  # log-prob of token t+1 at position t
        got = ours[i]
        assert got.shape == (p + r,)
        # every response token's log-prob (positions p-1 .. p+r-2) is the full-logits one
        torch.testing.assert_close(got[p - 1 : p + r - 1], want[p - 1 :], rtol=1e-5, atol=1e-5)
        assert torch.all(got[:first] == 0)  # prompt positions before the first kept logits
        torch.testing.assert_close(
            ent[i][p - 1 : p + r - 1], entropy_from_logits(full[i, p - 1 : p + r - 1]), rtol=1e-5, atol=1e-5
        )


def test_other_layouts_keep_verls_own_path():
    from tensordict import TensorDict

    from verl_backend.workers.response_logits import first_response_logit_position

    dense = TensorDict({"input_ids": torch.ones(2, 4, dtype=torch.long)}, batch_size=[2])
    assert first_response_logit_position(dense) is None
    # prompt + response lengths that do not add up to the sequence: not the layout we know
    odd = _micro_batch([[1, 2], [3]], [[4], [5, 6]])
    odd["input_ids"] = _nested([[1, 2, 4, 9], [3, 5, 6]])
    assert first_response_logit_position(odd) is None
    assert first_response_logit_position(_micro_batch([[1, 2, 3], [4, 5]], [[6], [7, 8]])) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_response_log_probs_equal_each_sequence_run_alone(tiny_model_dir, temperature):
    """Remove-padding on CPU: one packed row, sdpa with the block-diagonal mask transformers builds from the
    position ids; the kept response positions give the log-probs (and entropy) of each sequence run alone."""
    from transformers import AutoModelForCausalLM
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from verl_backend.workers.response_logits import packed_response_log_probs, response_logit_indices

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(1)
    plens, rlens = [5, 9, 7, 3], [6, 2, 8, 0]
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in plens]
    responses = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in rlens]
    td = _micro_batch(prompts, responses)
    nested = td["input_ids"]
    offsets = nested.offsets()
    keep = response_logit_indices(td)
    want_keep = [int(offsets[i]) + p - 1 + j for i, (p, r) in enumerate(zip(plens, rlens)) for j in range(r)]
    assert keep.tolist() == want_keep
    # what VeRL's engine feeds the model with use_remove_padding=True (prepare_model_inputs)
    ids = nested.values().unsqueeze(0)  # (1, total_nnz)
    pos = torch.cat([torch.arange(p + r) for p, r in zip(plens, rlens)]).unsqueeze(0)
    rolled = torch.roll(ids.squeeze(0), shifts=-1)
    temp = torch.full((ids.shape[1],), temperature)
    with torch.no_grad():
        kept = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False, logits_to_keep=keep).logits
    assert kept.shape[1] == sum(rlens)
    out = packed_response_log_probs(kept, rolled, temp, keep, offsets, entropy=True)
    assert out["log_probs"].offsets().tolist() == offsets.tolist()
    for i, (p, r) in enumerate(zip(plens, rlens)):
        seq = torch.tensor(prompts[i] + responses[i])
        with torch.no_grad():
            alone = model(input_ids=seq[None], use_cache=False).logits[0] / temperature
        got, ent = out["log_probs"][i], out["entropy"][i]
        assert got.shape == (p + r,)
        if r:  # (the last sequence has no response: nothing kept, all zeros)
            torch.testing.assert_close(
                got[p - 1 : p + r - 1], logprobs_from_logits(alone[p - 1 : p + r - 1], seq[p:]), rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(
                ent[p - 1 : p + r - 1], entropy_from_logits(alone[p - 1 : p + r - 1]), rtol=1e-5, atol=1e-5
            )
        assert torch.all(got[: p - 1] == 0) and torch.all(got[p + r - 1 :] == 0)


def test_packed_log_probs_carry_gradients_to_the_kept_positions_only(tiny_model_dir):
    from verl_backend.workers.response_logits import packed_response_log_probs

    logits = torch.randn(1, 3, 11, requires_grad=True)
    keep = torch.tensor([1, 2, 5])
    out = packed_response_log_probs(
        logits, torch.tensor([3, 4, 5, 6, 7, 8, 9]), torch.ones(7), keep, torch.tensor([0, 4, 7])
    )
    out["log_probs"].values().sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    assert out["log_probs"].values()[[0, 3, 4, 6]].abs().sum() == 0


def test_shared_prefix_row_gives_each_sequences_log_probs_and_the_same_gradient(tiny_model_dir):
    """GRPO's n samples of a prompt share one copy of it in the packed row: same log-probs per response token,
    same gradient as the row with a copy per sequence (VeRL's layout)."""
    from transformers import AutoModelForCausalLM

    from verl_backend.workers.response_logits import packed_response_log_probs, response_logit_indices
    from verl_backend.workers.shared_prefix import attention_kinds, shared_prefix_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(2)
    pa, pb = torch.randint(10, 1000, (6,), generator=g).tolist(), torch.randint(10, 1000, (4,), generator=g).tolist()
    prompts = [pa, pa, pb, pa, pb]  # two groups, not contiguous
    rlens = [5, 1, 7, 3, 2]
    responses = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in rlens]
    td = _micro_batch(prompts, responses)
    td["position_ids"] = torch.nested.as_nested_tensor(
        [torch.arange(len(p) + len(r)) for p, r in zip(prompts, responses)], layout=torch.jagged
    )
    nested = td["input_ids"]
    offsets = nested.offsets()
    keep = response_logit_indices(td)
    inputs, row_keep = shared_prefix_inputs(td, attention_kinds(model))
    assert inputs["input_ids"].shape[1] == len(pa) + len(pb) + sum(rlens)  # each prompt once
    assert row_keep.shape == keep.shape
    rolled = torch.roll(nested.values(), shifts=-1)
    temp = torch.ones(nested.values().shape[0])

    def run(shared: bool):
        model.zero_grad(set_to_none=True)
        if shared:
            logits = model(**inputs, use_cache=False, logits_to_keep=row_keep).logits
        else:
            ids = nested.values().unsqueeze(0)
            pos = td["position_ids"].values().unsqueeze(0)
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
        lp = packed_response_log_probs(logits, rolled, temp, keep, offsets)["log_probs"]
        (lp.values() * torch.linspace(0.5, 1.5, lp.values().shape[0])).sum().backward()  # an uneven "loss"
        return lp.values().detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp_copy, grad_copy = run(shared=False)
    lp_shared, grad_shared = run(shared=True)
    torch.testing.assert_close(lp_shared, lp_copy, rtol=1e-5, atol=1e-5)
    assert lp_copy[keep].abs().min() > 0  # real log-probs at the response positions
    for name, want in grad_copy.items():
        torch.testing.assert_close(grad_shared[name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_shared_prefix_needs_a_shared_prompt_and_plain_positions():
    from verl_backend.workers.shared_prefix import AttentionKinds, shared_prefix_inputs

    full = AttentionKinds(windows={"full_attention": None})
    distinct = _micro_batch([[1, 2], [3, 4]], [[5], [6]])
    assert shared_prefix_inputs(distinct, full) is None  # nothing to share: VeRL's packed row
    same = _micro_batch([[1, 2], [1, 2]], [[5], [6, 7]])
    inputs, keep = shared_prefix_inputs(same, full)
    assert inputs["input_ids"].tolist() == [[1, 2, 5, 6, 7]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 2, 3]]
    assert keep.tolist() == [1, 1, 3]  # both first tokens from the prompt's last position
    mask = inputs["attention_mask"][0, 0]
    assert not mask[3, 2] and mask[3, 1] and mask[4, 3] and not mask[4, 2]  # siblings never see each other
    same["position_ids"] = torch.nested.as_nested_tensor(
        [torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 8])], layout=torch.jagged
    )
    assert shared_prefix_inputs(same, full) is None  # positions that do not start at 0: keep VeRL's layout


# ------------------------------------------------------------ the actor's parameters in shared memory (one rank)
def _fsdp_shared_child(model_dir: str, port: int, conn) -> None:
    """One gloo rank: two identical FSDP2 models train 3 AdamW steps, one with its storage moved to shared memory."""
    import io
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from rl_tpu.shared_weights import SharedWeightsReader
    from verl_backend.host_memory.heap import BackwardHeapTrim
    from verl_backend.workers.engine import share_fsdp_parameters

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))

    def build():
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    shared, plain, trimmed = build(), build(), build()
    # one CPU rank: the engine trains the module unwrapped
    # (verl_backend.host_memory.plain_module.SingleRankPlainModule)
    unwrapped = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trim = BackwardHeapTrim(trimmed)  # FSDP2 renames the block class (FSDPLlamaDecoderLayer): matched by its base
    params, unwrapped_params = list(shared.parameters()), list(unwrapped.parameters())
    published = share_fsdp_parameters(shared)
    published_unwrapped = share_fsdp_parameters(unwrapped, name="rl_tpu_unwrapped")
    out = {
        "same_params": all(a is b for a, b in zip(params, shared.parameters())),
        "same_unwrapped_params": all(a is b for a, b in zip(unwrapped_params, unwrapped.parameters())),
        "slot_names": [s.names for s in published.slots],
        "unwrapped_slot_names": [s.names for s in published_unwrapped.slots],
    }
    reader = SharedWeightsReader(published.handle())  # what the rollout server maps (here: the same process)
    unwrapped_reader = SharedWeightsReader(published_unwrapped.handle())
    models = (shared, plain, trimmed, unwrapped)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in models]
    x = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        for m, opt in zip(models, opts):
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    out["losses"] = losses
    out["unwrapped_reader_max_diff"] = max(
        float((unwrapped_reader.tensors[k] - v).abs().max()) for k, v in unwrapped.state_dict().items()
    )
    out["trim"] = (trim.blocks, trim.trims, trimmed.config.num_hidden_layers)
    sd = plain.state_dict()
    out["reader_max_diff"] = max(float((reader.tensors[k] - v.to_local()).abs().max()) for k, v in sd.items())
    out["publish"] = published.publish((k, v.to_local()) for k, v in shared.state_dict().items())
    buf = io.BytesIO()
    torch.save(shared.state_dict(), buf)  # VeRL's checkpoint manager pickles the DTensors
    out["saved_bytes"] = buf.tell()
    dist.destroy_process_group()
    conn.send(out)


def test_fsdp_parameters_move_to_shared_memory_and_train_identically(tiny_model_dir):
    """Also: an FSDP2 model with verl_backend.host_memory.heap.BackwardHeapTrim trims once per block and trains
    identically."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_fsdp_shared_child, args=(str(tiny_model_dir), port, child))
    proc.start()
    out = parent.recv() if parent.poll(300) else None
    proc.join(60)
    assert out is not None and proc.exitcode == 0
    assert out["same_params"], "the optimizer's Parameter objects must stay the same"
    # the tiny model ties its LM head to the embeddings: one slot, both names (as the rollout's state_dict has)
    assert [tuple(n) for n in out["slot_names"] if len(n) > 1] == [("model.embed_tokens.weight", "lm_head.weight")]
    shared_losses, plain_losses, trimmed_losses, unwrapped_losses = (out["losses"][i::4] for i in range(4))
    assert shared_losses == plain_losses and shared_losses[-1] < shared_losses[0]
    # the same model unwrapped, its parameters in shared memory too: same slots, same training, the reader sees it
    assert out["same_unwrapped_params"]
    assert out["unwrapped_slot_names"] == out["slot_names"]
    assert unwrapped_losses == pytest.approx(plain_losses, rel=1e-5, abs=0)
    assert out["unwrapped_reader_max_diff"] == 0.0
    blocks, trims, layers = out["trim"]
    assert blocks == layers and trims == 3 * layers, "one heap trim per decoder layer per backward"
    assert trimmed_losses == plain_losses, "trimming the heap must not change training"
    assert out["reader_max_diff"] == 0.0, "the reader must see exactly the trained parameters"
    kept, copied = out["publish"]
    assert copied == 0 and kept > 0
    assert out["saved_bytes"] > kept  # a checkpoint of the shared parameters pickles every tensor


def test_saved_checkpoint_config_names_the_dtype_of_its_weights(tmp_path, tiny_model_dir):
    """VeRL 0.9.1's checkpoint manager writes float32 weights under a config saying bfloat16."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from verl_backend.workers.lora_checkpoint import match_saved_config_dtype

    ckpt = tmp_path / "huggingface"
    shutil.copytree(tiny_model_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["dtype"] = "bfloat16"  # what VeRL writes
    (ckpt / "config.json").write_text(json.dumps(config))
    assert AutoModelForCausalLM.from_pretrained(ckpt).dtype == torch.bfloat16  # the silent down-cast
    assert match_saved_config_dtype(ckpt) == "float32"
    assert AutoModelForCausalLM.from_pretrained(ckpt).dtype == torch.float32
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == config["vocab_size"]
    assert not list(ckpt.glob(".config.json.*"))  # the temporary file was renamed over the config
    assert match_saved_config_dtype(tmp_path / "missing") is None


@pytest.mark.parametrize("saved, plain_reason", [(2, None), (0, "rl_tpu.plain_module=false")])
def test_resume_across_the_unwrapped_module_switch_is_refused(tmp_path, saved, plain_reason):
    """A checkpoint of FSDP2 DTensors cannot load into the unwrapped module, nor plain tensors into FSDP2: one line
    naming the switch, before VeRL's loader meets the mismatch."""
    import json
    from types import SimpleNamespace

    from verl_backend.errors import BadInputError
    from verl_backend.workers.engine import RlTpuFSDPEngineWithLMHead

    (tmp_path / "fsdp_config.json").write_text(json.dumps({"FSDP_version": saved, "world_size": 1}))
    engine = RlTpuFSDPEngineWithLMHead.__new__(RlTpuFSDPEngineWithLMHead)  # only what load_checkpoint reads
    engine.plain_module_reason, engine.engine_config = plain_reason, SimpleNamespace(strategy="fsdp2")
    with pytest.raises(BadInputError) as err:
        engine.load_checkpoint(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path) in message and "rl_tpu.plain_module" in message and "resume_mode=disable" in message
    assert ("rl_tpu.plain_module=false to resume" in message) == (saved == 2)
