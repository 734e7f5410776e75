"""The weight sync's shared vocabulary: the transport registry (each transport's name, its stable route number and
its class), the sender's report, the :class:`Transport` interface every transport implements, and the trainer's
explicit hand-over of its weights.

Adding a transport: its module (a :class:`Transport` subclass) and one line in :data:`REGISTRY`; the route choice
(:func:`verl_backend.weight_sync.route.choose_route`) says when it is taken. Nothing else branches on its name.

Import-light (no VeRL, no Ray): the engine (:mod:`verl_backend.workers.engine`) and the ``verl train`` driver import it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Registered:
    """One transport of :data:`REGISTRY`.

    Attributes:
        name: the transport's name (:attr:`Transport.name`, ``SyncReport.transport``, the route's name in logs).
        route: its number, ``weight_sync/route`` in ``metrics.jsonl``: stable, never reused for another transport.
        cls: ``"module:Class"`` of its :class:`Transport` subclass, imported on first use (:func:`transport_class`:
            some transports import VeRL or Ray, this module does not).
        how: how it carries the weights, in a few words (``--print-config``'s plan, the run's route line).
        bucketed: it sends buckets of ``bucket_bytes`` (the plan names their size).
    """

    name: str
    route: int
    cls: str
    how: str
    bucketed: bool = False


_PACKAGE = "verl_backend.weight_sync"

#: every transport, by name, one line each, in the order of their route numbers
REGISTRY: dict[str, Registered] = {
    r.name: r
    for r in (
        Registered("in_worker", 0, f"{_PACKAGE}.in_worker:InWorker", "in the trainer worker"),
        Registered("trainer_memory", 1, f"{_PACKAGE}.trainer_memory:TrainerMemory", "shared memory, in place"),
        Registered("shared_memory", 2, f"{_PACKAGE}.shared_memory:SharedMemory", "shared memory, copied once"),
        Registered("object_store", 3, f"{_PACKAGE}.object_store:ObjectStore", "Ray object store", bucketed=True),
        Registered(
            "pool_broadcast",
            4,
            f"{_PACKAGE}.pool_broadcast:PoolBroadcast",
            "gloo broadcast between pools",
            bucketed=True,
        ),
        Registered(
            "pool_shared_memory",
            5,
            f"{_PACKAGE}.pool_shared_memory:PoolSharedMemory",
            "shared-memory buckets between pools",
            bucketed=True,
        ),
    )
}

#: every transport's name, in the order of their route numbers
TRANSPORTS = tuple(sorted(REGISTRY, key=lambda name: REGISTRY[name].route))

_HANDED_OVER: dict[str, object] = {}  # role -> SharedWeights the trainer's engine handed over in this process


def registered(transport: str) -> Registered:
    """The :data:`REGISTRY` entry of ``transport``.

    Raises:
        ValueError: a name not in :data:`REGISTRY`.
    """
    try:
        return REGISTRY[transport]
    except KeyError:
        raise ValueError(f"weight sync transport {transport!r}: expected one of {TRANSPORTS}") from None


def route_number(transport: str) -> int:
    """The stable route number of ``transport`` (:attr:`Registered.route`: what ``weight_sync/route`` logs).

    Raises:
        ValueError: a name not in :data:`REGISTRY`.
    """
    return registered(transport).route


def transport_class(transport: str) -> type[Transport]:
    """The :class:`Transport` subclass of ``transport`` (its module imported now).

    Raises:
        ValueError: a name not in :data:`REGISTRY`.
    """
    module, _, name = registered(transport).cls.partition(":")
    return getattr(importlib.import_module(module), name)


def hand_over(weights, role: str = "actor") -> None:
    """The trainer's engine hands its parameters (a :class:`rl_tpu.shared_weights.SharedWeights`, or ``None`` to
    withdraw them) to the weight sync of this process."""
    if weights is None:
        _HANDED_OVER.pop(role, None)
    else:
        _HANDED_OVER[role] = weights


def handed_over(role: str = "actor"):
    """The ``SharedWeights`` the trainer handed over in this process, or ``None``."""
    return _HANDED_OVER.get(role)


@dataclass
class SyncReport:
    """One sync, as measured by the sender.

    Attributes:
        version: the trainer step whose weights the rollout serves after the sync (``None``: not given).
        transport: one of :data:`TRANSPORTS`.
        bytes: bytes of weights the sync covered (sent, written, or checked in place).
        copied_bytes: bytes actually copied (0 for ``trainer_memory`` when every tensor is in place).
        seconds: wall time of the sync, from the first tensor to the rollout serving the new weights.
        buckets: buckets sent (object store, pool transports; 0 for the others).
        verified: the rollout proved it computes with the weights sent (set by the verification; ``False`` until
            then).
    """

    version: int | None
    transport: str
    bytes: float
    copied_bytes: float
    seconds: float
    buckets: int = 0
    verified: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Every field (the transport as a name): the adapter's ``last_sync``."""
        return {
            "version": self.version,
            "transport": self.transport,
            "bytes": float(self.bytes),
            "copied_bytes": float(self.copied_bytes),
            "seconds": float(self.seconds),
            "buckets": float(self.buckets),
            "verified": float(self.verified),
        }

    def as_metrics(self) -> dict[str, float]:
        """The step metrics every transport reports under the same names: ``weight_sync/route`` (the transport's
        number, :func:`route_number`), ``weight_sync/bytes``, ``weight_sync/seconds``, ``weight_sync/verified``
        (1.0 verified, 0.0 not)."""
        return {
            "weight_sync/route": float(route_number(self.transport)),
            "weight_sync/bytes": float(self.bytes),
            "weight_sync/seconds": float(self.seconds),
            "weight_sync/verified": float(self.verified),
        }


