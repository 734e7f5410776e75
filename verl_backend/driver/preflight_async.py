"""Pre-flight checks of ``verl train`` for asynchronous RL and a separate rollout slice, before Ray starts.

VeRL 0.9.1's ``trainer.v1.trainer_mode`` (``verl/trainer/ppo/v1/``): ``colocate_async`` runs on this backend,
``separate_async`` is refused one line per requirement not met (:func:`check_trainer_mode`); ``rl_tpu.rollout_slice``
is checked and turned into VeRL's standalone rollout pool keys (:func:`rollout_slice_keys`,
:func:`check_rollout_slice_config`). Each raises :class:`~verl_backend.errors.BadInputError` with
one line naming the key and the fix.
"""

from __future__ import annotations

import os

from verl_backend.errors import BadInputError

TRAINER_MODES = ("sync", "colocate_async", "separate_async")


def check_trainer_mode(config) -> None:
    """Refuse a ``trainer.v1.trainer_mode`` this backend cannot run, one line per unmet requirement, before Ray starts.

    ``sync`` and ``colocate_async`` run (``colocate_async``: one batch sampled ahead, staleness bound
    ``trainer.v1.sampler.max_off_policy_threshold``; VeRL aborts and sleeps the rollout while the actor updates).
    VeRL 0.9.1's ``separate_async``
    (``verl/trainer/ppo/v1/trainer_separate_async.py``) asserts, in this order: ``data.train_batch_size ==
    trainer.v1.separate_async.parameter_sync_step × actor.ppo_mini_batch_size`` (l.56-63); rollout ``nnodes`` and
    ``n_gpus_per_node`` > 0 (l.64-67, a separate rollout pool); a checkpoint engine other than ``naive`` (l.68-70);
    and, with a reward model, its own resource pool (l.71-76). It swaps the actor for VeRL's ``DetachActorWorker``
    (l.114-126), whose ``save_model_to_cpu``/``restore_model_from_cpu`` keep pi_old across the mini-batches of a
    sync cycle unless ``algorithm.rollout_correction.bypass_mode`` (l.187-211). Checked here, in that order: the
    batch identity, the rollout pool, then the engine: ``naive`` (VeRL's assert) and ours ``native`` (VeRL's colocated
    engine plus in-worker sampling, ``verl_backend/rollout/inworker.py``: it cannot send to another pool; VeRL lets it
    through and its ``prepare`` raises ``NotImplementedError`` at the first sync) are refused, pointing at ``gloo``
    (``verl_backend/weight_sync/gloo_engine.py``, rl-tpu's engine between pools). Partial rollout needs no refusal: our
    server's abort is a pause (requests in flight finish on the weights they started with), so nothing is resumed
    mid-sequence.

    Raises:
        BadInputError: one line naming the key and the fix.
    """
    v1 = config.trainer.get("v1") or {}
    mode = str(v1.get("trainer_mode", "sync"))
    if mode not in TRAINER_MODES:
        raise BadInputError(f"trainer.v1.trainer_mode={mode}: give one of {', '.join(TRAINER_MODES)}")
    if mode != "separate_async":
        return
    batch, mini = int(config.data.train_batch_size), config.actor_rollout_ref.actor.ppo_mini_batch_size
    sync_step = int((v1.get("separate_async") or {}).get("parameter_sync_step", 1))
    if mini is None or batch != sync_step * int(mini):
        fit = (
            f"trainer.v1.separate_async.parameter_sync_step={batch // int(mini)}"
            if mini and batch % int(mini) == 0
            else f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // sync_step}"
            if batch % sync_step == 0
            else f"trainer.v1.separate_async.parameter_sync_step=1 actor_rollout_ref.actor.ppo_mini_batch_size={batch}"
        )
        raise BadInputError(
            f"trainer.v1.trainer_mode=separate_async needs data.train_batch_size ({batch}) == "
            f"trainer.v1.separate_async.parameter_sync_step ({sync_step}) × "
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini}) (VeRL 0.9.1 asserts it); set {fit}"
        )
    rollout = config.actor_rollout_ref.rollout
    for key in ("nnodes", "n_gpus_per_node"):
        if int(rollout.get(key) or 0) <= 0:
            raise BadInputError(
                f"actor_rollout_ref.rollout.{key}={rollout.get(key)}: trainer.v1.trainer_mode=separate_async samples "
                f"on a rollout pool of its own; set actor_rollout_ref.rollout.{key} to 1 or more"
            )
    backend = str((rollout.get("checkpoint_engine") or {}).get("backend", "naive"))
    if backend == "naive":
        raise BadInputError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive: VeRL's separate_async needs an engine that "
            "sends to another pool; set actor_rollout_ref.rollout.checkpoint_engine.backend=gloo (rl-tpu's)"
        )
    if not config.actor_rollout_ref.get("hybrid_engine", True):
        raise BadInputError(
            "actor_rollout_ref.hybrid_engine=false: VeRL 0.9.1's separate_async then fails while it sets up "
            "(trainer_separate_async.py:181 passes flush= to logger.info, a TypeError); leave it true"
        )
    if str(rollout.get("name")) == "native" and backend == "native":
        raise BadInputError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=native is colocated (VeRL's naive engine plus "
            "in-worker sampling) and cannot send weights to a separate rollout pool, which "
            "trainer.v1.trainer_mode=separate_async needs; set "
            "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo"
        )


