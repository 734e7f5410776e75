"""The ``gloo`` checkpoint engine (weight sync between a trainer pool and rollout pools): real processes, a real
gloo group, VeRL's own topology calls, 1 MiB buckets.

Two trainer ranks (rank 0 sends, rank 1 only walks its generator) and two rollout workers, each a spawned process.
The weights: a 4 MiB float32 embedding (larger than a bucket: sent in chunks), bf16 and int64 tensors, and enough
small ones to fill several buckets. Each receiver checks every tensor bit for bit and drops it at once (as the
native rollout adapter does); peak memory is the process's max RSS over the sync minus before it.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import traceback

import pytest
import torch

BUCKET = 1 << 20


def model_weights(seed: int = 0):
    """The trainer's weights, made one at a time (as FSDP gathers them): ``(name, tensor)``."""
    g = torch.Generator().manual_seed(seed)
    yield "embed.weight", torch.randn(1024, 1024, generator=g)  # 4 MiB: four chunks
    for i in range(20):
        yield f"layers.{i}.w", torch.randn(512, 512, generator=g)  # 1 MiB: a bucket of its own
        yield f"layers.{i}.v", torch.randn(256, 256, generator=g)  # 256 KiB
        yield f"layers.{i}.norm", torch.randn(256, generator=g).to(torch.bfloat16)
    yield "rope.ids", torch.arange(1000, dtype=torch.int64)


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(role: str, index: int, inbox, outbox) -> None:
    try:
        import asyncio

        from verl_backend.rollout.pool_sync import GlooCheckpointEngine

        engine = GlooCheckpointEngine(bucket_size=BUCKET, is_master=(role == "trainer" and index == 0), timeout_s=120)
        outbox.put(engine.prepare())
        kwargs, steps = inbox.get()
        engine.init_process_group(**kwargs)
        expected = dict(model_weights()) if role == "rollout" else None
        base = _max_rss_bytes()
        if role == "trainer":
            result = asyncio.run(engine.send_weights(model_weights(), global_steps=7))
            outbox.put(("sent", result, _max_rss_bytes() - base))
        else:
            got, nbytes = [], 0
            for name, tensor in engine.receive_weights(global_steps=steps):
                want = expected.pop(name)
                assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
                assert torch.equal(tensor, want), name
                got.append(name)
                nbytes += tensor.nbytes
                del tensor, want
            outbox.put(("received", {"names": got, "bytes": nbytes, "left": sorted(expected)},
                        _max_rss_bytes() - base))
        engine.finalize()
    except BaseException as exc:  # noqa: BLE001 -- reported to the test, which fails with it
        outbox.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", 0))


def _sync(expected_steps: tuple[int, int], timeout: float = 240):
    from verl_backend.rollout.pool_sync import GlooCheckpointEngine

    ctx = mp.get_context("spawn")
    roles = [("trainer", 0), ("trainer", 1), ("rollout", 0), ("rollout", 1)]
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in roles]
    procs = [ctx.Process(target=_worker, args=(r, i, inbox, outbox), daemon=True)
             for (r, i), (inbox, outbox) in zip(roles, boxes, strict=True)]
    for p in procs:
        p.start()
    try:
        metadata = [outbox.get(timeout=timeout) for _, outbox in boxes]
        actor, rollout = GlooCheckpointEngine.build_topology(2, 2, metadata)
        per_rank = [{k: v[i] for k, v in actor.items()} for i in range(2)]
        per_rank += [{k: v[i] for k, v in rollout.items()} for i in range(2)]
        for (inbox, _), kwargs, steps in zip(boxes, per_rank, (None, None, *expected_steps), strict=True):
            inbox.put((kwargs, steps))
        return [outbox.get(timeout=timeout) for _, outbox in boxes]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_every_rollout_worker_gets_every_tensor_bit_for_bit_from_one_source_or_refuses_a_stale_step():
    """Rollout worker 0 expects the step the trainer sends (7), worker 1 another (8)."""
    results = _sync(expected_steps=(7, 8))
    (kind, sent, source_growth), (_, walked, _), (got_kind, got, growth), (refused, why, _) = results
    assert kind == "sent" and got_kind == "received", [r[1] for r in results if r[0] == "error"]
    model_bytes = sum(t.nbytes for _, t in model_weights())
    assert walked == {}  # trainer rank 1 sent nothing
    assert sent["weight_sync/pool_bytes"] == model_bytes
    assert sent["weight_sync/pool_buckets"] >= model_bytes / BUCKET
    assert got["left"] == [] and got["bytes"] == model_bytes
    assert len(got["names"]) == len(set(got["names"])) == 62
    # nobody holds the model twice: a receiver holds a bucket or two (and the 4 MiB tensor while it is merged),
    # the source one bucket beside the tensor its generator made
    assert growth < model_bytes / 2, f"rollout worker grew {growth / 2**20:.1f} MiB for {model_bytes / 2**20:.1f}"
    assert source_growth < model_bytes / 2, f"source grew {source_growth / 2**20:.1f} MiB"
    # the stale worker refuses in one line, after draining the stream (the source above finished)
    assert refused == "error" and "PoolSyncError: weight sync: the trainer sent step 7's weights" in why, why


def test_topology_without_a_source_store_is_one_line():
    from verl_backend.rollout.pool_sync import GlooCheckpointEngine

    with pytest.raises(ValueError, match="did not start the weight-sync store"):
        GlooCheckpointEngine.build_topology(1, 1, [{}, {}])


def test_gloo_is_a_registered_verl_checkpoint_engine():
    import verl  # noqa: F401  (loads the plugin)
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from verl_backend.rollout.pool_sync import GlooCheckpointEngine

    assert CheckpointEngineRegistry.get("gloo") is GlooCheckpointEngine
