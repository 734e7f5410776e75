"""Weight sync between two processes on one host through shared memory: the receiver copies nothing.

The receiving side (the rollout server) moves its model's parameters into one anonymous shared-memory file
(Linux ``memfd_create``) with :class:`SharedWeights`: every parameter becomes a view of that file, so the model
computes on it as before. The sending side (the trainer worker on the same host) maps the same file through
``/proc/<pid>/fd/<fd>`` with :class:`SharedWeightsWriter` and copies each new tensor straight into its slot. A weight
sync is then one memory copy of the model's bytes and two small calls (hold generation / resume), instead of
pack -> object store -> unpack -> copy. It is the CPU counterpart of the CUDA-IPC weight handles that VeRL's
vLLM and SGLang rollouts use in colocated mode.

:meth:`SharedWeights.release` gives the pages back to the OS (``madvise(MADV_REMOVE)``; they read as zeros after)
while the rollout sleeps, as VeRL's ``free_cache_engine`` asks of a colocated rollout during the actor update; the
next sync writes every slot again.

The other way round is cheaper still, and the default for one trainer rank on a CPU host: the *trainer* keeps its
own parameters in such a file (:meth:`SharedWeights.from_tensors` over FSDP2's local shards, see
``verl_backend.workers.engine``), and the rollout server maps it read-only with :class:`SharedWeightsReader` and
computes on it. An optimizer step then *is* the weight sync: :meth:`SharedWeights.publish` finds every tensor already in
place and copies 0 bytes (VeRL's colocated loop never samples while the actor updates, so no batch sees a half-written
step).

The file lives as long as a process holds it open or mapped: a killed rollout server leaves nothing behind in
``/dev/shm`` (and the file is not bound by the size of ``/dev/shm``, often 64 MiB in containers).
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from rl_tpu.collectives import weight_mismatch

__all__ = [
    "SharedWeights",
    "SharedWeightsError",
    "SharedWeightsReader",
    "SharedWeightsWriter",
    "Slot",
    "shared_memory_supported",
]

_ALIGN = 64  # bytes; slots start on cache-line boundaries (and satisfy every dtype's alignment)


class SharedWeightsError(ValueError):
    """A name, shape or handle that does not match the shared weights; one line naming it and the fix."""


class Slot(NamedTuple):
    """One distinct tensor of the model in the shared file: ``nbytes`` bytes from byte ``offset``.

    ``names`` lists every ``state_dict`` key that refers to it (tied weights, e.g. ``lm_head.weight`` and
    ``model.embed_tokens.weight``, share one slot).
    """

    names: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def shared_memory_supported() -> bool:
    """Whether this platform can create the shared file (Linux ``memfd_create`` and ``/proc``)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SharedWeightsError(
            f"slot dtype {name!r} is not a torch dtype: the handle is corrupt; ask the owner again"
        )
    return dtype


def _views(mm: mmap.mmap, slots: Iterable[Slot]) -> list[torch.Tensor]:
    """One tensor per slot, each with its own storage starting at the slot (not views of one byte tensor: torch 2.13
    cannot pickle a ``DTensor`` whose local tensor sits at an offset in a shared ``frombuffer`` storage, and
    checkpoints pickle the trainer's parameters)."""
    views = []
    with warnings.catch_warnings():  # a read-only mapping gives read-only tensors: that is the point
        warnings.simplefilter("ignore", UserWarning)
        for s in slots:
            dtype = _dtype(s.dtype)
            count = s.nbytes // dtype.itemsize
            if count == 0:
                views.append(torch.empty(s.shape, dtype=dtype))
                continue
            views.append(torch.frombuffer(mm, dtype=dtype, count=count, offset=s.offset).view(s.shape))
    return views


