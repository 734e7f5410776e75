"""Preemption: SIGTERM ends a run at the next step boundary with a checkpoint of the last completed step.

A spot or preemptible TPU VM (and Kubernetes, SLURM, ``timeout``) sends SIGTERM and about 30 s later SIGKILL. On the
first SIGTERM ``verl train`` lets the step in flight finish (a worker's update cannot be stopped half way without
losing it), then, before the next step begins, saves that step with VeRL's own checkpoint writer unless the step
was just saved (``trainer.save_freq``), and exits 143 with one line; the same command resumes from that checkpoint
(``trainer.resume_mode=auto``). A second SIGTERM, or Ctrl-C, ends at once, keeping what is already written.

This works where VeRL's TaskRunner runs in the ``verl`` process (``rl_tpu.task_runner=driver``, the default); with
the TaskRunner as its own Ray actor, SIGTERM ends the run at once, as Ctrl-C does.
"""

from __future__ import annotations

import signal
import sys
import threading

_REQUESTED = threading.Event()


class Terminated(KeyboardInterrupt):
    """SIGTERM while VeRL runs in this process: the run ends like Ctrl-C does (exit 143).

    Attributes:
        step: the completed step whose checkpoint the run ended on (``None``: no step had completed).
        saved_now: that checkpoint was written on the way out (``False``: it was already there).
    """

    def __init__(self, step: int | None = None, saved_now: bool = False) -> None:
        super().__init__()
        self.step, self.saved_now = step, saved_now


def requested() -> bool:
    """Whether a SIGTERM asked this run to stop at the next step boundary."""
    return _REQUESTED.is_set()


def _on_sigterm(signum, frame) -> None:
    if _REQUESTED.is_set():
        raise Terminated()  # a second SIGTERM: now
    _REQUESTED.set()
    print(
        "[rl-tpu] SIGTERM: finishing the step in flight, then a checkpoint of it and exit (SIGTERM again: exit now)",
        file=sys.stderr,
        flush=True,
    )


def install() -> None:
    """Take SIGTERM in this (main) thread: stop at the next step boundary (:func:`at_step_begin`). Ray's core worker
    otherwise leaves its failure handler on SIGTERM: a crash dump and SIGABRT (exit 134)."""
    if threading.current_thread() is threading.main_thread():
        _REQUESTED.clear()
        signal.signal(signal.SIGTERM, _on_sigterm)


def at_step_begin(trainer) -> None:
    """VeRL's ``PPOTrainer.on_step_begin`` hook: after a SIGTERM, checkpoint the step just completed (if it is not
    saved yet) and end the run.

    At this point step ``trainer.global_steps - 1`` is complete: trained, saved if ``save_freq`` asked, validated,
    logged, and the data loader has handed out exactly its batches. VeRL's ``_save_checkpoint`` names the folder
    after ``global_steps``, so it runs with the counter at the completed step.

    Raises:
        Terminated: always, once a SIGTERM was received.
    """
    if not _REQUESTED.is_set():
        return
    from pathlib import Path

    from verl_backend.patches.verl_internals import save_checkpoint

    completed = int(trainer.global_steps) - 1
    if completed < 1:
        raise Terminated()
    tracker = Path(trainer.config.trainer.default_local_dir) / "latest_checkpointed_iteration.txt"
    try:
        saved = int(tracker.read_text().strip()) == completed
    except (OSError, ValueError):
        saved = False
    if not saved:
        trainer.global_steps = completed
        try:
            save_checkpoint(trainer)  # VeRL's protected save (verl_backend.patches.verl_internals)
        finally:
            trainer.global_steps = completed + 1
    raise Terminated(step=completed, saved_now=not saved)
