"""The trainer's compiled transformer blocks (``rl_tpu.compile_trainer``): on padded micro batches the loss and
gradients equal the eager model's, graphs stay bounded (no recompile after warm-up, under dynamo's
``fail_on_recompile``), and whatever cannot compile falls back to eager in one line."""

import copy

import pytest
import torch
import transformers
from families import FAMILIES

from rl_tpu.compiled_blocks import (
    CompiledBlocks,
    bucket_length,
    decoder_blocks,
    pad_to_bucket,
    refusal,
)

VOCAB = 512


def tiny(family: str) -> torch.nn.Module:
    config_name, model_name, extra = FAMILIES[family]
    keys = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        **extra,
    }
    config = getattr(transformers, config_name)(**keys)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float().train()


def padded_batch(seed: int, batch: int = 3, length: int = 24):
    """VeRL's padded layout: left-padded prompts, right-padded responses, one shape for every micro batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        left = int(torch.randint(0, 6, (1,), generator=g))
        right = int(torch.randint(0, 6, (1,), generator=g))
        mask[row, :left] = 0
        mask[row, length - right :] = 0
    ids = ids * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def loss_of(model, batch) -> torch.Tensor:
    ids, mask, pos = batch
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = mask[:, 1:] * mask[:, :-1]
    return -(logp * keep).sum() / keep.sum()


@pytest.mark.parametrize(
    ("family", "backend", "checkpointing"),
    [
        ("llama", "inductor", False),
        ("llama", "aot_eager", True),
        ("qwen3", "aot_eager", False),
        ("gemma3", "aot_eager", False),
        ("qwen3_moe", "aot_eager", False),
    ],
)
def test_compiled_blocks_train_like_eager_with_bounded_graphs(family, backend, checkpointing):
    """Also under gradient checkpointing (VeRL's default off the CPU, non-reentrant as VeRL asks): the block is
    recomputed in the backward through its compiled forward."""
    eager = tiny(family)
    if checkpointing:
        eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = copy.deepcopy(eager)
    lines = []
    blocks = CompiledBlocks(compiled, backend, say=lines.append)
    assert blocks.blocks == len(decoder_blocks(eager)) == eager.config.num_hidden_layers
    for step in range(3):  # the same shape each step, other tokens and padding
        batch = padded_batch(step)
        want, got = loss_of(eager, batch), loss_of(compiled, batch)
        assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=0)
        want.backward()
        got.backward()
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            if a.grad is None:  # an expert no token was routed to
                assert b.grad is None or not b.grad.any(), name
                continue
            assert b.grad.norm().item() == pytest.approx(a.grad.norm().item(), rel=1e-4, abs=1e-9), name
            a.grad = b.grad = None
        with torch.no_grad():  # the log-prob forward (old policy, reference): its own graph
            assert loss_of(compiled, batch).item() == pytest.approx(loss_of(eager, batch).item(), rel=1e-5, abs=0)
        if step == 0 and blocks.eager_reason is None:
            warm = blocks.graphs
            torch.compiler.set_stance("fail_on_recompile")  # dynamo would otherwise recompile quietly
    torch.compiler.set_stance("default")
    # transformers' grouped-mm experts forward is data-dependent (tokens per expert): it does not trace
    assert (blocks.eager_reason is None) == (family != "qwen3_moe"), blocks.eager_reason
    if blocks.eager_reason is None:
        # update and no-grad forward of one shape (with checkpointing the no-grad forward also sees a block input
        # that requires grad, and a KV cache object): no new graph after the first step
        assert blocks.graphs == warm <= (3 if checkpointing else 2), blocks.signatures
        assert [line.split(" (")[0] for line in lines] == [
            f"[rl-tpu] compiled trainer blocks: graph {n} of at most 16" for n in range(1, warm + 1)
        ]
    else:  # what cannot compile says so once and trains eagerly: the same numbers as above
        assert len([line for line in lines if "runs eagerly" in line]) == 1


def test_a_shape_that_keeps_changing_falls_back_to_eager_in_one_line():
    eager = tiny("llama")
    compiled = copy.deepcopy(eager)
    lines = []
    blocks = CompiledBlocks(compiled, "aot_eager", max_graphs=2, say=lines.append)
    for length in (16, 20, 24, 28, 16):  # packed rows: a new length each step (then the first one again)
        batch = padded_batch(length, length=length)
        assert loss_of(compiled, batch).item() == pytest.approx(loss_of(eager, batch).item(), rel=1e-5, abs=0)
    assert blocks.eager_reason is not None and blocks.graphs == 2
    assert len(lines) == 3 and "runs eagerly" in lines[-1]  # graphs 1 and 2, then one line for the rest
    assert "more than 2 distinct block input shapes" in lines[-1]
    assert len(blocks._eager_signatures) == 2  # lengths 24 and 28 ran eagerly; 16 kept its graph


def test_a_forward_inside_eager_compiles_nothing_and_counts_no_shape():
    """The weight-sync probe's forward (a shape no step has) runs inside ``eager()``: the same numbers, no graph, no
    signature counted; outside it the next new shape is graph 2 as before."""
    eager = tiny("llama")
    compiled = copy.deepcopy(eager)
    lines = []
    blocks = CompiledBlocks(compiled, "aot_eager", max_graphs=2, say=lines.append)
    loss_of(compiled, padded_batch(0, length=24))
    assert blocks.graphs == 1
    probe = padded_batch(1, batch=2, length=16)
    with torch.no_grad(), blocks.eager():
        assert loss_of(compiled, probe).item() == loss_of(eager, probe).item()
    assert blocks.graphs == 1 and len(lines) == 1 and blocks.eager_reason is None
    loss_of(compiled, padded_batch(2, length=20))
    assert blocks.graphs == 2


def test_micro_batches_of_changing_length_padded_to_a_bucket_share_one_graph():
    """VeRL pads each micro batch to its own longest sequence; padded on to a power of two, lengths 17..40 all go to
    the 64 bucket (the smallest), one graph, and the real positions' logits are those of the unpadded batch."""
    assert [bucket_length(n) for n in (1, 17, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, 256]
    eager = tiny("qwen3")
    compiled = copy.deepcopy(eager)
    lines = []
    blocks = CompiledBlocks(compiled, "aot_eager", say=lines.append)
    for length in (17, 23, 40, 31):
        batch = padded_batch(length, length=length)
        inputs = pad_to_bucket({"input_ids": batch[0], "attention_mask": batch[1], "position_ids": batch[2]}, 0)
        assert inputs["input_ids"].shape == (3, 64) and not inputs["attention_mask"][:, length:].any()
        want = eager(input_ids=batch[0], attention_mask=batch[1], position_ids=batch[2]).logits
        got = compiled(**inputs).logits[:, :length]
        real = batch[1].bool()
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert blocks.graphs == 1 and blocks.eager_reason is None  # one bucket, grad on: one graph for four lengths


def test_packed_micro_batches_are_refused_before_a_run():
    assert "use_remove_padding=false" in refusal(True)
    assert refusal(False) is None and refusal(False, "tpu") is None
    assert "applies to --backend cpu and tpu" in refusal(False, "cuda")
