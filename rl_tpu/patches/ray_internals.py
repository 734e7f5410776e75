"""The Ray names rl-tpu reads outside Ray's public API, in one place, for the Ray versions they were checked with
(:data:`RECORDS`); nothing of Ray is replaced.

- ``ray._private.state.actors()`` (:data:`ACTOR_TABLE`): the actor table in the GCS, dead actors and their death
  cause included. ``verl train`` reads it to tell a dead actor from a bug after VeRL's agent loop turned an actor's
  death into a generic error (:func:`verl_backend.driver.runner.run_with_restarts`). The public state API
  (``ray.util.state.list_actors``) needs the dashboard, which the job starts without; Ray's own runtime context keeps
  the private call for the same reason (the upstream pull request that moved the other callers says so).
- ``ray.experimental.internal_kv._internal_kv_*`` (:data:`INTERNAL_KV`): the GCS key-value store, where a worker leaves
  the first bad input of the job for the driver on another host (:mod:`verl_backend.errors`). Ray exposes no public
  key-value store.
- ``ActorClass.__ray_metadata__.modified_class.__ray_actor_class__`` (:data:`ACTOR_CLASS`): the class under
  ``@ray.remote``, so ``verl train`` runs VeRL's ``TaskRunnerV1`` in its own process
  (:func:`verl_backend.driver.runner.task_runner_class`). A decorated class does not give its class back publicly.

Each accessor checks Ray's version first (:meth:`~rl_tpu.patches.record.Patch.check`); the plugin checks these
records with the others when a VeRL process starts (:func:`verl_backend.patches.check_versions`, whose
:data:`~verl_backend.patches.RECORDS` include them).

The module sits in ``rl_tpu/patches/``, at the bottom of the import order, although only ``verl_backend`` calls it:
:mod:`verl_backend.errors` (the shared layer, below ``verl_backend/patches/``) reads the key-value store through it,
and an import may not go up a layer (``tests/test_layers.py``). It imports nothing of the project but the record type.
"""

from __future__ import annotations

from types import ModuleType

from rl_tpu.patches.record import Patch, names_check

VERSIONS = ">=2.60,<2.61"  # the Ray versions these names were checked with (pyproject pins ray==2.60.0)
_KV = ("_internal_kv_initialized", "_internal_kv_get", "_internal_kv_put", "_internal_kv_del")


def _unwraps(module: ModuleType) -> bool:
    """``applied`` of :data:`ACTOR_CLASS`: a class decorated with ``ray.remote`` (no running Ray needed) gives itself
    back."""
    import ray

    class Probe:
        pass

    return isinstance(ray.remote(Probe), module.ActorClass) and undecorated_class(ray.remote(Probe)) is Probe


ACTOR_TABLE = Patch(
    target="ray._private.state.actors",
    module="ray._private.state",
    library="ray",
    versions=VERSIONS,
    why="verl train tells a dead actor from a bug by the GCS actor table; the public state API needs the dashboard",
    upstream="https://github.com/ray-project/ray/pull/56733 (keeps the private call where no dashboard runs)",
    apply=None,
    applied=names_check("actors"),
)

INTERNAL_KV = Patch(
    target="ray.experimental.internal_kv._internal_kv_{initialized,get,put,del}",
    module="ray.experimental.internal_kv",
    library="ray",
    versions=VERSIONS,
    why="a worker's bad input reaches the driver on another host through the GCS key-value store; none is public",
    upstream="https://github.com/ray-project/ray/issues/18688 (make internal_kv public; closed as stale)",
    apply=None,
    applied=names_check(*_KV),
)

ACTOR_CLASS = Patch(
    target="ray.actor.ActorClass.__ray_metadata__.modified_class.__ray_actor_class__",
    module="ray.actor",
    library="ray",
    versions=VERSIONS,
    why="verl train runs VeRL's @ray.remote TaskRunnerV1 in its own process; Ray gives the class back privately only",
    upstream="https://github.com/ray-project/ray/issues/42474 (a decorated actor class loses its class)",
    apply=None,
    applied=_unwraps,
)

RECORDS: tuple[Patch, ...] = (ACTOR_TABLE, INTERNAL_KV, ACTOR_CLASS)


def actor_table() -> dict:
    """``{actor id: info}`` of every actor of the cluster, dead ones included (``ray._private.state.actors()``)."""
    ACTOR_TABLE.check()
    import ray._private.state

    return ray._private.state.actors()


def _kv():
    INTERNAL_KV.check()
    from ray.experimental import internal_kv

    return internal_kv


def kv_ready() -> bool:
    """Whether this process is connected to the GCS key-value store."""
    return bool(_kv()._internal_kv_initialized())


def kv_put(key: bytes, value: bytes, namespace: str, overwrite: bool = False) -> None:
    """Store ``value`` under ``key`` in ``namespace`` (kept if present, unless ``overwrite``)."""
    _kv()._internal_kv_put(key, value, overwrite=overwrite, namespace=namespace)


def kv_get(key: bytes, namespace: str) -> bytes | None:
    """The value under ``key`` in ``namespace``, or ``None``."""
    return _kv()._internal_kv_get(key, namespace=namespace)


def kv_del(key: bytes, namespace: str) -> None:
    """Delete ``key`` from ``namespace``."""
    _kv()._internal_kv_del(key, namespace=namespace)


def undecorated_class(actor_class) -> type | None:
    """The class under ``@ray.remote`` of ``actor_class``, or ``None`` where this Ray keeps it elsewhere."""
    ACTOR_CLASS.check()
    metadata = getattr(actor_class, "__ray_metadata__", None)
    return getattr(getattr(metadata, "modified_class", None), "__ray_actor_class__", None)
