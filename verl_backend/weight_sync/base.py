"""Weight sync, trainer → rollout: one interface for every transport.

A sync sends the actor's weights from one trainer rank (``src_rank``, the leader of a rollout replica's ranks) to
one rollout replica (``dst_replica``) and stamps them with a ``version`` (the trainer step that produced them; the
rollout reports the version its samples came from). :func:`choose_route` is the one place that picks how, from
facts the caller gathers, and says why; the rollout adapter (``verl_backend.rollout.adapter``) carries it out and
logs the route and its reason once per replica. The transports, cheapest first:

======================  ===========================================================================================
``in_worker``           the sampler runs inside the trainer worker (``rollout.sampler_placement=worker``, the TPU
                        profile): the weights load on its device; nothing crosses a process.
``trainer_memory``      the actor's parameters live in a shared-memory file (:func:`hand_over` by the engine) and the
                        rollout server on the same host computes on that file: the optimizer step is the sync, no
                        bytes are copied (the sync only checks every tensor is in place).
``shared_memory``       the server keeps its own weights in a shared-memory file on this host: each tensor is written
                        into it once.
``object_store``        anything else (another host, ``rl_tpu.shared_weights=false``, a file that cannot be mapped):
                        buckets of ``bucket_bytes`` through Ray's object store, streamed (a bounded number in flight).
``pool_broadcast``      the rollout replicas run in a pool of their own (a rollout slice, ``separate_async``): VeRL's
                        checkpoint engine ``gloo`` (:mod:`verl_backend.rollout.pool_sync`) broadcasts buckets from
                        trainer rank 0 to every rollout worker over a gloo group of their own.
``pool_shared_memory``  the same engine when every rollout worker is on trainer rank 0's host: the buckets go
                        through a shared-memory file, only their headers over gloo.
======================  ===========================================================================================

The trainer hands its weights over explicitly: the engine calls :func:`hand_over` with its
:class:`rl_tpu.shared_weights.SharedWeights`, and the adapter reads :func:`handed_over` in the same process (VeRL
runs the actor engine and the rollout adapter in one worker).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TRANSPORTS = ("in_worker", "trainer_memory", "shared_memory", "object_store", "pool_broadcast",
              "pool_shared_memory")

_HANDED_OVER: dict[str, object] = {}  # role -> SharedWeights the trainer's engine handed over in this process


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


@dataclass(frozen=True)
class SyncFacts:
    """What the route depends on, gathered by the caller.

    Attributes:
        placement: where the sampler runs: ``"worker"`` (inside the trainer worker) or ``"server"``.
        shared_weights: the ``rl_tpu.shared_weights`` setting.
        trainer_memory: why the trainer's parameters cannot be computed on in place (``None``: they can — handed
            over, and the server on this host mapped them).
        server_memory: why the server's own shared-memory weights cannot be written (``None``: they can).
        src_rank: the trainer rank that sends (global rank).
        dst_replica: the rollout replica that receives.
        bucket_bytes: object-store bucket size in bytes (VeRL's ``checkpoint_engine.update_weights_bucket_megabytes``).
    """

    placement: str
    shared_weights: bool
    trainer_memory: str | None
    server_memory: str | None
    src_rank: int = 0
    dst_replica: int = 0
    bucket_bytes: int = 512 << 20


@dataclass(frozen=True)
class SyncRoute:
    """How one trainer rank's weights reach one rollout replica, and why this way."""

    transport: str
    reason: str
    src_rank: int
    dst_replica: int
    bucket_bytes: int

    def describe(self) -> str:
        """``trainer rank 0 -> rollout replica 0: shared memory, in place (why)``."""
        how = {"in_worker": "in the trainer worker", "trainer_memory": "shared memory, in place",
               "shared_memory": "shared memory, copied once", "object_store":
                   f"Ray object store, {self.bucket_bytes >> 20} MiB buckets"}[self.transport]
        return f"trainer rank {self.src_rank} -> rollout replica {self.dst_replica}: {how} ({self.reason})"


def choose_route(facts: SyncFacts) -> SyncRoute:
    """The cheapest transport the facts allow (see the module docstring), with the reason in words.

    Raises:
        ValueError: a ``placement`` other than ``"worker"`` or ``"server"``.
    """
    if facts.placement not in ("worker", "server"):
        raise ValueError(f"sampler placement {facts.placement!r}: expected 'worker' or 'server'")

    def route(transport: str, reason: str) -> SyncRoute:
        return SyncRoute(transport, reason, facts.src_rank, facts.dst_replica,
                         facts.bucket_bytes if transport == "object_store" else 0)

    if facts.placement == "worker":
        return route("in_worker", "the sampler runs inside the trainer worker: the weights load on its device")
    if not facts.shared_weights:
        return route("object_store", "rl_tpu.shared_weights=false")
    if facts.trainer_memory is None:
        return route("trainer_memory", "the trainer's parameters live in shared memory on the rollout's host: the "
                                       "rollout computes on them, the optimizer step is the sync")
    if facts.server_memory is None:
        return route("shared_memory", f"the rollout computes on its own copy ({facts.trainer_memory}); it lives in "
                                      "shared memory on this host and is written in place")
    return route("object_store", f"no shared memory with the rollout: {facts.trainer_memory}; {facts.server_memory}")


@dataclass
class SyncReport:
    """One sync, as measured by the sender.

    Attributes:
        version: the trainer step whose weights the rollout serves after the sync (``None``: not given).
        transport: one of :data:`TRANSPORTS`.
        bytes: bytes of weights the sync covered (sent, written, or checked in place).
        copied_bytes: bytes actually copied (0 for ``trainer_memory`` when every tensor is in place).
        seconds: wall time of the sync, from the first tensor to the rollout serving the new weights.
        buckets: object-store buckets sent (0 for the other transports).
    """

    version: int | None
    transport: str
    bytes: float
    copied_bytes: float
    seconds: float
    buckets: int = 0

    def as_metrics(self) -> dict[str, float]:
        """The report as ``last_sync`` numbers (the transport as a name)."""
        out = asdict(self)
        out["buckets"] = float(self.buckets)
        return out
