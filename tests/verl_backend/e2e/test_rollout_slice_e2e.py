"""End to end, ``verl train --backend cpu --slice v6e-1 --rollout-slice v6e-1`` on a fake two-slice cluster: the
trainer's pool is one slice and VeRL's standalone rollout replica is the other, both reserved whole with
``ray.util.tpu``; ``separate_async``, the rollout pool's shape and the ``gloo`` checkpoint engine come from the one
setting, and every step's weights reach the rollout slice through that engine. With 2 mini-batches per sync cycle and
bypass mode off, VeRL's ``DetachActorWorker`` saves pi_old and restores it for the second mini-batch's old log-probs on
rl-tpu's engine (the patched save,
``test_patches.py::test_detached_actor_keeps_pi_old_on_cpu_for_sharded_and_plain_modules``).

The sampler is the TPU profile's (``sampler_placement=worker``, bucketed, no CPU fast path): on a TPU a process owns
its chip, so the rollout slice's ``CheckpointEngineWorker`` (the process holding the chip) samples, and its rollout
server only forwards batches to it. The server placement of a standalone replica is covered by
``test_separate_async_e2e.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from e2e_helpers import fake_cluster, train_env, train_rows, write_reward
from families import build_tiny_model

from verl_backend.driver.profiles import TPU_SAMPLER  # in the worker holding the chip, no CPU fast path

pytestmark = pytest.mark.slow

STEPS = 2


@pytest.fixture(scope="module")
def two_fake_slices(tmp_path_factory):
    """Two fake v6e-1 slices (head + one 1-chip host each), stopped by pid at the end."""
    with fake_cluster(["v6e-1", "v6e-1"], tmp_path_factory.mktemp("cluster") / "state.json") as cluster:
        yield cluster


def test_trainer_and_rollout_each_reserve_a_slice_and_weights_cross_between_them(
    two_fake_slices, tmp_path, default_model_dir
):
    from transformers import AutoModelForCausalLM

    model = build_tiny_model("llama", default_model_dir, tmp_path / "model")
    out = tmp_path / "run"
    env = dict(train_env(), RAY_ADDRESS=two_fake_slices.address)
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        "--slice",
        "v6e-1",
        "--rollout-slice",
        "v6e-1",
        "--max-restarts",
        "0",
        f"actor_rollout_ref.model.path={model}",
        "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"trainer.total_training_steps={STEPS}",
        f"trainer.save_freq={STEPS}",
        f"trainer.test_freq={STEPS}",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=32",
        "rl_tpu.val_size=4",
        "rl_tpu.slice_timeout_s=180",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "algorithm.rollout_correction.bypass_mode=false",
        f"+actor_rollout_ref.rollout.engine_kwargs.native={TPU_SAMPLER}",
        *write_reward(tmp_path),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1500)
    log = proc.stdout + proc.stderr
    (tmp_path / "driver.log").write_text(log)  # kept for a look after a failure
    assert proc.returncode == 0, log[-5000:]

    # the one setting made the job separate_async with a one-chip rollout pool and rl-tpu's engine between pools
    config = yaml.safe_load((out / "config.yaml").read_text())
    rollout = config["actor_rollout_ref"]["rollout"]
    assert config["trainer"]["v1"]["trainer_mode"] == "separate_async"
    assert (rollout["nnodes"], rollout["n_gpus_per_node"]) == (1, 1)
    assert rollout["checkpoint_engine"]["backend"] == "gloo"
    assert config["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 2  # fitted: 8 = 2 x 4
    assert config["rl_tpu"]["rollout_slice"] == "v6e-1"

    # each pool reserved a whole slice of its own, on different fake slices of this cluster
    names = {s["name"] for s in two_fake_slices.slices}
    trainer = re.findall(r"resource pool global_pool: slice v6e-1 \((\S+)\) reserved with ray\.util\.tpu", log)
    rollout_slice = re.findall(
        r"rollout slice v6e-1 \((\S+)\) reserved with ray\.util\.tpu for the standalone "
        r"rollout replicas",
        log,
    )
    assert len(trainer) == 1 and len(rollout_slice) == 1, log[-5000:]
    assert {trainer[0], rollout_slice[0]} == names

    # every step's weights crossed from the trainer's slice to the rollout's through the gloo engine, whole
    hf = AutoModelForCausalLM.from_pretrained(model)
    model_bytes = sum(t.nbytes for t in hf.state_dict().values())
    rows = train_rows(out)
    assert len(rows) == STEPS
    for m in rows:
        assert m["weight_sync/pool_bytes"] == model_bytes
        assert m["weight_sync/pool_seconds"] > 0
        assert m["weight_sync/pool_shared_memory"] == 1.0  # the fake slices share this host: the shared-memory path
        # the trainer's proof crossed the group; the standalone replica checked its live weights and said so
        assert m["weight_sync/verified"] == 1.0 and m["weight_sync/verify_max_abs_diff"] < 1e-3, m
        assert m["timing_s/old_log_prob"] > 0  # bypass off: pi_old's log-probs computed, saved/restored in between
    # the rollout slice's replica (rank 1: the trainer's colocated replica is 0) samples in the CheckpointEngineWorker
    # that holds its chip, which loads what the gloo engine delivered into its own sampler
    assert re.search(
        r"\(CheckpointEngineWorker pid=\d+\).*weight sync to rollout replica 1: in process, loaded on "
        r"the rollout worker's own device, \d+ MB",
        log,
    ), log[-5000:]
    assert re.search(
        r"\(CheckpointEngineWorker pid=\d+\).*rollout samples in GlooCheckpointEngine's worker process", log
    ), log[-5000:]
    # validation runs in separate_async too (VeRL switches the trainer's replicas to rollout for it)
    rows_all = [json.loads(line)["data"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [v for r in rows_all for k, v in r.items() if k.startswith("val-core/") and "/acc/mean@" in k]
    assert len(vals) == 1 and 0 <= vals[0] <= 1, vals
    ckpt = out / "checkpoints" / f"global_step_{STEPS}" / "actor" / "huggingface"
    assert AutoModelForCausalLM.from_pretrained(ckpt).num_parameters() == hf.num_parameters()
