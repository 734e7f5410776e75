"""The default process group over ``torch.distributed``, and bucketed weight broadcast.

The same calls run on ``gloo`` (CPU), ``nccl`` (CUDA) and ``tpu_dist`` (TorchTPU). Weight sync packs many
parameters into a few flat byte buckets so that a 135M-parameter model needs a handful of collectives instead of
hundreds: :func:`iter_buckets` groups tensors, :func:`pack_bucket` copies one group into a flat ``uint8`` buffer
with metadata, :func:`unpack_bucket` views the buffer back as tensors without copying, and
:func:`broadcast_parameters_bucketed` does all three around ``dist.broadcast``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from rl_tpu.device import DeviceBackend, get_backend

__all__ = [
    "CollectiveError",
    "TensorMeta",
    "broadcast_parameters_bucketed",
    "init_process_group_from_env",
    "iter_buckets",
    "pack_bucket",
    "unpack_bucket",
    "weight_mismatch",
]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
# Offsets inside a packed bucket are multiples of this, so every dtype (up to complex128) can be viewed in place.
ALIGN_BYTES = 16


class CollectiveError(ValueError):
    """Bad process-group set-up or collective input; one line naming the input and the fix."""


class TensorMeta(NamedTuple):
    """Where one tensor lives in a packed bucket: ``nbytes`` bytes from byte ``offset``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def weight_mismatch(where: str, name: str, dst: torch.Tensor | None, src: torch.Tensor, example: str) -> str | None:
    """Why ``src`` cannot be written into the receiver's tensor ``dst`` named ``name`` in a weight sync, as one line
    starting with ``where``, or ``None`` when it can (``dst is None``: the receiver has no tensor of that name;
    ``example`` is one of its names)."""
    if dst is None:
        return (
            f"{where}: the model has no tensor named {name!r}; send the receiving model's state_dict names "
            f"(e.g. {example!r})"
        )
    if tuple(dst.shape) != tuple(src.shape):
        return (
            f"{where}: {name!r} has shape {tuple(src.shape)}, the model's is {tuple(dst.shape)}; send weights "
            "of the same architecture"
        )
    return None


