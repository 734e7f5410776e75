"""One exception type for input a user can fix; the CLI prints its message as one line and exits 2.

A :class:`BadInputError` raised inside a Ray worker does not always reach the driver: VeRL 0.9.1's agent loop
(``verl/trainer/ppo/v1/agent_loop_tq.py``, ``_run_prompt``) logs a failed rollout or reward, marks its prompt group
``failure`` and goes on, and the driver only sees the replay buffer's ``RuntimeError`` about groups with no
trajectories. So a worker that raises one also records it (:func:`record_bad_input`) in Ray's cluster key-value
store under the job's id, and ``verl train`` reports the first recorded one when the job fails
(:func:`recorded_bad_input`).
"""

from __future__ import annotations

from rl_tpu.errors import BadInputError  # noqa: F401  (defined in rl_tpu, below every layer: rl_tpu.patches uses it)

_KV_NAMESPACE = "rl_tpu"


def _kv_key() -> bytes | None:
    import ray

    if not ray.is_initialized():
        return None
    return f"bad_input/{ray.get_runtime_context().get_job_id()}".encode()


def record_bad_input(exc: BaseException) -> None:
    """Keep ``str(exc)`` for the driver if it is the first bad input of this Ray job (best effort: never raises).

    Stored in the GCS key-value store (Ray's private ``internal_kv``, :mod:`rl_tpu.patches.ray_internals`), so
    it reaches a driver on another host.
    """
    try:
        from rl_tpu.patches import ray_internals as kv

        key = _kv_key()
        if key is not None and kv.kv_ready():
            kv.kv_put(key, str(exc).encode(), namespace=_KV_NAMESPACE)
    except Exception:  # a report about an error must not raise one of its own
        pass


def recorded_bad_input() -> str | None:
    """The first bad input a worker of this Ray job recorded, or ``None`` (also when Ray is not running). It is
    deleted once read, so a restarted attempt starts clean."""
    try:
        from rl_tpu.patches import ray_internals as kv

        key = _kv_key()
        if key is None or not kv.kv_ready():
            return None
        value = kv.kv_get(key, namespace=_KV_NAMESPACE)
        if value is not None:
            kv.kv_del(key, namespace=_KV_NAMESPACE)
        return value.decode() if value is not None else None
    except Exception:
        return None


def in_cause_chain(
    exc: BaseException | None,
    kinds: type[BaseException] | tuple[type[BaseException], ...],
    exclude: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> BaseException | None:
    """The outermost exception in ``exc``'s cause chain that is one of ``kinds`` and none of ``exclude``, or ``None``.

    The chain is Ray's ``RayTaskError`` chain (driver -> TaskRunner -> worker: its ``cause``) where there is one, else
    ``__cause__`` (``raise ... from exc``); a cycle ends the walk. The one walk behind ``verl``'s one-line user errors
    (:mod:`verl_backend.driver.cli`) and the restart after a dead Ray actor (:mod:`verl_backend.driver.runner`).
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, kinds) and not isinstance(exc, exclude):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None
