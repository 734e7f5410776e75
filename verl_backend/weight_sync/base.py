"""The weight sync's shared vocabulary: the transport names and their route numbers, the sender's report, the
:class:`Transport` interface every transport implements, and the trainer's explicit hand-over of its weights.

Import-light (no VeRL, no Ray): the engine (:mod:`verl_backend.workers.engine`) and the ``verl train`` driver import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

#: every transport, in the order of their route numbers (``weight_sync/route`` in the step metrics is the index)
TRANSPORTS = ("in_worker", "trainer_memory", "shared_memory", "object_store", "pool_broadcast",
              "pool_shared_memory")

_HANDED_OVER: dict[str, object] = {}  # role -> SharedWeights the trainer's engine handed over in this process


def route_number(transport: str) -> int:
    """The number of ``transport`` in :data:`TRANSPORTS` (what ``weight_sync/route`` logs).

    Raises:
        ValueError: a name not in :data:`TRANSPORTS`.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"weight sync transport {transport!r}: expected one of {TRANSPORTS}")
    return TRANSPORTS.index(transport)


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
        return {"version": self.version, "transport": self.transport, "bytes": float(self.bytes),
                "copied_bytes": float(self.copied_bytes), "seconds": float(self.seconds),
                "buckets": float(self.buckets), "verified": float(self.verified)}

    def as_metrics(self) -> dict[str, float]:
        """The step metrics every transport reports under the same names: ``weight_sync/route`` (the transport's
        number, :func:`route_number`), ``weight_sync/bytes``, ``weight_sync/seconds``, ``weight_sync/verified``
        (1.0 verified, 0.0 not)."""
        return {"weight_sync/route": float(route_number(self.transport)), "weight_sync/bytes": float(self.bytes),
                "weight_sync/seconds": float(self.seconds), "weight_sync/verified": float(self.verified)}


class Transport(ABC):
    """One way weights go from the trainer to a rollout replica. Every transport of the package implements it.

    - trainer side: :meth:`send` the ``(name, tensor)`` stream of one version; returns the :class:`SyncReport`;
    - rollout side: :meth:`receive` hands what arrived to the rollout's one apply function
      (:func:`verl_backend.weight_sync.apply.load`, through the rollout server's ``apply`` or the in-worker
      sampler), then the new weights go live (:func:`verl_backend.weight_sync.apply.live`);
    - :meth:`describe`: the transport in words, for logs and ``--print-config``.
    """

    name: ClassVar[str]

    def describe(self) -> str:
        """The transport in a few words."""
        return self.name.replace("_", " ")

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
