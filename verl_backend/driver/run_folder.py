"""The run folder of ``verl train``: resume, start over, one run at a time.

VeRL's ``trainer.resume_mode=auto`` continues from the folder's last checkpoint; a run with nothing to resume moves
an earlier run's metrics and checkpoints aside instead of mixing them; a lock keeps two ``verl train`` out of one
folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from verl_backend.errors import BadInputError


def last_checkpoint_step(ckpts: Path) -> int | None:
    """The step in VeRL's ``<trainer.default_local_dir>/latest_checkpointed_iteration.txt``, or ``None`` when there
    is none (or it is unreadable: VeRL then starts over)."""
    try:
        return int((Path(ckpts) / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return None


RUN_ARTIFACTS = ("metrics.jsonl", "tensorboard", "reward_curve.png", "summary.json", "validation", "rollouts")


_RUN_LOCK_FD: int | None = None  # held open (and locked) for this process's life


def prepare_run_folder(config, out: Path) -> None:
    """Resume, refuse, or start over cleanly in a run folder that may hold an earlier run.

    VeRL's default ``trainer.resume_mode=auto`` continues from ``<trainer.default_local_dir>/
    latest_checkpointed_iteration.txt`` and appends to ``metrics.jsonl``. Before this, rerunning a finished job's
    command trained 0 steps and printed the earlier run's accuracy as new, and a run with nothing to resume (no
    checkpoint, or ``resume_mode=disable``) wrote its metrics after the earlier run's and its checkpoints among them.

    - a checkpoint to resume, before the last step: say so; end ``metrics.jsonl`` with a newline if a kill cut it;
    - a checkpoint at ``trainer.total_training_steps`` already (and ``resume_mode=auto``): refuse, nothing to train;
    - no resume but earlier metrics or checkpoints here: move them into ``<out>/earlier/<time>/`` (renames, so
      nothing is lost) and say so. Checkpoints kept outside ``out`` (a ``trainer.default_local_dir`` elsewhere)
      are not moved; with ``resume_mode=disable`` over them the run is refused instead.

    Raises:
        BadInputError: nothing left to train, or earlier checkpoints outside ``out`` that a fresh run would mix into.
    """
    mode = str(config.trainer.get("resume_mode", "auto"))
    if mode not in ("auto", "disable"):
        return  # resume_path: VeRL resumes the checkpoint the user named (trainer.resume_from_path), as it is
    ckpts = Path(str(config.trainer.default_local_dir))
    step = last_checkpoint_step(ckpts)
    if mode == "auto" and step is not None:
        total = config.trainer.get("total_training_steps")
        if total is not None and step >= int(total):
            raise BadInputError(
                f"{ckpts} already holds the checkpoint of step {step}, the last of trainer.total_training_steps="
                f"{total}: nothing to train; give another --output-dir (or trainer.experiment_name), or raise "
                "trainer.total_training_steps to train on"
            )
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size and not metrics.read_bytes().endswith(b"\n"):
            with open(metrics, "ab") as f:  # a cut last line would swallow the resumed run's first row
                f.write(b"\n")
        print(
            f"[rl-tpu] resuming from the checkpoint of step {step} in {ckpts} (VeRL's trainer.resume_mode=auto); "
            "give another --output-dir, or move that folder away, to start over",
            flush=True,
        )
        return
    earlier = [out / name for name in RUN_ARTIFACTS if (out / name).exists()]
    has_steps = ckpts.is_dir() and any(ckpts.glob("global_step_*"))
    inside = ckpts.resolve().parent == out.resolve()
    if has_steps and not inside:
        raise BadInputError(
            f"trainer.default_local_dir={ckpts} holds checkpoints of an earlier run that trainer.resume_mode={mode} "
            "would mix new ones into; give another trainer.default_local_dir, or move those away"
        )
    if has_steps:
        earlier.append(ckpts)
    if not earlier:
        return
    dest = out / "earlier" / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True, exist_ok=False)
    for path in earlier:
        path.rename(dest / path.name)
    print(
        f"[rl-tpu] {out} held an earlier run with nothing to resume ({', '.join(p.name for p in earlier)}): moved "
        f"to {dest}; starting over",
        flush=True,
    )


def lock_run_folder(out: Path) -> None:
    """Take ``<out>/.verl_train.lock`` (``fcntl.flock``) for this process, so a second ``verl train`` into the same
    folder stops at once instead of interleaving its metrics and checkpoints with the first's.

    Raises:
        BadInputError: another live process holds the folder (its pid named).
    """
    import fcntl

    global _RUN_LOCK_FD
    fd = os.open(out / ".verl_train.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise BadInputError(
            f"{out} is in use by another verl train (pid {holder}): give another --output-dir, or "
            "wait for that run to end"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _RUN_LOCK_FD = fd