@dataclass
class ReplicaEnd:
    """What a rollout replica's adapter (in the trainer worker, or a rollout pool's worker) holds for its syncs, from
    which :meth:`Transport.for_replica` builds the transport of its route.

    Attributes:
        server: the replica's rollout server actor handle (``None`` on a rank that does not talk to it).
        sampler: this process's :class:`rl_tpu.sampler.Sampler` (``sampler_placement=worker``), else ``None``.
        attached: the trainer's :class:`rl_tpu.shared_weights.SharedWeights` the server computes on, else ``None``.
        writer: the server's weights mapped here (:class:`rl_tpu.shared_weights.SharedWeightsWriter`), else ``None``.
        bucket_bytes: bucket size in bytes of a bucketed route (0 otherwise).
        colocated: the adapter lives in a trainer worker (``False``: a standalone replica's worker).
        shared_weights: the ``rl_tpu.shared_weights`` setting.
    """

    server: Any = None
    sampler: Any = None
    attached: Any = None
    writer: Any = None
    bucket_bytes: int = 0
    colocated: bool = True
    shared_weights: bool = True


class Transport(ABC):
    """One way weights go from the trainer to a rollout replica. Every transport of the package implements it and
    has one line in :data:`REGISTRY`.

    - trainer side: :meth:`send` the ``(name, tensor)`` stream of one version; returns the :class:`SyncReport`;
    - rollout side: :meth:`receive` hands what arrived to the rollout's one apply function
      (:func:`verl_backend.weight_sync.apply.load`, through the rollout server's ``apply`` or the in-worker
      sampler), then the new weights go live (:func:`verl_backend.weight_sync.apply.live`);
    - :meth:`for_replica`: the transport a replica's adapter uses, built from its :class:`ReplicaEnd`;
    - :meth:`describe`, :meth:`first_sync_words`: the transport in words, for logs and ``--print-config``.
    """

    name: ClassVar[str]

    @classmethod
    def for_replica(cls, end: ReplicaEnd) -> Transport:
        """The transport a rollout replica's adapter sends with, from what it holds (``end``).

        Raises:
            NotImplementedError: a transport no replica's adapter sends with (the pool transports: VeRL's ``gloo``
                checkpoint engine carries them, :mod:`verl_backend.weight_sync.gloo_engine`).
        """
        raise NotImplementedError(f"weight sync transport {cls.name!r} is not sent by a rollout replica's adapter")

    def describe(self) -> str:
        """The transport in a few words."""
        return self.name.replace("_", " ")

    def first_sync_words(self, report: SyncReport, end: ReplicaEnd) -> tuple[str, str]:
        """``(transport, detail)`` in words for the adapter's line after its first sync (``[rl-tpu] weight sync to
        rollout replica R: <transport>, <detail>, ...``); ``detail`` may be empty."""
        return self.describe(), ""

    @abstractmethod
    async def send(self, weights: Iterable[tuple[str, Any]], version: int | None) -> SyncReport:
        """Trainer side: send ``weights`` (full tensors or DTensors, any device) stamped ``version``; returns when
        the rollout serves them (pool transports: when every receiver has them)."""

    @abstractmethod
    def receive(self, *args: Any, **kwargs: Any) -> Any:
        """Rollout side: take what this transport delivered and hand it to the rollout's apply function."""


def full_cpu(weights: Iterable[tuple[str, Any]]):
    """``(name, tensor)`` pairs as whole CPU tensors (a ``DTensor`` gathered: collective over the trainer's ranks)."""
    for name, tensor in weights:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach().to("cpu")


def allow_views(weights: Any) -> None:
    """Tell a weight stream that can hand out views of a reused buffer (the ``gloo`` engine's shared-memory path,
    :class:`verl_backend.weight_sync.pool_stream.ReceivedWeights`) that this consumer copies each tensor before
    asking for the next; any other stream is left as it is."""
    allow = getattr(weights, "allow_views", None)
    if callable(allow):
        allow()
