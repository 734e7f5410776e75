"""Transport ``pool_shared_memory`` (route 5): the ``gloo`` checkpoint engine's stream
(:class:`~verl_backend.weight_sync.pool_broadcast.PoolBroadcast`) when every rollout worker is on trainer rank 0's
host: each bucket is packed into a shared-memory file and only its header goes over gloo. One all-reduce at the start
of the sync (in :mod:`verl_backend.weight_sync.gloo_engine`) confirms that every receiver mapped the file, else the
whole group takes ``pool_broadcast`` (never a mix). The source packs bucket k+1 into the free half while the receivers
copy bucket k out; a one-number all-reduce per bucket says a half may be reused.

The source (trainer rank 0) makes one anonymous shared-memory file per sync (Linux ``memfd_create``) with two
bucket-sized halves: :class:`BucketFile`. Each rollout worker maps it read-only through ``/proc/<pid>/fd/<fd>``
(:class:`rl_tpu.shared_weights.SharedWeightsReader`) with :func:`map_bucket_file`, which refuses a handle from
another host (the kernel's boot id differs) or another process namespace (the random nonce in the file's first
bytes differs): the engine then sends the bytes over gloo as before. Layout of the file::

    [0, 16)                           nonce (random, written once by the source)
    [HEADER, HEADER + bucket)         half 0
    [HEADER + bucket, HEADER + 2 bucket)  half 1

The file lives while the source holds its descriptor or anyone maps it: closed by every side in the engine's
``finalize``, it leaves nothing in ``/dev/shm`` (and is not bound by its size).
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch

from rl_tpu.shared_weights import SharedWeightsReader, shared_memory_supported
from verl_backend.weight_sync.pool_broadcast import PoolBroadcast, all_min

HEADER = 4096  # bytes before half 0: the nonce, and the halves start on a page
_NONCE = 16  # bytes
_NAME = "rl_tpu_pool_sync"  # the file's label in /proc/<pid>/fd and /proc/<pid>/maps


def boot_id() -> str | None:
    """This host's boot id (``/proc/sys/kernel/random/boot_id``: new on every boot, one per host); ``None`` if
    unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


class BucketFile:
    """Source side: a shared-memory file of ``2 * bucket_size`` bytes of buckets (two halves) after a header.

    Args:
        bucket_size: bytes per half (the engine's bucket size).

    Raises:
        OSError: the platform has no ``memfd_create`` or ``/proc``, or the file cannot be made or mapped.
    """

    def __init__(self, bucket_size: int) -> None:
        if not shared_memory_supported() or boot_id() is None:
            raise OSError("no memfd_create, /proc or boot id on this platform")
        self.bucket_size = int(bucket_size)
        self.nbytes = HEADER + 2 * self.bucket_size
        self.nonce = os.urandom(_NONCE)
        self.fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)  # sparse: a page costs memory once a bucket is written into it
            self._mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._mm[:_NONCE] = self.nonce
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def handle(self) -> dict:
        """What a receiver needs to map the file: ``{"pid", "fd", "nbytes", "bucket_size", "boot_id", "nonce"}``
        (JSON-able; ``nonce`` in hex)."""
        return {
            "pid": os.getpid(),
            "fd": self.fd,
            "nbytes": self.nbytes,
            "bucket_size": self.bucket_size,
            "boot_id": boot_id(),
            "nonce": self.nonce.hex(),
        }

    def half(self, index: int) -> torch.Tensor:
        """Half ``index`` (0 or 1) of the file as a writable uint8 tensor of ``bucket_size`` bytes."""
        start = HEADER + index * self.bucket_size
        return self._bytes[start : start + self.bucket_size]

    def close(self) -> None:
        """Unmap and close the descriptor (the pages go once no receiver maps them either)."""
        self._bytes = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._mm.close()
        except BufferError:  # a view outlived the sync (an exception's frame): the mapping goes with it
            pass


