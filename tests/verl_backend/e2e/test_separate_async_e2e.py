"""End to end, VeRL 0.9.1's ``separate_async`` trainer on ``verl train --backend cpu``: the rollout replica runs in a
pool of its own (``actor_rollout_ref.rollout.nnodes``/``n_gpus_per_node``), weights reach it through rl-tpu's
``gloo`` checkpoint engine (1 MiB buckets), and a killed rollout replica ends in a resume from the last checkpoint
(``--max-restarts``) with no completed step lost."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tempfile

import pytest
import yaml
from e2e_helpers import train_rows, write_reward
from families import build_tiny_model
from test_fault_tolerance import (
    MARKER,
    _kill_when,
    _metrics_steps,
    _restart_step,
    _verl_env,
)

pytestmark = pytest.mark.slow

STEPS = 3
# trainer.v1.sampler.max_off_policy_threshold: a sample spans at most 3 weight versions. The resumed run's first batch
# comes from the replay buffer the checkpoint kept (TransferQueue state), sampled before the kill: 2 versions behind.
BOUND = 3
STALE = "training/off_policy/trajectory_staleness_worst/max"


def test_separate_async_syncs_through_gloo_and_resumes_after_a_killed_rollout_replica(tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    model = build_tiny_model("llama", default_model_dir, tmp_path / "model")
    out, log_path = tmp_path / "run", tmp_path / "log.txt"
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
        "1",
        f"actor_rollout_ref.model.path={model}",
        "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.v1.separate_async.parameter_sync_step=1",
        f"trainer.v1.sampler.max_off_policy_threshold={BOUND}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=16",
        "rl_tpu.val_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"+ray_kwargs.ray_init._temp_dir={tempfile.mkdtemp(prefix='sa', dir='/tmp')}",
        *write_reward(tmp_path),
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
        try:
            # the standalone replica's server is the newest NativeRolloutServer (the hybrid one starts with the
            # trainer workers, before the standalone pool exists)
            _kill_when(proc, out / "metrics.jsonl", env[MARKER], 1, "NativeRolloutServer", newest=True)
            _restart_step(proc, log_path, 1)
            rc = proc.wait(timeout=1500)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert rc == 0, text[-5000:]
    assert text.count("[rl-tpu] a Ray actor failed") == 1
    resumed = int(re.findall(r"restarting from checkpoint step (\d+)", text)[0])
    assert resumed >= 1
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["trainer"]["v1"]["trainer_mode"] == "separate_async"
    assert config["actor_rollout_ref"]["rollout"]["checkpoint_engine"]["backend"] == "gloo"
    # every step's weights went trainer rank 0 -> the standalone replica through the gloo engine, whole, in 1 MiB
    # buckets (VeRL's export sends a tied LM head under both of its names: the checkpoint's state dict)
    hf = AutoModelForCausalLM.from_pretrained(model)
    model_bytes = sum(t.nbytes for t in hf.state_dict().values())
    rows = train_rows(out)
    assert {1, *range(resumed + 1, STEPS + 1)} <= _metrics_steps(out / "metrics.jsonl")
    for m in rows:
        assert m["weight_sync/pool_bytes"] == model_bytes
        assert m["weight_sync/pool_buckets"] >= model_bytes / 2**20
        assert m["weight_sync/pool_shared_memory"] == 1.0  # both pools on this host: the shared-memory path
        # the trainer's proof crossed the group; the standalone replica checked its live weights and said so
        assert m["weight_sync/verified"] == 1.0 and m["weight_sync/verify_max_abs_diff"] < 1e-3, m
        assert 0 <= m[STALE] <= BOUND - 1, m[STALE]  # VeRL drops what its bound does not allow
        assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"))
    assert abs(rows[0]["actor/ppo_kl"]) <= 1e-6  # step 1: rollout and trainer hold the same weights
    assert re.search(
        r"\(CheckpointEngineWorker pid=\d+\).*weight sync to rollout replica 1", text
    )  # the standalone one: hybrid replica 0 is the trainer's
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    for step in range(1, STEPS + 1):
        assert AutoModelForCausalLM.from_pretrained(ckpts / f"global_step_{step}/actor/huggingface").num_parameters()
