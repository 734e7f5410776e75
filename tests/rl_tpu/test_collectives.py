"""The process group and bucketed broadcast on real gloo process groups (spawned processes) and the bucket packing
they use."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_tpu.collectives import (
    CollectiveError,
    broadcast_parameters_bucketed,
    init_process_group_from_env,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A state dict of mixed dtypes and shapes, including a scalar, an empty and a non-contiguous tensor."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(50, 16, generator=g)),
        ("layer.0.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("layer.0.weight.t", torch.randn(16, 12, generator=g).t()),  # non-contiguous
        ("step", torch.tensor(123456789012, dtype=torch.int64)),  # 0-d
        ("empty", torch.empty(0, 3)),
        ("mask", torch.rand(9, generator=g) > 0.5),
        ("half", torch.randn(3, 5, generator=g).half()),
        ("big", torch.randn(300, generator=g, dtype=torch.float64)),
    ]


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    assert init_process_group_from_env("cpu", timeout_s=60) == (rank, world)
    assert dist.get_backend() == "gloo"
    # the default group is reused, not re-created
    assert init_process_group_from_env("cpu") == (rank, world)

    # bucketed weight broadcast from rank 1: 200-byte buckets force several buckets and a lone oversized tensor
    src = 1
    sent = _weights(seed=7)
    got = list(broadcast_parameters_bucketed(sent if rank == src else None, src=src, bucket_bytes=200))
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (name, want), (_, have) in zip(sent, got):
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.equal(have, want), name
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_process_group_and_bucketed_broadcast(world: int) -> None:
    mp.start_processes(_worker, args=(world, _free_port()), nprocs=world, join=True, start_method="spawn")


def test_pack_unpack_round_trip_is_aligned_and_zero_copy() -> None:
    bucket = _weights(seed=1)
    flat, metas = pack_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert all(m.offset % 16 == 0 for m in metas)
    assert [m.name for m in metas] == [n for n, _ in bucket]
    unpacked = unpack_bucket(flat, metas)
    for (name, want), (uname, have) in zip(bucket, unpacked):
        assert uname == name and have.dtype == want.dtype and torch.equal(have, want), name
    # views, not copies: writing the buffer changes the unpacked tensor
    flat[metas[0].offset : metas[0].offset + 4].zero_()
    assert unpacked[0][1].reshape(-1)[0].item() == 0.0


def test_unpack_from_a_read_only_numpy_buffer() -> None:
    """The Ray object-store path: ray.put(flat.numpy()) comes back as a read-only numpy array."""
    bucket = _weights(seed=4)
    flat, metas = pack_bucket(bucket)
    arr = flat.numpy().copy()
    arr.setflags(write=False)
    for (name, want), (_, have) in zip(bucket, unpack_bucket(arr, metas)):
        assert have.dtype == want.dtype and torch.equal(have, want), name


def test_pack_into_reused_buffer() -> None:
    bucket = _weights(seed=2)[:3]
    buf = torch.empty(1 << 16, dtype=torch.uint8)
    flat, metas = pack_bucket(bucket, out=buf)
    assert flat.data_ptr() == buf.data_ptr()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket, unpack_bucket(flat, metas)))
    with pytest.raises(CollectiveError, match="uint8"):
        pack_bucket(bucket, out=torch.empty(8, dtype=torch.uint8))


def test_iter_buckets_respects_size_and_order() -> None:
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 10, 100, 1, 1])]  # float32: 40, 400, 4 B
    buckets = list(iter_buckets(tensors, bucket_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    with pytest.raises(CollectiveError, match="bucket_bytes"):
        next(iter_buckets(tensors, bucket_bytes=0))


def test_unpack_rejects_short_buffer() -> None:
    flat, metas = pack_bucket(_weights(seed=3))
    with pytest.raises(CollectiveError, match="embed.weight|needs bytes"):
        unpack_bucket(flat[:10], metas)


def test_init_process_group_names_missing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(CollectiveError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_process_group_from_env("cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "notaport")
    with pytest.raises(CollectiveError, match="integers"):
        init_process_group_from_env("cpu")
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(CollectiveError, match="RANK=2"):
        init_process_group_from_env("cpu")
