"""Settings travel with the job: on a cluster whose Ray nodes were started before the job, from an environment
that is not the driver's (the shape of a TPU slice under KubeRay), a ``verl train`` job's ``rl_tpu.*`` settings
change what its workers do, and ``RL_TPU_*`` variables the nodes carry change nothing.

Evidence is read where behaviour branches, not from an echo of the config: the engine the trainer built (unwrapped
or FSDP2, and the checkpoint's ``FSDP_version`` tag), whether the actor's heap-trim hook was installed, the
weight-sync transport the rollout adapter chose, and the settings record each engine loaded (its digest against
the driver's). Delivered, not exercised on this shape (checked for delivery only, through the record's digest):
``tpu_eager_mode`` (no chip), ``fork_server`` (a local job only), shared memory across hosts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import fake_cluster

pytestmark = pytest.mark.slow

NODE_ENV = {
    "RL_TPU_PLAIN_MODULE": "0",
    "RL_TPU_TRIM_BACKWARD": "1",
    "RL_TPU_SHARED_WEIGHTS": "0",
    "RL_TPU_RESPONSE_ONLY_LOGITS": "0",
}


@pytest.fixture(scope="module")
def preexisting_cluster(tmp_path_factory):
    """A fake v6e-4 slice (head + one host) started before any job, its nodes carrying ``NODE_ENV``."""
    with fake_cluster(["v6e-4"], tmp_path_factory.mktemp("cluster") / "state.json", NODE_ENV) as cluster:
        yield cluster


def _run(cluster, model: Path, out: Path, *settings: str) -> tuple[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_TPU_")}  # the driver carries none
    env.update(RAY_ADDRESS=cluster.address, RAY_AUTH_MODE="disabled", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("VERL_PLATFORM", None)
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
        f"actor_rollout_ref.model.path={model}",
        "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=1",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "data.max_response_length=8",
        *settings,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    driver = re.search(r"\[rl-tpu\] settings record (\w+) goes to every worker", log)
    assert driver, log[-3000:]
    loaded = set(re.findall(r"\[rl-tpu\] (?:actor|reference policy): settings record (\w+)", log))
    assert loaded == {driver.group(1)}, (loaded, driver.group(1))  # every engine loaded the driver's record
    (tag,) = [
        json.loads(p.read_text())["FSDP_version"] for p in out.glob("checkpoints/global_step_1/actor/fsdp_config.json")
    ]
    return log, {"fsdp_version": tag, "record": driver.group(1)}


def test_job_settings_reach_workers_and_node_variables_do_not(preexisting_cluster, tiny_model_dir, tmp_path):
    # Negative control: the nodes say RL_TPU_PLAIN_MODULE=0 etc.; the job says nothing, so the defaults hold.
    log, seen = _run(preexisting_cluster, tiny_model_dir, tmp_path / "defaults")
    assert "actor: one CPU rank, so the model runs unwrapped" in log
    assert "heap pages handed back" not in log  # trim_backward's default (off), not the nodes' variable (on)
    assert "shared-prefix forward:" in log  # response-only logits on (the shared-prefix row is part of that path)
    assert seen["fsdp_version"] == 0
    assert "object store, rl_tpu.shared_weights=false" not in log
    assert "is deprecated and will be removed" not in log, [l for l in log.splitlines() if "deprecated" in l]
    assert not [l for l in log.splitlines() if "shared_weights=false" in l], [
        l for l in log.splitlines() if "shared_weights=false" in l
    ]

    # The job's own settings, given as keys on the command line, act in the workers on the other host.
    log, chosen = _run(
        preexisting_cluster,
        tiny_model_dir,
        tmp_path / "chosen",
        "rl_tpu.plain_module=false",
        "rl_tpu.trim_backward=true",
        "rl_tpu.shared_weights=false",
        "rl_tpu.response_only_logits=false",
    )
    assert "actor: FSDP2 wraps the model (rl_tpu.plain_module=false)" in log
    assert "actor: one CPU rank, so the model runs unwrapped" not in log
    # the actor (not the reference policy) trims the heap once per decoder layer in its backward: the tiny model's 2
    assert re.findall(r"actor backward: heap pages handed back after each of (\d+) blocks", log) == ["2"]
    assert "shared-prefix forward:" not in log  # the LM head at every position, VeRL's own path
    assert re.search(r"weight sync to rollout replica 0: object store, rl_tpu\.shared_weights=false", log), log[-3000:]
    assert chosen["fsdp_version"] == 2
    assert chosen["record"] != seen["record"]
    saved = (tmp_path / "chosen" / "config.yaml").read_text()
    assert "plain_module: false" in saved and "trim_backward: true" in saved  # recorded with the run
    assert "response_only_logits: false" in saved
