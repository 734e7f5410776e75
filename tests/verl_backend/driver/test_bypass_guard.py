"""Bypass mode reuses the rollout's log-probs as the old policy's only where rollout and actor compute alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from verl_backend.driver.bypass_guard import BYPASS_KEY, guard_bypass, rollout_trainer_mismatch
from verl_backend.errors import BadInputError


def _config(rollout_dtype: str, param_dtype: str | None, bypass: bool = True):
    actor = {"fsdp_config": {"mixed_precision": {"param_dtype": param_dtype}}} if param_dtype else {}
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"dtype": rollout_dtype}, "actor": actor},
            "algorithm": {"rollout_correction": {"bypass_mode": bypass}},
        }
    )


def test_same_precision_keeps_bypass_and_another_turns_it_off_with_one_line(capsys):
    same = _config("float32", "fp32")
    assert rollout_trainer_mismatch(same) is None and guard_bypass(same, set()) is None
    assert same.algorithm.rollout_correction.bypass_mode is True
    mixed = _config("bfloat16", "fp32")
    line = guard_bypass(mixed, set())
    assert mixed.algorithm.rollout_correction.bypass_mode is False
    assert "rollout samples in bfloat16" in line and "actor computes in float32" in line
    assert capsys.readouterr().out.strip() == line
    assert rollout_trainer_mismatch(_config("float32", None)) is not None  # VeRL's default param_dtype is bf16


def test_bypass_the_user_asked_for_on_a_mismatch_is_refused():
    with pytest.raises(
        BadInputError,
        match=r"algorithm.rollout_correction.bypass_mode=true reuses .* set "
        r"algorithm.rollout_correction.bypass_mode=false",
    ):
        guard_bypass(_config("bfloat16", "fp32"), {BYPASS_KEY})
    off = _config("bfloat16", "fp32", bypass=False)
    assert guard_bypass(off, {BYPASS_KEY}) is None  # bypass off: nothing to guard


def test_the_cpu_default_with_a_bf16_rollout_recomputes_old_log_probs(tmp_path):
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_backend.driver.cli",
            "train",
            "--backend",
            "cpu",
            "--print-config",
            "--output-dir",
            str(tmp_path),
            "actor_rollout_ref.rollout.dtype=bfloat16",
            "data.train_files=x.parquet",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    said = [l for l in lines if l.startswith("[rl-tpu]") and "bypass_mode is off" in l]
    assert len(said) == 1
    config = yaml.safe_load("\n".join(l for l in lines if not l.startswith("[rl-tpu]")))
    assert config["algorithm"]["rollout_correction"]["bypass_mode"] is False
