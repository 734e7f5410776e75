"""The VeRL 0.9.1 names rl-tpu reads, overrides or re-runs without replacing them, in one place (:data:`RECORDS`);
what it replaces is in :mod:`verl_backend.patches.verl`.

- ``verl.trainer.main_ppo.main``'s body (:data:`MAIN_BODY`): ``main`` is ``@hydra.main``, which composes its config
  from ``sys.argv``; ``verl train`` composes the config itself, so it runs the body (:func:`run_main_body`) with it.
  Its ``applied`` check reads ``main``'s source: the body must still be those calls, in that order.
- ``FSDPEngine``'s protected methods that the rl-tpu engines override (:data:`ENGINE_BUILD`,
  :data:`ENGINE_FSDP`, :data:`ENGINE_GRAD_SYNC`): ``_build_module`` (convert the default model on this host first),
  ``_build_fsdp_module`` (one CPU rank: leave the module unwrapped) and ``_gradient_sync_context`` (nothing to
  synchronise unwrapped). Each check asserts VeRL still defines the method with the parameters overridden and still
  calls it where the override expects.
- ``PPOTrainer._save_checkpoint`` (:data:`SAVE_CHECKPOINT`): a SIGTERM'd run saves the step just completed at the
  next step boundary (:mod:`verl_backend.workers.preemption`) with VeRL's own save, which is protected; called only
  through :func:`save_checkpoint`.
- ``FSDPEngine``'s private state (:data:`ENGINE_STATE`): the flags the plain-module and shared-memory checks read
  (``_is_lora``, ``_qat_enabled``, ``_is_offload_param``, ``_is_offload_optimizer``) and the two attributes an
  unwrapped module sets in place of ``_build_fsdp_module`` (``_autocast_dtype``, ``scaler``); read and written only
  through :func:`engine_state` and :func:`set_unwrapped_precision`.
- ``RolloutReplica``'s server fields (:data:`REPLICA_SERVER`): ``launch_servers`` of a replica sets
  ``_server_handle`` and ``_server_address``, which the public ``server_handle`` / ``server_address`` return; set
  only through :func:`set_replica_server`.

VeRL's version is checked with every other record when the plugin loads (:func:`verl_backend.patches.check_versions`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from types import ModuleType

from verl_backend.patches.record import Patch, searched

VERSIONS = "==0.9.1"  # the VeRL release these names were read from and tested with
MAIN_CALLS = ("auto_set_device", "validate_config", "run_ppo")  # main's body, in order (use_v1: the V1 trainer)
_ENGINE = "verl.workers.engine.fsdp.transformer_impl"


def _calls_in_order(source: str, names: tuple[str, ...]) -> bool:
    at = 0
    for name in names:
        found = re.compile(rf"\b{name}\(").search(source, at)
        if found is None:
            return False
        at = found.end()
    return True


def _main_body_unchanged(module: ModuleType) -> bool:
    main = getattr(module.main, "__wrapped__", module.main)  # under @hydra.main
    return _calls_in_order(inspect.getsource(main), MAIN_CALLS)


def _overridable(method: str, parameters: tuple[str, ...], caller: str, call: str):
    """An ``applied`` check: ``FSDPEngine.method`` takes ``parameters`` and ``FSDPEngine.caller`` calls it as
    ``call``."""

    def applied(module: ModuleType) -> bool:
        engine = module.FSDPEngine
        own = next((klass.__dict__[method] for klass in engine.__mro__ if method in klass.__dict__), None)
        if own is None:
            return False
        own = getattr(own, "__wrapped__", own)  # under @contextmanager
        if tuple(inspect.signature(own).parameters) != ("self", *parameters):
            return False
        return call in inspect.getsource(getattr(engine, caller))

    return applied


_STATE_FLAGS = ("_is_lora", "_qat_enabled", "_is_offload_param", "_is_offload_optimizer")


def _state_names_set(module: ModuleType) -> bool:
    engine = module.FSDPEngine
    init, build_fsdp = inspect.getsource(engine.__init__), inspect.getsource(engine._build_fsdp_module)
    return all(f"self.{flag} =" in init for flag in _STATE_FLAGS) and all(
        f"self.{name} =" in build_fsdp for name in ("_autocast_dtype", "scaler")
    )


_NO_ISSUE_ENGINE = searched(
    "verl-project/verl", "verl FSDP engine CPU device EngineRegistry register device cpu FSDPEngineWithLMHead"
)

MAIN_BODY = Patch(
    target="verl.trainer.main_ppo.main (body re-run)",
    module="verl.trainer.main_ppo",
    library="verl",
    versions=VERSIONS,
    why="main is @hydra.main (its config from sys.argv): verl train runs its body with the config it composed",
    upstream=searched(
        "verl-project/verl", "verl main_ppo hydra main call programmatically with config run_ppo without hydra"
    ),
    apply=None,
    applied=_main_body_unchanged,
)

ENGINE_BUILD = Patch(
    target=f"{_ENGINE}.FSDPEngine._build_module (overridden)",
    module=_ENGINE,
    library="verl",
    versions=VERSIONS,
    why="the critic's worker converts the default model on its host before VeRL builds the module from it",
    upstream=_NO_ISSUE_ENGINE,
    apply=None,
    applied=_overridable("_build_module", (), "_build_model_optimizer", "self._build_module()"),
)

ENGINE_FSDP = Patch(
    target=f"{_ENGINE}.FSDPEngine._build_fsdp_module (overridden)",
    module=_ENGINE,
    library="verl",
    versions=VERSIONS,
    why="on one CPU rank the module trains unwrapped: FSDP2 would shard nothing and only add copies",
    upstream=_NO_ISSUE_ENGINE,
    apply=None,
    applied=_overridable(
        "_build_fsdp_module", ("module",), "_build_model_optimizer", "self._build_fsdp_module(module)"
    ),
)

ENGINE_GRAD_SYNC = Patch(
    target=f"{_ENGINE}.FSDPEngine._gradient_sync_context (overridden)",
    module=_ENGINE,
    library="verl",
    versions=VERSIONS,
    why="an unwrapped module has no FSDP gradient sync to defer during gradient accumulation",
    upstream=_NO_ISSUE_ENGINE,
    apply=None,
    applied=_overridable(
        "_gradient_sync_context", ("is_last_micro_batch",), "forward_backward_batch", "self._gradient_sync_context("
    ),
)

ENGINE_STATE = Patch(
    target=f"{_ENGINE}.FSDPEngine._is_lora/_qat_enabled/_is_offload_*/_autocast_dtype/scaler",
    module=_ENGINE,
    library="verl",
    versions=VERSIONS,
    why="the plain-module and shared-weights checks read the engine's LoRA/QAT/offload flags; unwrapped sets its dtype",
    upstream=_NO_ISSUE_ENGINE,
    apply=None,
    applied=_state_names_set,
)


def _saves_without_arguments(module: ModuleType) -> bool:
    save = getattr(module.PPOTrainer, "_save_checkpoint", None)
    return (
        callable(save)
        and tuple(inspect.signature(save).parameters) == ("self",)
        and "global_step_{self.global_steps}" in inspect.getsource(save)
    )


SAVE_CHECKPOINT = Patch(
    target="verl.trainer.ppo.v1.trainer_base.PPOTrainer._save_checkpoint (called)",
    module="verl.trainer.ppo.v1.trainer_base",
    library="verl",
    versions=VERSIONS,
    why="a SIGTERM'd run saves its last completed step with VeRL's own (protected) save, named after global_steps",
    upstream=searched("verl-project/verl", "verl SIGTERM preemption graceful checkpoint at step boundary"),
    apply=None,
    applied=_saves_without_arguments,
)

_REPLICA_FIELDS = ("_server_handle", "_server_address")


def _replica_reads_server_fields(module: ModuleType) -> bool:
    """``RolloutReplica``'s ``server_handle`` / ``server_address`` properties still return the two fields a replica's
    ``launch_servers`` sets."""
    replica = module.RolloutReplica
    return all(
        isinstance(replica.__dict__.get(name.lstrip("_")), property)
        and f"self.{name}" in inspect.getsource(replica.__dict__[name.lstrip("_")].fget)
        for name in _REPLICA_FIELDS
    )


REPLICA_SERVER = Patch(
    target="verl.workers.rollout.replica.RolloutReplica._server_handle/_server_address (set)",
    module="verl.workers.rollout.replica",
    library="verl",
    versions=VERSIONS,
    why="a replica's launch_servers hands VeRL its server through these protected fields, as VeRL's own replicas do",
    upstream=searched(
        "verl-project/verl",
        "verl RolloutReplica custom rollout replica _server_handle _server_address launch_servers subclass",
    ),
    apply=None,
    applied=_replica_reads_server_fields,
)

RECORDS: tuple[Patch, ...] = (
    MAIN_BODY,
    ENGINE_BUILD,
    ENGINE_FSDP,
    ENGINE_GRAD_SYNC,
    ENGINE_STATE,
    SAVE_CHECKPOINT,
    REPLICA_SERVER,
)


def set_replica_server(replica, handle, address: str) -> None:
    """Make ``handle`` (the server actor at ``address``) ``replica``'s ``server_handle`` / ``server_address``."""
    replica._server_handle = handle
    replica._server_address = address


