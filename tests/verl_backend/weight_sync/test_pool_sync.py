"""The ``gloo`` checkpoint engine (weight sync between a trainer pool and rollout pools): real processes, a real
gloo group, VeRL's own topology calls, 1 MiB buckets.

Two trainer ranks (rank 0 sends, rank 1 only walks its generator) and two rollout workers, each a spawned process
that runs several syncs (prepare -> init_process_group -> send/receive -> finalize, as VeRL drives them). All four
are on this host, so the engine takes its shared-memory path; a handle altered to name another host's boot id makes
it fall back to the byte broadcast. The weights (seeded by the step, so every sync's bytes differ): a 4 MiB float32
embedding (larger than a bucket: sent in chunks), bf16 and int64 tensors, and enough small ones to fill several
buckets. Each receiver checks every tensor bit for bit, consumes slowly and checks it again before asking for the
next (the source must not overwrite a half a receiver is still reading); rollout worker 0 keeps the first layers'
tensors to the end of the stream (the halves of the shared file are reused many times by then) and checks them
again; rollout worker 1 opts in to views of the shared file (``ReceivedWeights.allow_views``). Peak memory is the
process's max RSS over the first sync minus before it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time
import traceback

import pytest
import torch

BUCKET = 1 << 20
FILE_LABEL = "rl_tpu_pool_sync"  # the shared-memory file's name in /proc/<pid>/fd and /proc/<pid>/maps


def model_weights(seed: int = 0):
    """The trainer's weights, made one at a time (as FSDP gathers them): ``(name, tensor)``."""
    g = torch.Generator().manual_seed(seed)
    yield "embed.weight", torch.randn(1024, 1024, generator=g)  # 4 MiB: four chunks
    for i in range(20):
        yield f"layers.{i}.w", torch.randn(512, 512, generator=g)  # 1 MiB: a bucket of its own
        yield f"layers.{i}.v", torch.randn(256, 256, generator=g)  # 256 KiB
        yield f"layers.{i}.norm", torch.randn(256, generator=g).to(torch.bfloat16)
    yield "odd.scale", torch.randn(3, generator=g).to(torch.bfloat16)  # 6 bytes: what follows must start aligned
    yield "rope.ids", torch.arange(1000, dtype=torch.int64) + seed


def failing_export(step: int, after: int = 30):
    """The trainer's export raising after ``after`` tensors (on every trainer rank, as a failed FSDP gather would)."""
    for i, item in enumerate(model_weights(step)):
        if i == after:
            raise RuntimeError("export failed on purpose")
        yield item


MODEL_BYTES = sum(t.nbytes for _, t in model_weights())


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _held() -> dict[str, int]:
    """Open descriptors of this process, those naming the engine's shared file, and mappings of it."""
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    with open("/proc/self/maps") as f:
        maps = sum(FILE_LABEL in line for line in f)
    return {"fds": len(fds), "files": sum(FILE_LABEL in link for link in links), "maps": maps}


def _file_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the engine's shared file."""
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if FILE_LABEL in line]


class _Done(Exception):
    """The faulty consumer's way out of the receiving block, its result already set."""


