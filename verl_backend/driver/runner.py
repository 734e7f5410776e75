"""Running VeRL's trainer from ``verl train``: its TaskRunner in this process, restarts after a dead Ray actor,
and the line a run ends on when an actor died with no restart left."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rl_tpu.patches.ray_internals import undecorated_class
from verl_backend.driver.run_folder import last_checkpoint_step
from verl_backend.errors import BadInputError, in_cause_chain, recorded_bad_input
from verl_backend.patches.transfer_queue import apply_num_threads


def _actor_failure(exc: BaseException) -> BaseException | None:
    """The Ray actor/worker failure somewhere in ``exc``'s cause chain (an actor that died or is unavailable, a
    crashed worker, out of memory, a lost node or object), or ``None``."""
    from ray import exceptions as rx

    failures = (rx.RayActorError, rx.WorkerCrashedError, rx.OutOfMemoryError, rx.NodeDiedError, rx.ObjectLostError)
    return in_cause_chain(exc, failures)


# Not RAY_KILL: VeRL itself ray.kill()s its TransferQueue actors when a run ends, failed or not.
UNEXPECTED_DEATHS = ("WORKER_DIED", "OUT_OF_MEMORY", "NODE_DIED", "SYSTEM_ERROR")


def _dead_actor_in_cluster() -> str | None:
    """Class name of an actor of this job that died unexpectedly (killed, crashed, OOM, node lost), or ``None``.

    VeRL's agent loop catches a dead rollout server's ``ActorDiedError`` and raises a generic ``RuntimeError``
    ("no materializable trajectories"), so the exception alone cannot tell a dead actor from a bug; Ray's actor
    table (GCS) can.
    """
    from rl_tpu.patches.ray_internals import actor_table

    try:
        table = actor_table()
    except Exception:
        return None
    for info in table.values():
        if info.get("State") == "DEAD" and any(k in str(info.get("DeathCause", "")) for k in UNEXPECTED_DEATHS):
            return info.get("ActorClassName") or "actor"
    return None


class ActorFailedError(RuntimeError):
    """A Ray actor of the run died (killed, crashed, OOM, node lost) with no restart left; the message names it and
    the checkpoint to resume from. ``verl`` prints the cause's traceback, then this line, and exits 1."""


def fork_server_here(profile, fork_server: dict, settings) -> None:
    """Fork :mod:`verl_backend.host_memory.fork_server`'s server from this process for a local CPU job (its pid and
    socket go into ``fork_server``); nothing where it does not apply: a backend without host-memory machinery (its
    profile), a Ray cluster (``RAY_ADDRESS``), not Linux, ``rl_tpu.fork_server=false``, or Ray already imported here
    (the workers then start as plain processes)."""
    from verl_backend.host_memory.fork_server import fork_here

    if (
        not settings.fork_server
        or not profile.host_memory
        or os.environ.get("RAY_ADDRESS")
        or not sys.platform.startswith("linux")
    ):
        return
    started = fork_here()
    if started is not None:
        fork_server["pid"], fork_server["socket"] = started


def run_with_restarts(config, max_restarts: int, task_runner: str = "driver") -> None:
    """Run VeRL; after a dead actor, start again from the last checkpoint (VeRL's ``resume_mode=auto``).

    Only failures of Ray actors/workers (killed, crashed, out of memory, node lost) are retried; a bug or bad
    input fails at once. Each restart tears the job's actors down (``ray.shutdown``) so their placement groups
    are released, then VeRL finds ``latest_checkpointed_iteration.txt`` and continues from that step.
    """
    import ray
    from omegaconf import open_dict

    for attempt in range(max_restarts + 1):
        try:
            _run_verl(config, task_runner)
            return
        except Exception as exc:
            recorded = recorded_bad_input()  # a worker's bad input that VeRL's agent loop logged and went past
            if recorded is not None:
                raise BadInputError(recorded) from exc
            failure = _actor_failure(exc)
            name = type(failure).__name__ if failure is not None else _dead_actor_in_cluster()
            if name is None:
                raise
            step = last_checkpoint_step(Path(config.trainer.default_local_dir))
            step = "none (starting over)" if step is None else step
            if attempt == max_restarts:
                dead = _dead_actor_in_cluster() or name
                raise ActorFailedError(
                    f"a Ray actor of this run failed ({dead}) and no restart is left (--max-restarts {max_restarts}); "
                    f"last checkpoint: step {step}; run the same command again to resume from it"
                ) from exc
            print(
                f"[rl-tpu] a Ray actor failed ({name}); restarting from checkpoint step {step} "
                f"(restart {attempt + 1} of {max_restarts})",
                flush=True,
            )
            ray.shutdown()
            with open_dict(config):
                config.trainer.resume_mode = "auto"


