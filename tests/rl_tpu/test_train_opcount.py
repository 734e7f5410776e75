"""Ops per training micro batch (:mod:`rl_tpu.train_opcount`): with compiled blocks the count is the ops outside the
blocks (measured eagerly, independently) plus one launch per block forward and backward plus the autograd engine's
boundary ops, and far below the eager count."""

from collections import Counter

import pytest
import torch
import transformers
from families import tiny_config

from rl_tpu.train_opcount import (
    BACKWARD_GRAPH,
    BOUNDARY_OPS,
    FORWARD_GRAPH,
    micro_batch_ops,
    split,
)

VOCAB = 512


def llama(layers: int) -> torch.nn.Module:
    config = tiny_config(
        "llama",
        vocab_size=VOCAB,
        attn_implementation="sdpa",
        num_hidden_layers=layers,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def step(model: torch.nn.Module) -> torch.Tensor:
    """A padded micro batch of 2 rows at one bucket length (64), right padding on one row, a log-prob loss."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 64), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 50:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids * mask, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()


def test_compiled_micro_batch_is_ops_outside_blocks_plus_launches():
    eager = {layers: micro_batch_ops(llama(layers), step) for layers in (1, 2)}
    # the ops outside the blocks, from eager counts alone: 1 layer minus what a second layer adds
    outside = Counter({op: 2 * eager[1][op] - eager[2][op] for op in eager[1] | eager[2]})
    assert min(outside.values()) >= 0 and sum(outside.values()) > 0
    outside = +outside

    layers = 3
    model = llama(layers)
    block_params = sum(p.numel() > 0 for p in model.model.layers.parameters())
    eager_total = sum(micro_batch_ops(llama(layers), step).values())
    counts = micro_batch_ops(model, step, compiled=True)
    ops, launches = split(counts)

    assert counts[FORWARD_GRAPH] == counts[BACKWARD_GRAPH] == layers  # one forward and one backward graph per block
    seen = Counter({op: n for op, n in counts.items() if op not in (FORWARD_GRAPH, BACKWARD_GRAPH)})
    assert not outside - seen, "an op outside the blocks went missing"
    boundary = seen - outside
    # nothing of a block's computation reaches the counter: only the engine's accumulation and zero gradients
    assert set(boundary) <= BOUNDARY_OPS, boundary
    assert boundary["add_"] == block_params  # AccumulateGrad into .grad, one per block parameter
    assert boundary["zeros"] % layers == 0
    assert ops + launches == sum(outside.values()) + launches + sum(boundary.values())
    assert ops + launches < eager_total / 4, (ops + launches, eager_total)


def test_compiled_count_refuses_a_model_without_blocks():
    with pytest.raises(RuntimeError, match="no decoder block class"):
        micro_batch_ops(torch.nn.Linear(4, 1), lambda m: m(torch.ones(2, 4)).sum(), compiled=True)