def _worker(role: str, index: int, inbox, outbox) -> None:
    """One side across syncs: per ``(step)`` from ``inbox`` (``None`` ends) it answers ``prepare()``, then takes its
    ``(init kwargs, expected step)`` and puts ``(kind, payload, rss growth, held during the sync, held after)``."""
    try:
        import asyncio

        from verl_backend.weight_sync.gloo_engine import GlooCheckpointEngine, PoolSyncError

        engine = GlooCheckpointEngine(bucket_size=BUCKET, is_master=(role == "trainer" and index == 0), timeout_s=120)
        first = True
        while (step := inbox.get()) is not None:
            outbox.put(engine.prepare())
            kwargs, expect, fault = inbox.get()
            engine.init_process_group(**kwargs)
            expected = dict(model_weights(step)) if role == "rollout" else None
            base = _max_rss_bytes()
            if role == "trainer":
                weights = failing_export(step) if fault == "export" else model_weights(step)
                try:
                    metrics = asyncio.run(engine.send_weights(weights, global_steps=step))
                    report = engine.last_report if index == 0 else None
                    kind, payload = "sent", {"metrics": metrics, "transport": report and report.transport}
                except RuntimeError as exc:
                    kind, payload = "failed", str(exc)
            else:
                kept, got, nbytes, in_file = {}, [], 0, 0
                ranges = _file_ranges()  # mapped in init_process_group; read once (not per tensor: RSS is measured)
                try:
                    stream = engine.receive_weights(global_steps=expect)
                    if index == 1:
                        stream.allow_views()  # copies each tensor before asking for the next: views of the file
                    if fault in (f"consumer{index}", f"unstarted{index}"):  # closed as the adapter does
                        try:
                            if fault.startswith("unstarted"):  # took the iterator, raised before the first tensor
                                iter(stream)
                                raise ValueError("consumer failed on purpose")
                            for i, _ in enumerate(stream):  # raises at its 10th tensor, mid-bucket
                                if i == 9:
                                    raise ValueError("consumer failed on purpose")
                        except ValueError as exc:
                            kind, payload = "raised", str(exc)
                        finally:
                            stream.close()
                        raise _Done
                    for name, tensor in stream:
                        want = expected.pop(name)
                        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
                        assert torch.equal(tensor, want), name
                        got.append(name)
                        nbytes += tensor.nbytes
                        in_file += any(lo <= tensor.data_ptr() < hi for lo, hi in ranges)
                        time.sleep(0.002)  # a slow consumer: the source runs ahead if it can
                        # a view is read until the consumer moves on: the source must not reuse its half before
                        assert torch.equal(tensor, want), f"{name} changed while the consumer held it"
                        if index == 0 and name.startswith(("layers.0.", "layers.1.")):
                            kept[name] = tensor
                        del tensor, want
                    again = dict(model_weights(step)) if kept else {}
                    changed = [n for n, t in kept.items() if not torch.equal(t, again[n])]
                    kind, payload = (
                        "received",
                        {
                            "names": got,
                            "bytes": nbytes,
                            "left": sorted(expected),
                            "in_file": in_file,
                            "kept": len(kept),
                            "changed": changed,
                        },
                    )
                except PoolSyncError as exc:
                    kind, payload = "refused", str(exc)
                except _Done:
                    pass
            growth = _max_rss_bytes() - base if first else 0
            during = _held()
            engine.finalize()
            outbox.put((kind, payload, growth, during, _held()))
            first = False
    except BaseException as exc:  # noqa: BLE001 -- reported to the test, which fails with it
        outbox.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", 0, None, None))


def _syncs(plan: list[tuple], other_host: tuple[int, ...] = (), timeout: float = 240):
    """Run ``plan``'s syncs, ``(step sent, (step rollout worker 0 expects, ... worker 1 expects)[, fault])`` each, on
    two trainer ranks and two rollout workers; the rollout workers in ``other_host`` get the source's handle with
    another boot id (as a worker on another host would). ``fault``: ``"consumer<i>"`` (rollout worker i raises
    mid-stream), ``"unstarted<i>"`` (it raises before its first tensor) or ``"export"`` (the trainer's weight
    generator raises mid-stream). Returns per sync the four results, trainer ranks first."""
    from verl_backend.weight_sync.gloo_engine import GlooCheckpointEngine

    ctx = mp.get_context("spawn")
    roles = [("trainer", 0), ("trainer", 1), ("rollout", 0), ("rollout", 1)]
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in roles]
    procs = [
        ctx.Process(target=_worker, args=(r, i, inbox, outbox), daemon=True)
        for (r, i), (inbox, outbox) in zip(roles, boxes, strict=True)
    ]
    for p in procs:
        p.start()
    results = []
    try:
        for step, expected_steps, *fault in plan:
            for inbox, _ in boxes:
                inbox.put(step)
            metadata = [outbox.get(timeout=timeout) for _, outbox in boxes]
            errors = [m[1] for m in metadata if isinstance(m, tuple)]
            assert not errors, errors
            actor, rollout = GlooCheckpointEngine.build_topology(2, 2, metadata)
            per_rank = [{k: v[i] for k, v in actor.items()} for i in range(2)]
            per_rank += [{k: v[i] for k, v in rollout.items()} for i in range(2)]
            for i in other_host:
                master = per_rank[2 + i]["master"]
                per_rank[2 + i]["master"] = {**master, "shm": {**master["shm"], "boot_id": "another-host"}}
            for (inbox, _), kwargs, steps in zip(boxes, per_rank, (None, None, *expected_steps), strict=True):
                inbox.put((kwargs, steps, fault[0] if fault else None))
            results.append([outbox.get(timeout=timeout) for _, outbox in boxes])
            assert not [r[1] for r in results[-1] if r[0] == "error"], [r[1] for r in results[-1] if r[0] == "error"]
        for inbox, _ in boxes:
            inbox.put(None)
        return results
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _check_delivered(received: tuple) -> None:
    kind, got, *_ = received
    assert kind == "received", received
    assert got["left"] == [] and got["bytes"] == MODEL_BYTES
    assert len(got["names"]) == len(set(got["names"])) == 63


