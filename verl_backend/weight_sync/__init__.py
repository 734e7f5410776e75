"""Weight sync, trainer → rollout: one package, one :class:`~verl_backend.weight_sync.base.Transport` interface, six
transports, one route choice.

A sync sends the actor's weights from one trainer rank (``src_rank``, the leader of a rollout replica's ranks) to
one rollout replica (``dst_replica``) and stamps them with a ``version`` (the trainer step that produced them; the
rollout reports the version its samples came from). :func:`~verl_backend.weight_sync.route.choose_route` is the one
place that picks how, among all six, from facts about the job's config and placement, and says why:
``verl train --print-config`` prints the plan for each replica
(:func:`~verl_backend.weight_sync.route.plan_routes`), and the run logs ``[rl-tpu] weight sync route: planned X,
took Y, because ...``. The transports, cheapest first, each a class behind the :class:`Transport` interface found by
name in one registry (:data:`~verl_backend.weight_sync.base.REGISTRY`, which gives each its stable number,
``weight_sync/route`` in ``metrics.jsonl``):

==  ======================  ===========================================================================================
 0  ``in_worker``           the sampler runs inside the worker that owns the device (``sampler_placement=worker``,
                            the TPU profile): the weights load on its device; nothing crosses a process.
                            (:mod:`.in_worker`)
 1  ``trainer_memory``      the actor's parameters live in a shared-memory file (:func:`hand_over` by the engine) and
                            the rollout server on the same host computes on that file: the optimizer step is the
                            sync, no bytes are copied (the sync only checks every tensor is in place). The default
                            CPU job. (:mod:`.trainer_memory`)
 2  ``shared_memory``       the server keeps its own weights in a shared-memory file on this host: each tensor is
                            written into it once (FSDP over several ranks). (:mod:`.shared_memory`)
 3  ``object_store``        anything else (another host, ``rl_tpu.shared_weights=false``, a file that cannot be
                            mapped): buckets of ``bucket_bytes`` through Ray's object store, streamed (a bounded
                            number in flight). (:mod:`.object_store`)
 4  ``pool_broadcast``      the rollout replicas run in a pool of their own (``trainer.v1.trainer_mode=separate_async``
                            with ``checkpoint_engine.backend=gloo``, a rollout slice): VeRL's checkpoint engine
                            ``gloo`` (:mod:`.gloo_engine`) broadcasts buckets from trainer rank 0 to every rollout
                            worker over a gloo group of their own. (:mod:`.pool_broadcast`)
 5  ``pool_shared_memory``  the same engine when every rollout worker is on trainer rank 0's host (confirmed by a
                            collective at each sync): the buckets go through a shared-memory file, only their headers
                            over gloo. (:mod:`.pool_shared_memory`)
==  ======================  ===========================================================================================

Step metrics, the same names on every transport (:meth:`SyncReport.as_metrics`): ``weight_sync/route`` (the number
above), ``weight_sync/bytes``, ``weight_sync/seconds``, ``weight_sync/verified`` (1.0 once a verification proved
the rollout computes with the weights sent; 0.0 until then).

Modules (no import circle; arrows one way: ``base`` ← ``route``, ``lora`` ← ``apply`` ← transports ← ``gloo_engine``,
``verify`` ← ``gloo_engine``):

- :mod:`.base` the transport registry (names, route numbers, classes), :class:`SyncReport`, the :class:`Transport`
  interface, the hand-over;
- :mod:`.route` :class:`SyncFacts`, :class:`SyncRoute`, :func:`choose_route`, the ``--print-config`` plan;
- :mod:`.apply` the rollout side's two seams: :func:`~.apply.load` (a received stream enters a sampler; its
  :func:`~.apply.received` hook is where an adapter-only LoRA payload becomes merged tensors) and
  :func:`~.apply.live` (right after the new weights are live: where a verification runs);
- one module per transport (above); :mod:`.pool_stream` the pool receivers' stream; :mod:`.gloo_engine` VeRL's
  checkpoint engine ``gloo`` over the two pool transports;
- :mod:`.verify` the check of each sync (the trainer's proof, the rollout's check); :mod:`.lora` LoRA's weights for a
  sync (merged, or the adapter only and merged by the rollout) and its checkpoint.

The trainer hands its weights over explicitly: the engine calls :func:`hand_over` with its
:class:`rl_tpu.shared_weights.SharedWeights`, and the adapter reads :func:`handed_over` in the same process (VeRL
runs the actor engine and the rollout adapter in one worker).

This ``__init__`` imports only the light modules (no VeRL, no Ray): the engine and the driver import it.
"""

from verl_backend.weight_sync.base import (
    REGISTRY,
    TRANSPORTS,
    ReplicaEnd,
    SyncReport,
    Transport,
    hand_over,
    handed_over,
    route_number,
    transport_class,
)
from verl_backend.weight_sync.route import SyncFacts, SyncRoute, choose_route, plan_routes, took_line

__all__ = [
    "REGISTRY",
    "TRANSPORTS",
    "ReplicaEnd",
    "SyncFacts",
    "SyncReport",
    "SyncRoute",
    "Transport",
    "choose_route",
    "hand_over",
    "handed_over",
    "plan_routes",
    "route_number",
    "took_line",
    "transport_class",
]