class _TaskRunnerInDriver:
    """VeRL's ``TaskRunner`` class as ``run_ppo`` uses it (``.remote()``, then ``ray.get(runner.run.remote(config))``),
    but run in this process instead of as a Ray actor.

    The TaskRunner only orchestrates: it builds the worker groups, TransferQueue and the agent loop, then drives the
    trainer's loop, while the driver waits on it. As an actor it is one more process that imports torch and VeRL
    (0.45-0.5 GiB at the default job's peak); here it shares the driver's. Its ``run`` is VeRL's, unchanged.
    """

    def __init__(self, actor_class) -> None:
        # the class under @ray.remote (a Ray private, rl_tpu.patches.ray_internals); the actor class cannot be
        # called as is
        self._cls = undecorated_class(actor_class)

    def options(self, **_):  # run_ppo's nsight branch (CUDA profiling) asks for actor options
        return self

    def remote(self):
        import ray

        from verl_backend.workers import preemption

        # ray.init (just run by run_ppo) leaves its core worker's failure handler on SIGTERM: a crash dump and
        # SIGABRT (exit 134). Here it ends the run at the next step boundary with a checkpoint (preemption).
        preemption.install()
        runner = self._cls()

        class _Run:
            @staticmethod
            def remote(config):
                runner.run(config)
                return ray.put(None)  # what run_ppo's ray.get waits on

        return type("TaskRunnerInDriver", (), {"run": _Run})()


def task_runner_class(where: str = "driver"):
    """The ``task_runner_class`` for VeRL's ``run_ppo``: in this process unless ``where`` is ``"actor"``
    (``rl_tpu.task_runner``), or a Ray without the undecorated class where this looks for it."""
    from verl.trainer.main_ppo import TaskRunnerV1

    if where == "actor" or undecorated_class(TaskRunnerV1) is None:
        return TaskRunnerV1
    return _TaskRunnerInDriver(TaskRunnerV1)


def _run_verl(config, task_runner: str = "driver") -> None:
    """VeRL's own entry (``verl.trainer.main_ppo.main``'s body, :mod:`verl_backend.patches.verl_internals`)."""
    from verl_backend.patches.verl_internals import run_main_body

    run_main_body(config, task_runner_class(task_runner))


def job_runtime_env(config, out: Path, settings, fork_server: dict) -> None:
    """Put what every Ray worker of the job needs into VeRL's ``ray_kwargs.ray_init`` (in place): the settings record
    and the run's log paths as the job's ``runtime_env`` (delivered with the job to every host, not inherited), and,
    for a local CPU job, enough CPU slots and the fork server's interpreter. Also sets them in this process."""
    from omegaconf import open_dict

    from verl_backend import settings as job_settings
    from verl_backend.host_memory.heap import HOST_MALLOC_ENV

    env = {
        "VERL_PLATFORM": os.environ["VERL_PLATFORM"],
        "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"),
        "TENSORBOARD_DIR": str(out / "tensorboard"),
        "TOKENIZERS_PARALLELISM": "false",
        # the job's rl_tpu settings, for every Ray worker on every host (verl_backend.settings.current)
        job_settings.RECORD_ENV: job_settings.record(settings),
        # Ray starts a spare worker per CPU slot when the driver connects; none is ever used here (~0.05 GiB each)
        "RAY_prestart_worker_first_driver": "0",
        # ... and keeps up to num_cpus (16 here, see below) idle workers alive (~0.1 GiB each): here they end after
        # Ray's 1 s idle threshold, and a later task starts a new one (about a second from the fork server)
        "RAY_num_workers_soft_limit": os.environ.get("RAY_num_workers_soft_limit", "0"),
        # TransferQueue's copy threads (default 8): at most the cores there are (it warns on every put otherwise)
        "TQ_NUM_THREADS": os.environ.get("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1))),
    }
    for k in (*job_settings.FORWARDED_ENV, *HOST_MALLOC_ENV):
        if k in os.environ:
            env[k] = os.environ[k]
    os.environ.update(env)
    apply_num_threads()  # where TransferQueue already read it (verl_backend.patches.transfer_queue)
    print(
        f"[rl-tpu] settings record {job_settings.digest(env[job_settings.RECORD_ENV])} goes to every worker "
        "with the job",
        flush=True,
    )
    with open_dict(config):
        runtime_env = config.ray_kwargs.ray_init.setdefault("runtime_env", {})
        runtime_env["env_vars"] = {**dict(runtime_env.get("env_vars") or {}), **env}
        if not os.environ.get("RAY_ADDRESS") and config.ray_kwargs.ray_init.get("num_cpus") is None:
            # VeRL's TaskRunner, TransferQueue, agent-loop and reward actors each need a CPU slot to be
            # scheduled; on a 2-core machine Ray's default (one slot per core) leaves the job waiting forever.
            config.ray_kwargs.ray_init.num_cpus = max(16, os.cpu_count() or 1)
        config.ray_kwargs.ray_init.setdefault("include_dashboard", False)
        if fork_server.get("socket") and not runtime_env.get("py_executable"):
            from verl_backend.host_memory.fork_server import worker_py_executable

            runtime_env["py_executable"] = worker_py_executable(fork_server["socket"])
