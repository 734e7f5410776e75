"""The TPU dry run on the ``tpu-on-cpu`` compile backend (issue #43): ``verl train --backend cpu --tpu-dry-run`` with
``rl_tpu.compile_backend=tpu-on-cpu`` and the TPU profile's compile flags, so the trainer's blocks (forward and
backward) and the sampler's prefill and decode run as TorchTPU's StableHLO on XLA:CPU inside the Ray workers.

One step of a tiny peaked Llama (2 prompts x 2 samples on a fake v6e-4, 16 response tokens, so the decode passes
through several cache buckets). Skipped without ``.venv-aot`` (``.ci/aot_venv``).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from verl_backend.tpu_on_cpu import aot_python_path

pytestmark = pytest.mark.skipif(aot_python_path() is None, reason="torch-tpu is not installed (.ci/aot_venv)")


@pytest.fixture(scope="module")
def fake_v6e_4(tmp_path_factory):
    from e2e_helpers import fake_cluster

    with fake_cluster(["v6e-4"], tmp_path_factory.mktemp("cluster") / "state.json") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def dry_run(fake_v6e_4, default_model_dir, tmp_path_factory):
    from e2e_helpers import train_env, write_reward
    from families import build_tiny_model

    model = build_tiny_model("llama", default_model_dir, tmp_path_factory.mktemp("peaked_llama"), weight_std=0.2)
    out = tmp_path_factory.mktemp("tpu_on_cpu_dry_run")
    env = dict(train_env(), RAY_ADDRESS=fake_v6e_4.address, RAY_DEDUP_LOGS="0")
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--tpu-dry-run",
        "--output-dir",
        str(out),
        "--max-restarts",
        "0",
        f"actor_rollout_ref.model.path={model}",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "rl_tpu.slice_timeout_s=180",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "data.max_response_length=16",
        "rl_tpu.compile_trainer=true",
        "rl_tpu.compile_sampler=true",
        "rl_tpu.compile_backend=tpu-on-cpu",
        "rl_tpu.tpu_dry_run_compile=false",
        *write_reward(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    (out / "driver.log").write_text(proc.stdout + proc.stderr)
    return out, proc, proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_dry_run_executes_torch_tpu_graphs_on_xla_cpu(dry_run):
    out, proc, log = dry_run
    assert proc.returncode == 0, log[-5000:]
    graphs = re.findall(r"tpu-on-cpu: graph (\S+) \(", log)
    kinds = {name.split(".")[0] for name in graphs}
    # the sampler's prefill and decode, the actor's blocks forward and backward, all lowered and run on XLA:CPU
    assert {"sampler", "actor"} <= kinds, log[-5000:]
    assert any(name.startswith("actor.block.bwd") for name in graphs), log[-5000:]
    assert "runs as torch eager" not in log, [ln for ln in log.splitlines() if "torch eager" in ln][:3]
    assert "compiled steps off" not in log