def save_checkpoint(trainer) -> None:
    """VeRL's checkpoint of ``trainer`` at ``trainer.global_steps`` (``PPOTrainer._save_checkpoint``)."""
    trainer._save_checkpoint()


def run_main_body(config, task_runner_class) -> None:
    """VeRL's ``main_ppo.main`` body on ``config``: device check, config validation, ``run_ppo`` with
    ``task_runner_class`` (VeRL's is ``TaskRunnerV1``)."""
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=task_runner_class)


@dataclasses.dataclass(frozen=True)
class EngineState:
    """What an ``FSDPEngine`` was configured with (its private flags)."""

    lora: bool
    qat: bool
    offload_param: bool
    offload_optimizer: bool


def engine_state(engine) -> EngineState:
    """``engine``'s LoRA, QAT and offload flags (``FSDPEngine``'s private attributes; absent ones read False)."""
    return EngineState(*(bool(getattr(engine, flag, False)) for flag in _STATE_FLAGS))


def set_unwrapped_precision(engine, dtype) -> None:
    """What VeRL's ``_build_fsdp_module`` sets for the forward, for a module left unwrapped in ``dtype``: the
    autocast dtype (the weights' own: VeRL's forward then skips autocast) and no gradient scaler."""
    engine._autocast_dtype = dtype
    engine.scaler = None