class BucketMapping:
    """Receiver side: a read-only mapping of a source's :class:`BucketFile` (made by :func:`map_bucket_file`)."""

    def __init__(self, reader: SharedWeightsReader) -> None:
        self._reader = reader

    def view(self, half: int, length: int) -> torch.Tensor:
        """The first ``length`` bytes of half ``half`` as a read-only view of the mapping (uint8): valid until the
        source reuses the half; never write it.

        Raises:
            ValueError: ``half`` is not 0 or 1, or ``length`` exceeds the half.
        """
        view = self._reader.tensors[f"half{int(half)}"] if half in (0, 1) else None
        if view is None or not 0 <= length <= view.numel():
            raise ValueError(
                f"bucket of {length} bytes in half {half}: the shared file has halves 0 and 1 of "
                f"{self._reader.tensors['half0'].numel()} bytes"
            )
        return view[:length]

    def copy_out(self, half: int, length: int) -> torch.Tensor:
        """:meth:`view`, copied into a fresh uint8 tensor (the caller may keep it after the source reuses the half).

        Raises:
            ValueError: as :meth:`view`.
        """
        return self.view(half, length).clone()

    def close(self) -> None:
        """Unmap (the mapping's own descriptor closes with it)."""
        self._reader.close()


def map_bucket_file(handle: dict | None) -> tuple[BucketMapping | None, str]:
    """Map the source's :class:`BucketFile` read-only, if it is on this host and in this process namespace.

    Returns:
        ``(mapping, "")``, or ``(None, why not)`` in words; never raises for a file it cannot use.
    """
    if not handle:
        return None, "the trainer made no shared-memory file"
    if handle.get("boot_id") is None or handle["boot_id"] != boot_id():
        return None, "the trainer is on another host (boot id differs)"
    bucket, nbytes = int(handle["bucket_size"]), int(handle["nbytes"])
    slots = [
        (("nonce",), "uint8", (_NONCE,), 0, _NONCE),
        (("half0",), "uint8", (bucket,), HEADER, bucket),
        (("half1",), "uint8", (bucket,), HEADER + bucket, bucket),
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            reader = SharedWeightsReader({"pid": handle["pid"], "fd": handle["fd"], "nbytes": nbytes, "slots": slots})
    except (OSError, ValueError) as exc:  # gone, /proc access denied, or smaller than the handle says
        return None, f"cannot map the trainer's shared-memory file ({type(exc).__name__}: {exc})"
    if reader.tensors["nonce"].numpy().tobytes() != bytes.fromhex(handle["nonce"]):
        reader.close()
        return None, "the trainer's pid names another process here (another pid namespace: nonce differs)"
    return BucketMapping(reader), ""


class PoolSharedMemory(PoolBroadcast):
    """:class:`PoolBroadcast` with the bytes in a shared-memory file: ``file`` (:class:`BucketFile`) on the source,
    ``mapping`` (:class:`BucketMapping`) on a receiver."""

    name = "pool_shared_memory"

    def __init__(
        self, group, bucket_size: int, file: BucketFile | None = None, mapping: BucketMapping | None = None
    ) -> None:
        super().__init__(group, bucket_size)
        self.file, self.mapping = file, mapping

    def describe(self) -> str:
        return "shared-memory buckets"

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.file.half(0), self.file.half(1)

    def after_header(self, buffer: torch.Tensor, length: int, index: int, last: bool) -> None:
        """The bytes are in half ``index % 2`` already; the receivers' copy of bucket ``index - 1`` is awaited, so its
        half may be reused (and of the last one: the sync is done when the source returns)."""
        if index:
            all_min(self.group, 1)
        if last:
            all_min(self.group, 1)

    def read(self, length: int, index: int, keep: bool, views: bool) -> torch.Tensor:
        if index:
            all_min(self.group, 1)  # the consumer is done with bucket index - 1: the source may reuse its half
        if not keep:
            return torch.empty(0, dtype=torch.uint8)
        return (self.mapping.view if views else self.mapping.copy_out)(index % 2, length)

    def after_read(self, last: bool) -> None:
        if last:
            all_min(self.group, 1)  # the consumer is done with the last bucket: the sync ends for the source