# ------------------------------------------------------------------------------------------ process groups
def init_process_group_from_env(backend: DeviceBackend | str, timeout_s: float = 1800) -> tuple[int, int]:
    """Join (or reuse) the default process group described by the environment; return ``(rank, world_size)``.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun sets them and as VeRL's Ray
    workers set them. ``LOCAL_RANK`` is not needed here. If the default group already exists it is reused.

    Args:
        backend: a :class:`~rl_tpu.device.DeviceBackend` or its name; its ``dist_backend`` is used
            (``gloo``, ``nccl``, ``tpu_dist``).
        timeout_s: collective timeout in seconds.

    Raises:
        CollectiveError: a variable is missing or not an integer, or RANK is not below WORLD_SIZE.
    """
    b = get_backend(backend)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise CollectiveError(
            f"process group: environment variable(s) {', '.join(missing)} not set; launch with torchrun or as a "
            "Ray worker that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT"
        )
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        int(os.environ["MASTER_PORT"])
    except ValueError:
        raise CollectiveError(
            "process group: RANK, WORLD_SIZE and MASTER_PORT must be integers, got "
            f"RANK={os.environ['RANK']!r} WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
            f"MASTER_PORT={os.environ['MASTER_PORT']!r}"
        ) from None
    if not 0 <= rank < world:
        raise CollectiveError(f"process group: RANK={rank} must be in [0, WORLD_SIZE={world})")
    if b.name == "tpu":
        import torch_tpu  # noqa: F401  # registers the tpu_dist backend when autoload is off

    dist.init_process_group(
        backend=b.dist_backend,
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return rank, world


# --------------------------------------------------------------------------------------------- buckets
def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` bytes.

    A tensor bigger than ``bucket_bytes`` gets a bucket of its own. Sizes count alignment padding.

    Raises:
        CollectiveError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes < 1:
        raise CollectiveError(f"bucket_bytes={bucket_bytes!r}: give a positive size in bytes")
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, t in named_tensors:
        size = _aligned(t.numel() * t.element_size())
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, t))
        used += size
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def bucket_layout(bucket: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Metadata for packing ``bucket`` and the total bytes of the flat buffer (offsets 16-byte aligned)."""
    metas, offset = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, t.dtype, tuple(t.shape), offset, nbytes))
        offset += _aligned(nbytes)
    return metas, offset


def pack_bucket(
    bucket: Iterable[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """Copy a bucket's tensors into one flat ``uint8`` tensor.

    Args:
        bucket: ``(name, tensor)`` pairs on one device.
        out: optional ``uint8`` buffer of at least the packed size to write into (reused across buckets).

    Returns:
        ``(flat, metadata)``: ``flat`` is ``(total_bytes,)`` uint8 on the tensors' device; ``metadata`` lists
        :class:`TensorMeta` ``(name, dtype, shape, offset, nbytes)`` in bucket order.
    """
    bucket = list(bucket)
    metas, total = bucket_layout(bucket)
    if out is not None and (out.dtype != torch.uint8 or out.numel() < total):
        raise CollectiveError(
            f"pack_bucket out: need a uint8 tensor of >= {total} bytes, got {out.dtype} {out.numel()}"
        )
    device = bucket[0][1].device if bucket else torch.device("cpu")
    flat = out[:total] if out is not None else torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), m in zip(bucket, metas):
        if m.nbytes:
            flat[m.offset : m.offset + m.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, metas


def unpack_bucket(flat: torch.Tensor | np.ndarray, metadata: Iterable[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the packed tensors (no copy): ``[(name, tensor of dtype/shape), ...]``.

    ``flat`` may also be the numpy array ``ray.get`` returns for ``ray.put(flat.numpy())``: Ray stores numpy
    buffers out-of-band, so the views then read the object store's shared memory directly (read-only: copy them,
    don't write them). Putting the torch tensor itself makes Ray pickle its bytes, many times slower
    (``benchmarks/bench_weight_sync.py``). The views share ``flat``'s memory: copy them (e.g. ``param.copy_(t)``)
    before reusing the buffer.

    Raises:
        CollectiveError: ``flat`` is too short for the metadata.
    """
    if isinstance(flat, np.ndarray):
        with warnings.catch_warnings():  # read-only object-store memory: torch warns that writes would fail
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(flat.reshape(-1).view(np.uint8))
    out = []
    for m in metadata:
        m = TensorMeta(*m)
        if m.offset + m.nbytes > flat.numel():
            raise CollectiveError(
                f"unpack_bucket: {m.name!r} needs bytes [{m.offset}, {m.offset + m.nbytes}) but the buffer has "
                f"{flat.numel()}; pass the flat tensor that pack_bucket returned with this metadata"
            )
        out.append((m.name, flat[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)))
    return out


def broadcast_parameters_bucketed(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
    src: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Send rank ``src``'s tensors to every rank of ``group``, one packed bucket per broadcast.

    A generator: every rank must iterate it to the end (each bucket is two collectives: the metadata as a
    pickled object, then the bytes). On ``src`` it yields the tensors it was given (packing reuses one staging
    buffer); on the others, views of the received buffers, which stay valid (each bucket gets a fresh buffer).

    Args:
        named_tensors: on ``src``, the ``(name, tensor)`` pairs to send; ignored (may be ``None``) elsewhere.
        src: global rank that sends.
        bucket_bytes: most bytes per bucket (a bigger tensor goes alone).
        group: process group (default: the world).
        device: where receivers allocate buffers; default ``cpu`` for gloo, else the current accelerator.

    Yields:
        ``(name, tensor)`` in the sender's order.
    """
    rank = dist.get_rank()
    if device is None:
        backend = dist.get_backend(group)
        device = "cpu" if backend == "gloo" else torch.accelerator.current_accelerator()
    if rank == src:
        if named_tensors is None:
            raise CollectiveError("broadcast_parameters_bucketed: the src rank must pass named_tensors")
        staging: torch.Tensor | None = None  # one send buffer, reused: fresh pages cost more than the copy
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            need = bucket_layout(bucket)[1]
            if staging is None or staging.numel() < need:
                staging = torch.empty(max(need, bucket_bytes), dtype=torch.uint8, device=bucket[0][1].device)
            flat, metas = pack_bucket(bucket, out=staging)
            dist.broadcast_object_list([(flat.numel(), metas)], src=src, group=group)
            dist.broadcast(flat, src=src, group=group)
            yield from bucket
        dist.broadcast_object_list([None], src=src, group=group)  # end of stream
        return
    while True:
        box: list[tuple[int, list[TensorMeta]] | None] = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        if box[0] is None:
            return
        total, metas = box[0]
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=src, group=group)
        yield from unpack_bucket(flat, metas)
