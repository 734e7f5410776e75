"""A streamed object-store weight sync: the sender knows the bucket count only at the last bucket (it gives
``total`` with that one); the server ends the sync when that many are loaded, whatever order they arrive in."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")


@pytest.fixture()
def server(tiny_model_dir, job_settings):
    from verl_backend.rollout.server import NativeRolloutServer

    cfg = SimpleNamespace(prompt_length=32, response_length=8, max_num_seqs=8, dtype="float32")
    return NativeRolloutServer(rollout_config=cfg, model_path=str(tiny_model_dir), batch_window_s=0.01)


def test_the_last_bucket_first_still_holds_generation_until_all_are_loaded(server):
    from rl_tpu.collectives import pack_bucket
    from test_rollout_server import held_in_queue

    model = server.sampler.model
    target = {k: torch.randn_like(v) * 0.02 for k, v in model.named_parameters()}
    names = sorted(target)
    buckets = [pack_bucket([(k, target[k]) for k in names[i::3]]) for i in range(3)]
    prompt, greedy = [1, 5, 9, 13], {"temperature": 0.0, "max_tokens": 4, "logprobs": True}

    async def scenario():
        flat, meta = buckets[2]  # the last one sent, with the count, arrives first
        await server.update_weights_bucket(flat.numpy(), meta, last=True, global_steps=3, total=3)
        pending = asyncio.ensure_future(server.generate("b", prompt, greedy))
        assert await held_in_queue(server, pending, "b"), "generation ran with 1 of 3 buckets loaded (the last)"
        await server.update_weights_bucket(buckets[0][0].numpy(), buckets[0][1], last=False, global_steps=3)
        assert await held_in_queue(server, pending, "b"), "generation ran with 2 of 3 buckets loaded"
        await server.update_weights_bucket(buckets[1][0].numpy(), buckets[1][1], last=False, global_steps=3)
        await asyncio.wait_for(pending, timeout=60)

    asyncio.run(scenario())
    assert server.global_steps == 3
    params = dict(model.named_parameters())
    for name, want in target.items():
        torch.testing.assert_close(params[name].detach(), want)