def rollout_slice_keys(value: str, trainer_slice: str = "", backend_slices: str = "none") -> dict[str, str]:
    """The VeRL keys ``rl_tpu.rollout_slice`` (``--rollout-slice``) sets, checked before anything waits.

    In order: the backend places slices (``--backend tpu``, or ``cpu`` as a dry run); the trainer has a slice of its
    own (``rl_tpu.slice``, ``--slice`` or ``$TPU_ACCELERATOR_TYPE``: already resolved into ``trainer_slice``); the name
    is a slice (:func:`rl_tpu.topology.parse_slice`); the Ray cluster has it — the one already joined, else
    ``$RAY_ADDRESS`` joined for the check and left — counted as :func:`ray_cluster.pools.place_pools` counts (two of the
    pod type when the trainer's slice is the same type), by its cluster check. The slice is then VeRL's standalone
    rollout pool of ``trainer.v1.trainer_mode=separate_async``: one VeRL node per host, one rollout worker per chip
    (``actor_rollout_ref.rollout.nnodes``/``n_gpus_per_node``), weights sent by rl-tpu's ``gloo`` checkpoint engine.
    The TaskRunner reserves it whole with ``ray.util.tpu`` (:class:`verl_backend.workers.slice_pool.RolloutSlice`).

    Returns:
        ``{key: value}`` to apply below the user's file and command line (``{}`` when ``value`` is empty); a user's
        value that disagrees is refused after composing (:func:`check_rollout_slice_config`).

    Raises:
        BadInputError: one line naming ``rl_tpu.rollout_slice`` and the fix.
    """
    if not value:
        return {}
    import ray

    from rl_tpu.topology import TopologyError, parse_slice

    key = f"rl_tpu.rollout_slice={value}"
    if backend_slices == "none":
        raise BadInputError(
            f"{key}: a rollout slice applies to --backend tpu (or cpu, as a dry run on a fake slice); drop it"
        )
    try:
        spec = parse_slice(*_slice_parts(value))
    except TopologyError as exc:
        raise BadInputError(f"{key}: {exc}") from None
    if not trainer_slice:
        raise BadInputError(
            f"{key}: the trainer needs a slice of its own too; set rl_tpu.slice (--slice), e.g. "
            f"--slice {spec.accelerator_type}"
        )
    same = parse_slice(*_slice_parts(trainer_slice)).pod_type == spec.pod_type
    joined = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            raise BadInputError(
                f"{key}: a rollout slice needs a Ray cluster that has it; set $RAY_ADDRESS (locally: "
                f"rl-tpu cluster up --fake-slice {spec.accelerator_type})"
            )
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        joined = True
    try:
        from ray_cluster.errors import ClusterError
        from ray_cluster.placement import check_cluster_has

        check_cluster_has(spec, 2 if same else 1)
    except ClusterError as exc:
        raise BadInputError(f"{key}: {exc}") from None
    finally:
        if joined:
            ray.shutdown()
    return {
        "trainer.v1.trainer_mode": "separate_async",
        "actor_rollout_ref.rollout.nnodes": str(spec.hosts),
        "actor_rollout_ref.rollout.n_gpus_per_node": str(spec.chips_per_host),
        "actor_rollout_ref.rollout.checkpoint_engine.backend": "gloo",
    }


SHAPE_KEYS = (
    "trainer.v1.trainer_mode",
    "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node",
)


def check_rollout_slice_config(config, value: str, keys: dict[str, str], user_keys: set[str]) -> None:
    """After composing: the keys the rollout slice sets (:func:`rollout_slice_keys`) hold in ``config``, and
    ``trainer.v1.separate_async.parameter_sync_step``, when the user did not give it, fits VeRL's batch identity
    (``data.train_batch_size / actor.ppo_mini_batch_size``; VeRL's default 4 would otherwise be refused by
    :func:`check_trainer_mode` for the embedded job). Changes ``config`` in place (open for writing).

    Raises:
        BadInputError: a trainer mode or rollout pool shape given in the file or on the command line that is not the
            slice's, one line naming both keys.
    """
    if not keys:
        return
    from omegaconf import OmegaConf, open_dict

    for name in SHAPE_KEYS:
        given = OmegaConf.select(config, name)
        if str(given) != keys[name]:
            raise BadInputError(
                f"rl_tpu.rollout_slice={value} sets {name}={keys[name]}, but the job gives {given}; "
                f"drop {name} (the rollout slice decides it)"
            )
    sync_key = "trainer.v1.separate_async.parameter_sync_step"
    mini = config.actor_rollout_ref.actor.get("ppo_mini_batch_size")
    batch = int(config.data.train_batch_size)
    if sync_key not in user_keys and mini and batch % int(mini) == 0:
        with open_dict(config):
            OmegaConf.update(config, sync_key, batch // int(mini), force_add=True)


def _slice_parts(text: str) -> tuple[str, str | None]:
    accelerator, _, topology = text.partition(":")
    return accelerator, topology or None
