"""Killing actors in the middle of ``verl train --backend cpu``: the run restarts from its last checkpoint and
finishes with no completed step lost and every checkpoint loadable.

The rollout server is killed after step 1, then a trainer worker after the restarted run's first step. The test
finds the processes by a marker in their environment, so nothing else on the machine is touched.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow


MARKER = "RL_TPU_TEST_RUN"  # in the environment of every process of one test's run


def _verl_env() -> dict[str, str]:
    """This process's environment for a ``verl train`` child: its own local Ray, CPU, one thread, no auth."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled", MARKER: uuid.uuid4().hex}
    env.pop("VERL_PLATFORM", None)
    env.pop("RAY_ADDRESS", None)
    return env


def _metrics_steps(path: Path) -> set[int]:
    if not path.is_file():
        return set()
    steps = set()
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "actor/pg_loss" in row["data"]:
                steps.add(int(row["step"]))
    return steps


def _session_actor(marker: str, actor: str, newest: bool = False) -> psutil.Process | None:
    """The process of this run's Ray actor ``actor``: named ``ray::<actor>``, with the run's marker in its environment
    (a Ray worker is a child of the raylet, or of the fork server, verl_backend.host_memory.fork_server; both started
    from the run); the first found, or with ``newest`` the one started last."""
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        try:
            if (
                " ".join(proc.info["cmdline"] or []).startswith(f"ray::{actor}")
                and proc.environ().get(MARKER) == marker
            ):
                if not newest:
                    return proc
                found.append(proc)
        except psutil.Error:
            continue
    return max(found, key=lambda p: p.info["create_time"]) if found else None


def _kill_when(
    proc, metrics: Path, marker: str, step: int, actor: str, timeout_s: float = 900, newest: bool = False
) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if step in _metrics_steps(metrics):
            target = _session_actor(marker, actor, newest)
            if target is not None:
                target.send_signal(signal.SIGKILL)
                return target.pid
        time.sleep(0.5)
    raise AssertionError(f"never saw step {step} with a live {actor} (exit code {proc.poll()})")


def test_killed_rollout_then_trainer_actor_resume_from_checkpoint(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    temp_dir = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    env = _verl_env()
    steps = 5
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        "--max-restarts",
        "2",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=24",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        f"+ray_kwargs.ray_init._temp_dir={temp_dir}",
    ]
    log_path = tmp_path / "log.txt"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        metrics = out / "metrics.jsonl"
        _kill_when(proc, metrics, env[MARKER], 1, "NativeRolloutServer")
        # A tiny model's step takes seconds: the run may save another step before the death is seen. The restart
        # names the checkpoint it resumes from; the restarted run must finish one more step before the trainer
        # worker is killed.
        first = _restart_step(proc, log_path, 1)
        assert first < steps - 1, log_path.read_text()[-4000:]
        _kill_when(proc, metrics, env[MARKER], first + 1, "WorkerDict")
        rc = proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = log_path.read_text()
    assert rc == 0, text[-5000:]
    assert text.count("[rl-tpu] a Ray actor failed") == 2
    restarts = [int(m) for m in re.findall(r"restarting from checkpoint step (\d+)", text)]
    assert len(restarts) == 2 and 1 <= restarts[0] < restarts[1], restarts
    # VeRL saves a step's checkpoint before it logs the step: a death seen in between (the weight sync to the killed
    # rollout) loses that one metrics row, never the training state (every checkpoint is checked below)
    logged = _metrics_steps(out / "metrics.jsonl")
    required = {1, restarts[0] + 1, *range(restarts[1] + 1, steps + 1)}  # each seen before a kill, or after both
    assert required <= logged <= set(range(1, steps + 1)), logged
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps)
    from transformers import AutoModelForCausalLM

    for step in range(1, steps + 1):
        hf = ckpts / f"global_step_{step}" / "actor" / "huggingface"
        assert AutoModelForCausalLM.from_pretrained(hf).num_parameters() > 0


def _restart_step(proc, log_path: Path, nth: int, timeout_s: float = 900) -> int:
    """The checkpoint step of the run's ``nth`` restart line, once it is in the log."""
    deadline = time.time() + timeout_s
    while True:
        found = re.findall(r"restarting from checkpoint step (\d+)", log_path.read_text(errors="replace"))
        if len(found) >= nth:
            return int(found[nth - 1])
        assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-4000:]
        time.sleep(0.5)


def test_sigterm_mid_step_checkpoints_that_step_and_the_same_command_resumes(tmp_path, tiny_model_dir):
    """Preemption (a spot TPU VM gets SIGTERM ~30 s before SIGKILL): the step in flight finishes, is checkpointed
    (save_freq=-1 saves nothing by itself), the run ends with one line and exit 143 leaving no process behind, and
    the same command resumes from that checkpoint. It used to hit Ray's core-worker failure handler (exit 134)."""
    env = _verl_env()
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(tmp_path),
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
        "trainer.total_training_steps=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "rl_tpu.train_size=80",
        "rl_tpu.val_size=4",
        "data.max_response_length=8",
    ]
    log = open(tmp_path / "stderr.txt", "w+")  # files, not pipes: VeRL prints its whole config (> a pipe's 64 KiB)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env, start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not _metrics_steps(metrics):
            time.sleep(0.5)  # step 1 done: step 2 is in flight
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        err = (tmp_path / "stderr.txt").read_text()
        assert proc.returncode == 143, err[-3000:]
        line = [l for l in err.splitlines() if l.startswith("verl: ")]
        assert len(line) == 1 and re.fullmatch(
            r"verl: terminated \(SIGTERM\) after step (\d+), checkpoint written; "
            r"run the same command to resume from it",
            line[0],
        ), line
        step = int(re.search(r"after step (\d+)", line[0]).group(1))
        assert step in _metrics_steps(metrics) and step < 4  # a completed, logged step; not the run's end
        assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
        assert (tmp_path / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface").is_dir()
        assert "SIGTERM received" not in err  # no core-worker crash dump
        deadline = time.time() + 30
        while (
            time.time() < deadline
            and subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ):
            time.sleep(0.5)
        left = subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert left == [], left  # Ray's processes for this run (same session) are gone
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from the checkpoint of step {step}" in again.stdout + again.stderr
    assert _metrics_steps(metrics) >= set(range(1, 5))


def test_dead_actor_with_no_restart_left_ends_on_a_line_naming_it(tmp_path, tiny_model_dir):
    """With --max-restarts 0 a killed rollout server ended on VeRL's replay-buffer RuntimeError, naming no actor."""
    out = tmp_path / "run"
    temp_dir = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    env = _verl_env()
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        "--max-restarts",
        "0",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=16",
        "rl_tpu.val_size=4",
        "data.max_response_length=8",
        f"+ray_kwargs.ray_init._temp_dir={temp_dir}",
    ]
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        _kill_when(proc, out / "metrics.jsonl", env[MARKER], 1, "NativeRolloutServer")
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "log.txt").read_text()
    assert rc == 1, text[-4000:]
    last = [l for l in text.splitlines() if l.startswith("verl: error:")]
    # The kill lands after step 1's metrics; a tiny model may finish (and save) step 2 before the death is seen,
    # so the line must name whatever checkpoint the tracker holds, which is at least step 1.
    saved = int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 1
    assert (
        len(last) == 1
        and "a Ray actor of this run failed (NativeRolloutServer) and no restart is left "
        f"(--max-restarts 0); last checkpoint: step {saved};"
        in last[0]
    ), text[-3000:]