@pytest.fixture(scope="module")
def same_host():
    """Three syncs on this host (steps 7, 8, 9); rollout worker 1 expects step 8 on the first (a stale worker)."""
    return _syncs([(7, (7, 8)), (8, (8, 8)), (9, (9, 9))])


def test_same_host_syncs_go_through_shared_memory_bit_for_bit(same_host):
    for number, ((kind, sent, *_), (_, walked, *_), first, second) in enumerate(same_host):
        assert kind == "sent" and walked == {"metrics": {}, "transport": None}  # trainer rank 1 sent nothing
        assert sent["transport"] == "pool_shared_memory"
        assert sent["metrics"]["weight_sync/pool_shared_memory"] == 1.0
        assert sent["metrics"]["weight_sync/pool_bytes"] == MODEL_BYTES
        assert sent["metrics"]["weight_sync/pool_buckets"] >= MODEL_BYTES / BUCKET
        _check_delivered(first)
        assert first[1]["in_file"] == 0  # rollout worker 0 did not opt in: copies
        if number:  # worker 1 opted in: every tensor but the merged 4 MiB one is a view of the file
            assert second[1]["in_file"] == len(second[1]["names"]) - 1, second[1]["in_file"]
        # what the consumer kept is its own: not overwritten when the source reused the file's halves
        assert first[1]["kept"] == 6 and first[1]["changed"] == [], first[1]
        if number:
            _check_delivered(second)
        # during the sync the source holds the file and each receiver maps it
        assert same_host[number][0][3]["files"] >= 1 and first[3]["maps"] >= 1
    # nobody holds the model twice: a receiver holds a bucket or two (and the 4 MiB tensor while it is merged, and
    # the pages of the shared file it read), the source two halves of the file beside the tensor its generator made
    (_, _, source_growth, *_), _, (_, _, growth, *_), _ = same_host[0]
    # (worker 0 also keeps 6 tensors and with them their buckets, ~4 MiB; measured 11-18 MiB of a 29 MiB model)
    assert growth < 0.75 * MODEL_BYTES, f"rollout worker grew {growth / 2**20:.1f} MiB for {MODEL_BYTES / 2**20:.1f}"
    assert source_growth < MODEL_BYTES / 2, f"source grew {source_growth / 2**20:.1f} MiB"


def test_stale_worker_drains_the_shared_memory_sync_and_refuses_in_one_line(same_host):
    (kind, *_), _, (got_kind, *_), (refused, why, *_) = same_host[0]
    assert kind == "sent" and got_kind == "received"  # the source and the other worker finished
    assert refused == "refused" and why.startswith(
        "weight sync: the trainer sent step 7's weights, this rollout worker expected step 8"
    ), why
    _check_delivered(same_host[1][3])  # and the stale worker takes the next sync whole


def test_no_descriptor_or_mapping_outlives_a_sync(same_host):
    for process in range(4):
        after = [sync[process][4] for sync in same_host]
        assert all(h["files"] == 0 and h["maps"] == 0 for h in after), after
        assert after[0]["fds"] == after[1]["fds"] == after[2]["fds"], after  # 3 syncs, no descriptor gained


