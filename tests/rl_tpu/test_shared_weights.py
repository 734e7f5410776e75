"""Shared-memory weight sync: a second process writes into the owner's model, which copies nothing."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rl_tpu.shared_weights import SharedWeights, SharedWeightsError, SharedWeightsWriter, shared_memory_supported

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="needs Linux memfd_create and /proc")


def _tiny():
    from families import tiny_config
    from transformers import LlamaForCausalLM

    cfg = tiny_config("llama", vocab_size=96, hidden_size=32, intermediate_size=64)  # tied embeddings
    return LlamaForCausalLM(cfg).eval()


def _write_from_child(handle, state, conn):
    writer = SharedWeightsWriter(handle)
    conn.send(writer.write(state.items()))
    writer.close()


def test_another_process_writes_the_owners_parameters_in_place():
    torch.manual_seed(0)
    model, other = _tiny(), _tiny()
    x = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        before = model(x).logits
    params = dict(model.named_parameters())
    shared = SharedWeights(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, before, rtol=0, atol=0)  # moving changed no value
    assert all(p is params[n] for n, p in model.named_parameters()), "the Parameter objects must stay the same"
    tied = [s for s in shared.slots if len(s.names) > 1]
    assert [set(s.names) for s in tied] == [{"model.embed_tokens.weight", "lm_head.weight"}]

    shared.release()
    assert float(model.lm_head.weight.abs().sum()) == 0.0  # pages given back: they read as zeros
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_write_from_child, args=(shared.handle(), other.state_dict(), child))
    proc.start()
    written, nbytes = parent.recv()
    proc.join(60)
    assert proc.exitcode == 0
    shared.mark_written(written)
    assert shared.resident and nbytes == sum(s.nbytes for s in shared.slots)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, other(x).logits, rtol=0, atol=0)


def test_a_handle_of_a_process_that_has_gone_cannot_be_opened():
    shared = SharedWeights(_tiny())
    handle = {**shared.handle(), "pid": 2**22 + 12345}  # no such process
    with pytest.raises(OSError):
        SharedWeightsWriter(handle)


def test_publish_copies_only_what_is_not_already_in_place():
    model, other = _tiny(), _tiny()
    shared = SharedWeights(model)
    state = model.state_dict()
    kept, copied = shared.publish(state.items())  # the owner's own parameters: all in place
    assert copied == 0 and kept == sum(s.nbytes for s in shared.slots)
    name = "model.layers.0.mlp.up_proj.weight"
    new = other.state_dict()[name]
    kept, copied = shared.publish([(name, new)])  # a tensor from elsewhere is copied into its slot
    assert copied == new.numel() * 4 and kept == 0
    assert torch.equal(model.get_parameter(name), new)
    with pytest.raises(SharedWeightsError, match="has shape"):
        shared.publish([(name, torch.zeros(2))])
    shared.close()
    assert shared.fd == -1