def _rebind_data_entries(named: Mapping[str, torch.Tensor]) -> list:
    """``(names, tensor, rebind)`` per distinct tensor of ``named`` (tied ones once), rebinding its ``.data``."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for key, tensor in named.items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(key)

    def rebind(tensor: torch.Tensor, view: torch.Tensor) -> None:
        tensor.data = view

    return [(names, tensor, rebind) for names, tensor in groups.values()]


class SharedWeights:
    """Owner side: move ``module``'s ``state_dict`` tensors into one shared-memory file, in place.

    After construction every parameter and persistent buffer of ``module`` is a view of the file (same values,
    same ``Parameter`` objects: anything holding them stays valid); the old storage is freed.

    Args:
        module: a CPU module (its tensors must be on the ``cpu`` device).
        name: label of the file (shows in ``/proc/<pid>/fd``).

    Attributes:
        slots: the layout, one :class:`Slot` per distinct tensor.
        nbytes: size of the file in bytes.
        resident: ``False`` after :meth:`release` until every slot has been written again
            (:meth:`mark_written`).

    Raises:
        SharedWeightsError: a tensor not on the CPU, or a platform without ``memfd_create``.
    """

    def __init__(self, module: torch.nn.Module, name: str = "rl_tpu_weights") -> None:
        self._create(_rebind_data_entries(module.state_dict(keep_vars=True)), name)

    @classmethod
    def from_named_tensors(cls, named: Mapping[str, torch.Tensor], name: str = "rl_tpu_weights") -> SharedWeights:
        """Like the constructor, for a module's ``state_dict(keep_vars=True)`` under other names (e.g. VeRL's
        ``convert_weight_keys``): each distinct tensor's ``.data`` becomes its view of the file, and a tensor that
        appears under several names (tied weights) gets one slot holding all of them.

        Raises:
            SharedWeightsError: as the constructor.
        """
        self = cls.__new__(cls)
        self._create(_rebind_data_entries(named), name)
        return self

    @classmethod
    def from_tensors(
        cls,
        entries: Iterable[tuple[Sequence[str], torch.Tensor, Callable[[torch.Tensor, torch.Tensor], None]]],
        name: str = "rl_tpu_weights",
    ) -> SharedWeights:
        """Owner side for tensors that are not plain module attributes (e.g. FSDP2's sharded parameter storage).

        Args:
            entries: ``(names, tensor, rebind)`` per distinct tensor: ``names`` are the keys a reader looks it up
                by, ``tensor`` its current (CPU, contiguous) data, and ``rebind(tensor, view)`` is called once the
                file holds a copy, to make the owner compute on ``view`` from then on.
            name: label of the file.

        Raises:
            SharedWeightsError: a tensor not on the CPU or not contiguous, or a platform without ``memfd_create``.
        """
        self = cls.__new__(cls)
        self._create(list(entries), name)
        return self

    def _create(self, entries: list, name: str) -> None:
        if not shared_memory_supported():
            raise SharedWeightsError("shared-memory weights need Linux (memfd_create and /proc): use the object store")
        slots, offset = [], 0
        for names, tensor, _ in entries:
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                where = "is not contiguous" if tensor.device.type == "cpu" else f"is on {tensor.device}"
                raise SharedWeightsError(
                    f"{names[0]!r} {where}: shared-memory weights hold contiguous CPU tensors only; move the model "
                    "to the CPU or sync through the object store"
                )
            nbytes = tensor.numel() * tensor.element_size()
            slots.append(
                Slot(tuple(names), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes)
            )
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.slots: list[Slot] = slots
        self.nbytes = max(offset, _ALIGN)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        views = _views(self._mm, slots)
        with torch.no_grad():
            for (_, tensor, rebind), view in zip(entries, views):
                view.copy_(tensor.detach())
                rebind(tensor, view)
        self._by_name = {n: (i, view) for i, (slot, view) in enumerate(zip(slots, views)) for n in slot.names}
        self.resident = True

    def handle(self, node_id: str | None = None) -> dict:
        """What a writer needs to map the file: ``{"pid", "fd", "nbytes", "node_id", "slots"}`` (picklable)."""
        return {
            "pid": os.getpid(),
            "fd": self.fd,
            "nbytes": self.nbytes,
            "node_id": node_id,
            "slots": [tuple(s) for s in self.slots],
        }

    def release(self) -> None:
        """Give the file's pages back to the OS; the weights read as zeros until every slot is written again."""
        self._mm.madvise(mmap.MADV_REMOVE)
        self.resident = False

    def mark_written(self, slot_indices: Iterable[int]) -> None:
        """Record a complete write by a :class:`SharedWeightsWriter` (makes the weights :attr:`resident` again).

        Raises:
            SharedWeightsError: after :meth:`release`, some slots were not written (they would read as zeros);
                the message names them. Send the whole ``state_dict``.
        """
        missing = set(range(len(self.slots))) - set(slot_indices)
        if missing and not self.resident:
            names = [self.slots[i].names[0] for i in sorted(missing)]
            raise SharedWeightsError(
                f"weight sync wrote {len(self.slots) - len(missing)} of {len(self.slots)} tensors after the rollout "
                f"released its weights; missing {names[:3]}{' ...' if len(names) > 3 else ''}: send every tensor of "
                "the model's state_dict"
            )
        self.resident = True

    @torch.no_grad()
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Make ``named_tensors`` what readers of the file see, copying only what is not already there.

        For an owner that computes on the file itself (e.g. a trainer whose parameters are views of it), each
        tensor that *is* its slot (same address, shape and dtype) costs nothing; any other is copied in (dtype
        converted on copy).

        Returns:
            ``(bytes in place, bytes copied)``; a tied tensor counts once.

        Raises:
            SharedWeightsError: a name the file does not hold, or a different shape.
        """
        seen: set[int] = set()
        in_place = copied = 0
        for name, tensor in named_tensors:
            index, view = self._by_name.get(name, (None, None))
            problem = weight_mismatch("weight sync", name, view, tensor, next(iter(self._by_name)))
            if problem:
                raise SharedWeightsError(problem)
            same = (
                tensor.data_ptr() == view.data_ptr() and tensor.dtype == view.dtype and tensor.stride() == view.stride()
            )
            if not same:
                view.copy_(tensor)
            if index not in seen:
                seen.add(index)
                if same:
                    in_place += self.slots[index].nbytes
                else:
                    copied += self.slots[index].nbytes
        return in_place, copied

    def close(self) -> None:
        """Close the file descriptor and unmap (the pages go once no view and no other process holds them)."""
        self._by_name.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._mm.close()
        except BufferError:  # a view is still alive; the mapping goes when it does
            pass


def _map(handle: dict, writable: bool) -> tuple[list[Slot], mmap.mmap, list[torch.Tensor]]:
    slots = [Slot(tuple(s[0]), *s[1:]) for s in handle["slots"]]
    fd = os.open(
        f"/proc/{int(handle['pid'])}/fd/{int(handle['fd'])}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
    )
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, int(handle["nbytes"]), mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    return slots, mm, _views(mm, slots)


class SharedWeightsReader:
    """Read-only side: map another process's :class:`SharedWeights` file on this host and compute on it.

    The views are backed by the owner's pages (no copy). They are mapped read-only: an in-place write to them
    kills this process (``SIGSEGV``) instead of silently changing the owner's weights.

    Args:
        handle: :meth:`SharedWeights.handle` of the owner.

    Raises:
        OSError: the owner's file cannot be opened (another host, the owner has exited, or ``/proc`` access is
            denied): fall back to another transport.
    """

    def __init__(self, handle: dict) -> None:
        self.slots, self._mm, views = _map(handle, writable=False)
        self.pid = int(handle["pid"])
        self.tensors: dict[str, torch.Tensor] = {n: v for slot, v in zip(self.slots, views) for n in slot.names}

    def close(self) -> None:
        """Drop the views; the mapping goes once nothing else holds them."""
        self.tensors.clear()
        try:
            self._mm.close()
        except BufferError:
            pass


class SharedWeightsWriter:
    """Sender side: map a :class:`SharedWeights` file of another process on this host and write into it.

    Args:
        handle: :meth:`SharedWeights.handle` of the owner.

    Raises:
        OSError: the owner's file cannot be opened (another host, the owner has exited, or ``/proc`` access is
            denied): fall back to another transport.
    """

    def __init__(self, handle: dict) -> None:
        self.slots, self._mm, views = _map(handle, writable=True)
        self._by_name = {
            name: (i, view) for i, (slot, view) in enumerate(zip(self.slots, views)) for name in slot.names
        }

    @torch.no_grad()
    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
        """Copy each ``(name, tensor)`` into its slot (dtype converted on copy; CPU tensors).

        A per-expert name (``...experts.<e>.up_proj.weight``, as VeRL exports a mixture of experts) whose model holds
        the experts fused goes into its slice of the fused slot (:func:`rl_tpu.expert_slices.expert_slice`); such
        a slot counts as written once every element has been.

        Returns:
            ``(slot indices written, bytes written)``; pass the indices to the owner's
            :meth:`SharedWeights.mark_written`.

        Raises:
            SharedWeightsError: a name the owner's model does not have, or a different shape.
        """
        from rl_tpu.expert_slices import expert_slice

        written, nbytes = set(), 0
        partial: dict[int, int] = {}  # fused slot -> elements written so far
        for name, tensor in named_tensors:
            index, view = self._by_name.get(name, (None, None))
            piece = expert_slice(name, lambda n: self._by_name.get(n, (None, None))[1]) if view is None else None
            if piece is not None:
                index, view = self._by_name[piece[0]][0], piece[1]
            problem = weight_mismatch("weight sync", name, view, tensor, next(iter(self._by_name)))
            if problem:
                raise SharedWeightsError(problem)
            view.copy_(tensor)
            if piece is not None:
                partial[index] = partial.get(index, 0) + view.numel()
                nbytes += view.numel() * view.element_size()
                if partial[index] >= self._by_name[piece[0]][1].numel() and index not in written:
                    written.add(index)
            elif index not in written:
                written.add(index)
                nbytes += self.slots[index].nbytes
        return sorted(written), nbytes

    def close(self) -> None:
        """Unmap the file (views handed out before become invalid)."""
        self._by_name.clear()
        try:
            self._mm.close()
        except BufferError:  # a view is still alive; the mapping goes when it does
            pass
