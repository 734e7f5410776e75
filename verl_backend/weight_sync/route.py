"""The one route choice: which transport carries the trainer's weights to each rollout replica, and why.

:func:`choose_route` decides among all six transports (:data:`~verl_backend.weight_sync.base.REGISTRY`) from
:class:`SyncFacts`. Two callers gather the facts:

- ``verl train --print-config`` (:func:`plan_routes`), before Ray: from the job's config and the backend profile
  (placement, ``rl_tpu.shared_weights``, the checkpoint engine and trainer mode, LoRA, FSDP ranks, the rollout
  slice). What only the run can know (a file that cannot be mapped, a server on another host) is assumed to go well;
- the run (:mod:`verl_backend.rollout.adapter`, :mod:`verl_backend.weight_sync.gloo_engine`): from what this
  process and the rollout could map. It logs ``planned X, took Y, because ...`` (:func:`took_line`).

Import-light: no VeRL, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_backend.weight_sync.base import TRANSPORTS, registered

PLACEMENTS = ("server", "worker")


@dataclass(frozen=True)
class SyncFacts:
    """What the route depends on, gathered by the caller.

    Attributes:
        placement: where the sampler runs: ``"worker"`` (inside the worker process that owns the device) or
            ``"server"`` (the rollout server process).
        shared_weights: the ``rl_tpu.shared_weights`` setting.
        trainer_memory: why the trainer's parameters cannot be computed on in place (``None``: they can — handed
            over, and the server on this host mapped them).
        server_memory: why the server's own shared-memory weights cannot be written (``None``: they can).
        src_rank: the trainer rank that sends (global rank).
        dst_replica: the rollout replica that receives.
        bucket_bytes: bucket size in bytes (VeRL's ``checkpoint_engine.update_weights_bucket_megabytes``).
        pool: the rollout runs in a pool of its own (``trainer.v1.trainer_mode=separate_async``, a rollout slice:
            VeRL's standalone replicas, fed by the ``gloo`` checkpoint engine).
        pool_memory: in a pool, why the receivers cannot map the source's shared-memory file (``None``: they can,
            all on trainer rank 0's host; the run confirms it by a collective at each sync).
    """

    placement: str
    shared_weights: bool
    trainer_memory: str | None
    server_memory: str | None
    src_rank: int = 0
    dst_replica: int = 0
    bucket_bytes: int = 512 << 20
    pool: bool = False
    pool_memory: str | None = None


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
        how = registered(self.transport).how
        if self.bucket_bytes:
            how += f", {self.bucket_bytes >> 20} MiB buckets"
        return f"trainer rank {self.src_rank} -> rollout replica {self.dst_replica}: {how} ({self.reason})"


def choose_route(facts: SyncFacts) -> SyncRoute:
    """The cheapest transport the facts allow (see the package docstring), with the reason in words.

    Raises:
        ValueError: a ``placement`` other than ``"worker"`` or ``"server"``.
    """
    if facts.placement not in PLACEMENTS:
        raise ValueError(f"sampler placement {facts.placement!r}: expected 'worker' or 'server'")

    def route(transport: str, reason: str) -> SyncRoute:
        return SyncRoute(
            transport,
            reason,
            facts.src_rank,
            facts.dst_replica,
            facts.bucket_bytes if registered(transport).bucketed else 0,
        )

    if facts.pool:
        if not facts.shared_weights:
            return route(
                "pool_broadcast",
                "the rollout runs in a pool of its own (checkpoint engine gloo); rl_tpu.shared_weights=false",
            )
        if facts.pool_memory is not None:
            return route(
                "pool_broadcast", f"the rollout runs in a pool of its own (checkpoint engine gloo); {facts.pool_memory}"
            )
        return route(
            "pool_shared_memory",
            "the rollout runs in a pool of its own (checkpoint engine gloo) on trainer "
            "rank 0's host: buckets through a shared-memory file, headers over gloo",
        )
    if facts.placement == "worker":
        return route("in_worker", "the sampler runs inside the trainer worker: the weights load on its device")
    if not facts.shared_weights:
        return route("object_store", "rl_tpu.shared_weights=false")
    if facts.trainer_memory is None:
        return route(
            "trainer_memory",
            "the trainer's parameters live in shared memory on the rollout's host: the "
            "rollout computes on them, the optimizer step is the sync",
        )
    if facts.server_memory is None:
        return route(
            "shared_memory",
            f"the rollout computes on its own copy ({facts.trainer_memory}); it lives in "
            "shared memory on this host and is written in place",
        )
    return route("object_store", f"no shared memory with the rollout: {facts.trainer_memory}; {facts.server_memory}")


def took_line(planned: str | None, took: SyncRoute) -> str:
    """The run's log line: ``planned X, took Y, because ...`` (the same when they agree; ``planned`` ``None``: no
    plan was made)."""
    plan = planned or "none"
    return (
        f"[rl-tpu] weight sync route: planned {plan}, took {took.transport}, because {took.reason} ({took.describe()})"
    )


# --- the plan before Ray (verl train --print-config) --------------------------------------------------------------
def _get(node, path: str, default=None):
    for key in path.split("."):
        if node is None:
            return default
        node = node.get(key, None) if hasattr(node, "get") else getattr(node, key, None)
    return default if node is None else node


def known_blockers(cpu: bool, trainer_ranks: int, lora_rank: int) -> tuple[str | None, str | None]:
    """``(trainer_memory, server_memory)`` of :class:`SyncFacts` as far as they are known before Ray: why the
    rollout cannot compute on the trainer's parameters in place, why the server keeps no shared-memory weights
    (``None``: nothing known against it)."""
    trainer = None
    if not cpu:
        trainer = "the trainer's parameters are on an accelerator"
    elif trainer_ranks > 1:
        trainer = "FSDP shards the parameters over several ranks: the rollout needs whole tensors"
    elif lora_rank > 0:
        trainer = (
            f"LoRA (lora_rank={lora_rank}): the engine sends the adapter only, the rollout merges it into "
            "its own weights"
        )
    server = None if cpu else "the rollout server samples on an accelerator"
    if lora_rank > 0 and server is None:
        server = "an adapter is a few MB: the rollout server receives it whole and merges it itself"
    return trainer, server


def config_facts(
    config, cpu: bool, shared_weights: bool, rollout_slice: str | None = None, *, placement: str
) -> tuple[list, str]:
    """The facts of each rollout replica knowable from the composed config (``(facts per replica, note)``).

    Args:
        config: VeRL's composed job config.
        cpu: the trainer's parameters live in host memory (the CPU backend); on an accelerator they do not.
        shared_weights: the ``rl_tpu.shared_weights`` setting.
        rollout_slice: ``rl_tpu.rollout_slice`` (the rollout pool on a slice of its own: other hosts).
        placement: where the sampler runs, ``"server"`` or ``"worker"`` (the rollout's
            ``engine_kwargs.native.sampler_placement``, read by the caller with
            :func:`verl_backend.rollout.native_kwargs.native_engine_kwargs`: the weight sync does not read the
            rollout's keys).
    """
    rollout = _get(config, "actor_rollout_ref.rollout")
    mode = str(_get(config, "trainer.v1.trainer_mode", "sync"))
    backend = str(_get(rollout, "checkpoint_engine.backend", "naive"))
    pool = mode == "separate_async" and backend == "gloo"  # VeRL's standalone replicas, fed by our gloo engine
    bucket = int(_get(rollout, "checkpoint_engine.update_weights_bucket_megabytes", 512)) << 20
    tp = max(
        1,
        int(_get(rollout, "tensor_model_parallel_size", 1))
        * int(_get(rollout, "data_parallel_size", 1))
        * int(_get(rollout, "pipeline_model_parallel_size", 1)),
    )
    if pool:
        world = int(_get(rollout, "nnodes", 1)) * int(_get(rollout, "n_gpus_per_node", 1))
    else:
        world = int(_get(config, "trainer.nnodes", 1)) * int(_get(config, "trainer.n_gpus_per_node", 1))
    replicas = max(1, world // tp)
    lora = int(_get(config, "actor_rollout_ref.model.lora_rank", 0) or 0)
    trainer, server = known_blockers(cpu, 1 if pool else world, lora)
    pool_memory = (
        f"the rollout pool is on other hosts (rl_tpu.rollout_slice={rollout_slice})"
        if rollout_slice
        else None
        if cpu
        else "the rollout pool is on TPU slices of its own"
    )
    facts = [
        SyncFacts(
            placement=placement,
            shared_weights=shared_weights,
            trainer_memory=trainer,
            server_memory=server,
            src_rank=0 if pool else r * tp,
            dst_replica=r,
            bucket_bytes=bucket,
            pool=pool,
            pool_memory=pool_memory,
        )
        for r in range(replicas)
    ]
    return facts, (
        "a run that cannot map a file it planned to, or finds the server on another host, takes the next "
        "route and logs 'planned X, took Y, because ...'"
    )


def plan_routes(config, cpu: bool, shared_weights: bool, rollout_slice: str | None = None, *, placement: str) -> str:
    """``--print-config``: the route each rollout replica is planned to take and why, as ``# `` comment lines (the
    output still loads as YAML). Arguments as :func:`config_facts`."""
    facts, note = config_facts(config, cpu, shared_weights, rollout_slice, placement=placement)
    lines = ["weight sync (planned; the run's log says 'planned X, took Y'):"]
    lines += [f"  {choose_route(f).describe()}" for f in facts]
    lines.append(f"  {note}")
    lines.append(
        "  route numbers (weight_sync/route in metrics.jsonl): "
        + ", ".join(f"{registered(t).route} {t}" for t in TRANSPORTS)
    )
    return "\n".join(f"# {line}" for line in lines)
