"""Weight-sync bandwidth: the bucketed pack -> transfer -> unpack path vs a plain memory copy of the same bytes.

Payload: the full state dict of SmolLM2-135M-Instruct (float32, ~0.54 GB; ``--synthetic-mb`` for a random one).
Every path ends the same way as a real weight sync: the bytes sit in the receiver's own, preallocated parameter
tensors (``param.copy_``, what :meth:`rl_tpu.sampler.Sampler.load_state_dict` does).

- ``memcpy``: ``dst.copy_(src)`` per tensor in one process: the reference (100%).
- ``pack+unpack``: :func:`~rl_tpu.collectives.pack_bucket` per bucket into one reused staging buffer, then copy
  out of the views (no transfer).
- ``ray (torch tensor)``: driver packs each bucket and ``ray.put``-s the flat uint8 *torch tensor*; a receiver actor
  gets it, unpacks and copies into its parameters. Buckets are pipelined (put i+1 while the actor loads i).
- ``ray (numpy view)``: the same, but ``ray.put(flat.numpy())``: Ray stores numpy buffers out-of-band, so the
  actor reads the object store's shared memory without a deserialisation copy.
- ``gloo broadcast``: two spawned processes, :func:`~rl_tpu.collectives.broadcast_parameters_bucketed` from rank 0;
  rank 1 copies into its parameters.
- ``gloo checkpoint engine``: rl-tpu's VeRL checkpoint engine ``gloo``
  (:class:`~verl_backend.weight_sync.gloo_engine.GlooCheckpointEngine`, the weight sync between a trainer pool and a
  rollout pool) from one trainer-side source process to one rollout-side receiver process (both spawned). Each
  sync is driven as VeRL's ``CheckpointEngineManager`` drives it: ``prepare`` on both, ``build_topology`` here,
  ``init_process_group``, ``send_weights`` / ``receive_weights``, ``finalize``; the group is made for each sync and
  its set-up is not timed. Timed from the source calling ``send_weights`` to the receiver having copied every
  tensor ``receive_weights`` yields into its preallocated parameters (both stamps from the host's monotonic clock);
  buckets of ``--engine-bucket-mb`` (default ``--bucket-mb``). Its bytes are what the receiver counted (checked
  equal to the payload and to the source's ``weight_sync/pool_bytes``); the source's own figures
  (``weight_sync/pool_*``, medians) are printed under the table. Two rows: ``shared memory``, the engine's path
  when source and receiver share a host (the buckets through a shared-memory file, only headers over gloo), and
  ``broadcast``, its path to a receiver on another host (the bytes over gloo's TCP), forced here by handing the
  receiver the source's handle with another host's boot id.
- ``shared memory``: the production path on one host. A real :class:`~verl_backend.rollout.server.NativeRolloutServer`
  actor (SmolLM2 loaded, its parameters in a shared-memory file) and the driver as the trainer: hold generation,
  write every tensor into the server's parameters with :class:`~rl_tpu.shared_weights.SharedWeightsWriter`, resume
  (both calls timed). Two cases: the weights resident (``free_cache_engine=False``) and released by ``sleep()``
  before each sync (``free_cache_engine``), where every page is faulted in again; the latter is set against a memcpy
  into fresh (never touched) pages, the same work for the OS.
- ``shared memory, in place``: the default CPU job (one FSDP rank). The trainer's parameters live in the shared file
  and the server computes on them (:meth:`~verl_backend.rollout.server.NativeRolloutServer.attach_trainer_weights`);
  a sync holds generation, checks each tensor is its slot (:meth:`~rl_tpu.shared_weights.SharedWeights.publish`)
  and resumes: no byte is copied, so its "bandwidth" is bytes made visible per second.

Columns: bytes moved (the payload; the engine row: what its receiver got), median seconds, GB/s, and the share of
the memcpy reference's (and of the fresh-pages memcpy's) GB/s.

    python benchmarks/bench_weight_sync.py [--bucket-mb 64] [--engine-bucket-mb N] [--repeats 3] [--threads 1]
        [--synthetic-mb N] [--skip ray gloo engine]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_tpu.collectives import (
    broadcast_parameters_bucketed,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)


def payload(synthetic_mb: int | None) -> list[tuple[str, torch.Tensor]]:
    if synthetic_mb:
        n = synthetic_mb * (1 << 20) // 4 // 64
        return [(f"w{i}", torch.randn(n)) for i in range(64)]
    from safetensors.torch import load_file

    from verl_backend.models import ensure_default_model

    folder = ensure_default_model()
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return sorted(tensors.items())


def empty_like_all(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: torch.empty_like(t) for n, t in named}


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


# -------------------------------------------------------------------------------------------------- local
def run_memcpy(named, dst) -> float:
    start = time.perf_counter()
    for n, t in named:
        dst[n].copy_(t)
    return time.perf_counter() - start


def run_memcpy_fresh(named) -> float:
    """memcpy into newly allocated destination tensors (their pages are faulted in by the copy)."""
    dst = empty_like_all(named)
    seconds = run_memcpy(named, dst)
    del dst
    return seconds


def run_pack_unpack(named, dst, bucket_bytes, staging) -> float:
    start = time.perf_counter()
    for bucket in iter_buckets(named, bucket_bytes):
        flat, metas = pack_bucket(bucket, out=staging)
        for n, t in unpack_bucket(flat, metas):
            dst[n].copy_(t)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------- ray
def make_receiver(ray, threads: int):
    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self, spec: list[tuple[str, torch.dtype, tuple[int, ...]]]):
            torch.set_num_threads(threads)
            self.params = {n: torch.empty(shape, dtype=dtype) for n, dtype, shape in spec}

        def load(self, flat, metas) -> int:
            # numpy: a read-only view of the object store's shared memory; torch: an unpickled copy
            for n, t in unpack_bucket(flat, metas):
                self.params[n].copy_(t)
            return int(flat.size if not isinstance(flat, torch.Tensor) else flat.numel())

        def checksum(self) -> float:
            return float(sum(p.double().sum() for p in self.params.values()))

    return Receiver


def run_ray(ray, receiver, named, bucket_bytes, as_numpy: bool, staging) -> float:
    start = time.perf_counter()
    pending = []
    for bucket in iter_buckets(named, bucket_bytes):
        flat, metas = pack_bucket(bucket, out=staging)  # ray.put copies, so one staging buffer serves all
        ref = ray.put(flat.numpy() if as_numpy else flat)
        pending.append(receiver.load.remote(ref, metas))
    got = sum(ray.get(pending))
    seconds = time.perf_counter() - start
    assert got >= nbytes(named)
    return seconds


def run_shared(ray, server, writer, named, release: bool) -> float:
    if release:
        ray.get(server.sleep.remote())  # untimed: VeRL sleeps the rollout before the actor update
    start = time.perf_counter()
    ray.get(server.begin_weight_update.remote())
    written, sent = writer.write(named)
    ray.get(server.end_weight_update.remote(written, 1))
    seconds = time.perf_counter() - start
    assert sent >= nbytes(named) - max(t.numel() * t.element_size() for _, t in named)  # tied weights once
    return seconds


def shared_memory_rows(ray, named, repeats: int, threads: int) -> dict[str, list[float]]:
    from types import SimpleNamespace

    from rl_tpu.shared_weights import SharedWeightsWriter
    from verl_backend.models import ensure_default_model
    from verl_backend.rollout.server import NativeRolloutServer
    from verl_backend.settings import RECORD_ENV, RlTpuSettings, record

    cfg = SimpleNamespace(prompt_length=128, response_length=64, max_num_seqs=16, dtype="float32")
    server = (
        ray.remote(NativeRolloutServer)
        .options(num_cpus=0, runtime_env={"env_vars": {RECORD_ENV: record(RlTpuSettings(num_threads=threads))}})
        .remote(rollout_config=cfg, model_path=str(ensure_default_model()))
    )
    writer = SharedWeightsWriter(ray.get(server.shared_weights_handle.remote()))
    ray.get(server.shared_weights_attached.remote())
    rows = {}
    for label, release in (("shared memory, weights resident", False), ("shared memory, released by sleep", True)):
        run_shared(ray, server, writer, named, release)  # warm-up
        rows[label] = [run_shared(ray, server, writer, named, release) for _ in range(repeats)]
    out = ray.get(server.generate.remote("check", [1, 2, 3], {"temperature": 0.0, "max_tokens": 2}))
    assert len(out.token_ids) >= 1  # the server serves from the written weights
    writer.close()

    # The default CPU job: the trainer's parameters live in shared memory and the server computes on them. Here the
    # driver's copy of the model stands in for the trainer (the job does the same to FSDP2's parameter storage:
    # verl_backend.workers.engine.share_fsdp_parameters). A sync holds generation, checks every tensor is in place,
    # resumes.
    from transformers import AutoModelForCausalLM

    from rl_tpu.shared_weights import SharedWeights

    trainer = AutoModelForCausalLM.from_pretrained(str(ensure_default_model()), dtype=torch.float32)
    published = SharedWeights(trainer, name="bench_trainer")
    reason = ray.get(server.attach_trainer_weights.remote(published.handle(ray.get_runtime_context().get_node_id())))
    assert reason is None, reason

    def in_place() -> float:
        start = time.perf_counter()
        ray.get(server.begin_weight_update.remote())
        kept, copied = published.publish(trainer.state_dict().items())
        ray.get(server.end_weight_update.remote([], 1))
        seconds = time.perf_counter() - start
        assert copied == 0 and kept >= nbytes(named) - max(t.numel() * t.element_size() for _, t in named)
        return seconds

    in_place()  # warm-up
    rows["shared memory, in place (default)"] = [in_place() for _ in range(repeats)]
    with torch.no_grad():  # an optimizer step in the trainer is what the server serves next: no copy
        trainer.get_output_embeddings().weight.zero_()
    out = ray.get(server.generate.remote("check", [1, 2, 3], {"temperature": 0.0, "max_tokens": 2, "logprobs": True}))
    assert all(lp == out.log_probs[0] for lp in out.log_probs)  # all-zero logits: every token equally likely
    return rows


# --------------------------------------------------------------------------------------------------- gloo
def _gloo_worker(rank: int, port: int, named, bucket_bytes: int, repeats: int, threads: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    from rl_tpu.collectives import init_process_group_from_env

    init_process_group_from_env("cpu", timeout_s=600)
    dst = empty_like_all(named)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for n, t in broadcast_parameters_bucketed(named if rank == 0 else None, src=0, bucket_bytes=bucket_bytes):
            if rank == 1:
                dst[n].copy_(t)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 1:
        assert all(torch.equal(dst[n], t) for n, t in named)
        results.put(times)
    dist.destroy_process_group()


def run_gloo(named, bucket_bytes, repeats, threads) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _gloo_worker,
        args=(port, named, bucket_bytes, repeats, threads, results),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return results.get()


# ------------------------------------------------------------------------------------ gloo checkpoint engine
def _engine_side(role: str, named, bucket_bytes: int, threads: int, inbox, outbox, go) -> None:
    """One side of rl-tpu's ``gloo`` checkpoint engine; per sync (a step from ``inbox``, ``None`` ends) it does what
    VeRL's worker does: ``prepare`` -> (driver: ``build_topology``) -> ``init_process_group`` -> send or receive ->
    ``finalize``. Puts ``(kind, ...)`` on ``outbox``; ``("error", traceback)`` if anything raises."""
    try:
        import asyncio

        from verl_backend.weight_sync.gloo_engine import GlooCheckpointEngine

        torch.set_num_threads(threads)
        engine = GlooCheckpointEngine(bucket_size=bucket_bytes, is_master=role == "trainer", timeout_s=600)
        dst = empty_like_all(named) if role == "rollout" else None  # the rollout's own parameters

        async def send(step: int):
            start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
            return start, await engine.send_weights(iter(named), global_steps=step)

        while (step := inbox.get()) is not None:
            outbox.put(engine.prepare())
            engine.init_process_group(**inbox.get())
            go.wait()  # both in the group: the source's clock starts with the receiver already waiting
            if role == "trainer":
                outbox.put(("sent", *asyncio.run(send(step))))
            else:
                got = 0
                for name, tensor in engine.receive_weights(global_steps=step):
                    dst[name].copy_(tensor)
                    got += tensor.numel() * tensor.element_size()
                outbox.put(("received", time.monotonic(), got))
            engine.finalize()
        outbox.put(("done", dst is None or all(torch.equal(dst[n], t) for n, t in named)))
    except BaseException:  # noqa: BLE001 -- the driver raises it
        import traceback

        outbox.put(("error", traceback.format_exc()))


def run_engine(
    named, bucket_bytes, repeats, threads, other_host: bool = False
) -> tuple[list[float], list[int], list[dict]]:
    """``repeats`` syncs source -> receiver: (seconds, receiver bytes, source metrics) per sync. ``other_host``: the
    receiver gets the source's shared-memory handle with another boot id, as a receiver on another host would."""
    from verl_backend.weight_sync.gloo_engine import GlooCheckpointEngine

    ctx = mp.get_context("spawn")
    go = ctx.Barrier(2)
    boxes = {role: (ctx.Queue(), ctx.Queue()) for role in ("trainer", "rollout")}
    procs = [
        ctx.Process(target=_engine_side, args=(role, named, bucket_bytes, threads, inbox, outbox, go), daemon=True)
        for role, (inbox, outbox) in boxes.items()
    ]

    def reply(role: str):
        got = boxes[role][1].get(timeout=900)  # prepare()'s dict, or a (kind, ...) tuple
        if isinstance(got, tuple) and got[0] == "error":
            raise RuntimeError(f"gloo checkpoint engine, {role} side:\n{got[1]}")
        return got

    for p in procs:
        p.start()
    seconds, received, metrics = [], [], []
    try:
        for step in range(repeats):
            for inbox, _ in boxes.values():
                inbox.put(step)
            actor, rollout = GlooCheckpointEngine.build_topology(1, 1, [reply("trainer"), reply("rollout")])
            if other_host:
                master = rollout["master"][0]
                rollout["master"] = [{**master, "shm": {**master["shm"], "boot_id": "another-host"}}]
            boxes["trainer"][0].put({k: v[0] for k, v in actor.items()})
            boxes["rollout"][0].put({k: v[0] for k, v in rollout.items()})
            (_, start, sent), (_, end, got) = reply("trainer"), reply("rollout")
            seconds.append(end - start)
            received.append(got)
            metrics.append(sent)
        for inbox, _ in boxes.values():
            inbox.put(None)
        assert reply("trainer")[1] and reply("rollout")[1], "the receiver's parameters differ from the payload"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return seconds, received, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MiB (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per path (median shown)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (default 1)")
    ap.add_argument("--synthetic-mb", type=int, default=None, help="random payload of this size instead of SmolLM2")
    ap.add_argument(
        "--engine-bucket-mb", type=int, default=None, help="gloo checkpoint engine bucket in MiB (default: --bucket-mb)"
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["ray", "gloo", "engine"], help="paths to leave out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bucket_bytes = args.bucket_mb << 20
    named = [(n, t.contiguous()) for n, t in payload(args.synthetic_mb)]
    total = nbytes(named)
    dst = empty_like_all(named)
    run_memcpy(named, dst)  # touch the destination pages once
    largest = max(t.numel() * t.element_size() for _, t in named)
    staging = torch.zeros(max(bucket_bytes, largest) + 16 * len(named), dtype=torch.uint8)  # reused pack buffer

    rows: dict[str, list[float]] = {}
    moved: dict[str, int] = {}  # bytes a row measured itself (else the payload's)
    rows["memcpy (reference)"] = [run_memcpy(named, dst) for _ in range(args.repeats)]
    rows["memcpy into fresh pages"] = [run_memcpy_fresh(named) for _ in range(args.repeats)]
    rows["pack+unpack (no transfer)"] = [
        run_pack_unpack(named, dst, bucket_bytes, staging) for _ in range(args.repeats)
    ]
    assert all(torch.equal(dst[n], t) for n, t in named)

    if "ray" not in args.skip:
        import ray

        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=max(1 << 30, 3 * total),
        )
        try:
            receiver = make_receiver(ray, args.threads).remote([(n, t.dtype, tuple(t.shape)) for n, t in named])
            ray.get(receiver.checksum.remote())  # actor up
            for label, as_numpy in (
                ("ray object store (torch tensor)", False),
                ("ray object store (numpy view)", True),
            ):
                run_ray(ray, receiver, named, bucket_bytes, as_numpy, staging)  # warm-up
                rows[label] = [
                    run_ray(ray, receiver, named, bucket_bytes, as_numpy, staging) for _ in range(args.repeats)
                ]
            want = float(sum(t.double().sum() for _, t in named))
            assert abs(ray.get(receiver.checksum.remote()) - want) <= 1e-6 * max(1.0, abs(want))
            ray.kill(receiver)
            if not args.synthetic_mb:  # the real server needs the real model's names
                rows.update(shared_memory_rows(ray, named, args.repeats, args.threads))
        finally:
            ray.shutdown()
    if "gloo" not in args.skip:
        rows["gloo broadcast, 2 processes"] = run_gloo(named, bucket_bytes, args.repeats + 1, args.threads)[1:]
    engine_metrics: dict[str, list[dict]] = {}
    if "engine" not in args.skip:
        engine_mb = args.engine_bucket_mb or args.bucket_mb
        for path, other_host in (("broadcast", True), ("shared memory", False)):
            label = f"gloo engine {engine_mb} MiB, {path}"
            times, received, metrics = run_engine(named, engine_mb << 20, args.repeats + 1, args.threads, other_host)
            sent = {m["weight_sync/pool_bytes"] for m in metrics}
            assert set(received) == {total} and sent == {total}, f"engine moved {received} / {sent}, payload {total}"
            assert {m["weight_sync/pool_shared_memory"] for m in metrics} == {float(not other_host)}, metrics
            rows[label], moved[label], engine_metrics[label] = times[1:], received[-1], metrics[1:]

    gb = total / 1e9
    ref = gb / statistics.median(rows["memcpy (reference)"])
    fresh = gb / statistics.median(rows["memcpy into fresh pages"])
    print(
        f"payload {total} bytes ({gb:.3f} GB) in {len(named)} tensors, bucket {args.bucket_mb} MiB, threads "
        f"{args.threads}, repeats {args.repeats} (median)"
    )
    header = f"{'path':<34} {'bytes':>11} {'seconds':>8} {'GB/s':>7} {'vs memcpy':>9} {'vs fresh':>9}"
    print(header)
    print("-" * len(header))
    for label, times in rows.items():
        sec, rate = statistics.median(times), moved.get(label, total) / 1e9 / statistics.median(times)
        print(
            f"{label:<34} {moved.get(label, total):>11} {sec:>8.3f} {rate:>7.2f} {rate / ref:>9.0%} "
            f"{rate / fresh:>9.0%}"
        )
    for label, metrics in engine_metrics.items():
        median = {k: statistics.median(m[k] for m in metrics) for k in sorted(metrics[0])}
        print(
            f"{label}, the source's metrics (median): "
            + ", ".join(f"{k} {v:.3f}" if k.endswith("seconds") else f"{k} {v:.0f}" for k, v in median.items())
        )


if __name__ == "__main__":
    main()