def test_a_worker_on_another_host_makes_the_whole_sync_a_broadcast_with_the_same_bytes():
    """Rollout worker 1 gets a handle naming another host; it is stale on the first sync (drained, broadcast)."""
    syncs = _syncs([(7, (7, 8)), (8, (8, 8))], other_host=(1,))
    for number, ((kind, sent, *_), _, first, second) in enumerate(syncs):
        assert kind == "sent" and sent["transport"] == "pool_broadcast"
        assert sent["metrics"]["weight_sync/pool_shared_memory"] == 0.0
        assert sent["metrics"]["weight_sync/pool_bytes"] == MODEL_BYTES
        _check_delivered(first)  # mapped the file, yet took the broadcast with everyone else
        assert first[3]["maps"] >= 1 and second[3]["maps"] == 0
        assert first[1]["in_file"] == 0 and (not number or second[1]["in_file"] == 0)  # broadcast: fresh buffers
        assert first[1]["changed"] == []
        if number:
            _check_delivered(second)
    assert syncs[0][3][0] == "refused" and "the trainer sent step 7's weights" in syncs[0][3][1]
    assert all(s[p][4]["files"] == 0 and s[p][4]["maps"] == 0 for s in syncs for p in range(4))


def test_topology_without_a_source_store_is_one_line():
    from verl_backend.weight_sync.gloo_engine import GlooCheckpointEngine

    with pytest.raises(ValueError, match="did not start the weight-sync store"):
        GlooCheckpointEngine.build_topology(1, 1, [{}, {}])


def test_gloo_is_a_registered_verl_checkpoint_engine():
    import verl  # noqa: F401  (loads the plugin)
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from verl_backend.weight_sync.gloo_engine import GlooCheckpointEngine

    assert CheckpointEngineRegistry.get("gloo") is GlooCheckpointEngine


def _check_faults(syncs: list, transport: str) -> None:
    """Per sync of :data:`FAULTS`: the faulty worker raised and the others finished whole; the failed export was
    refused in one line by both workers; the last sync was whole for both."""
    for (kind, sent, *_), _, first, second in syncs[:3]:
        assert kind == "sent" and sent["transport"] == transport
        raised, whole = (first, second) if first[0] == "raised" else (second, first)
        assert raised[:2] == ("raised", "consumer failed on purpose"), (first, second)
        _check_delivered(whole)
    assert [r[:2] for r in syncs[3][:2]] == [("failed", "export failed on purpose")] * 2
    for kind, why, *_ in syncs[3][2:]:
        assert kind == "refused" and why.startswith("weight sync: the trainer's weight export stopped after"), why
    for result in syncs[4][2:]:
        _check_delivered(result)
    assert all(s[p][4]["files"] == 0 and s[p][4]["maps"] == 0 for s in syncs for p in range(4))


#: worker 0 (copies) raises mid-bucket, worker 1 (views) raises mid-bucket, worker 0 raises before its first tensor,
#: the export raises, then a whole sync
FAULTS = [
    (7, (7, 7), "consumer0"),
    (8, (8, 8), "consumer1"),
    (9, (9, 9), "unstarted0"),
    (10, (10, 10), "export"),
    (11, (11, 11)),
]


@pytest.mark.parametrize("other_host", [(), (1,)], ids=["shared_memory", "broadcast"])
def test_a_consumer_that_raises_or_a_failed_export_leaves_no_one_waiting(other_host):
    """A rollout worker that raises (mid-bucket, or before its first tensor) and closes the stream, as the native
    adapter does: the rest is drained, so the source and the other worker finish. The trainer's export raising
    mid-stream: both workers get one line instead of waiting for the group's timeout. Then a whole sync."""
    start = time.monotonic()
    syncs = _syncs(FAULTS, other_host=other_host, timeout=60)
    assert time.monotonic() - start < 100  # the engine's timeout is 120 s: nobody waited for it
    _check_faults(syncs, "pool_broadcast" if other_host else "pool_shared_memory")
