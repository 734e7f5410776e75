"""examples/qwen3_cpu.yaml and examples/lora_cpu.yaml compose into VeRL's config with a user's model folder (a tiny
Qwen3 here), and without one stop with the one line naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest
from families import build_tiny_model


def _compose(example: str, *overrides: str):
    from verl_backend.driver.profiles import PROFILES
    from verl_backend.driver.plan import compose_config, flatten_yaml_overrides, merge_overrides

    file_overrides, ours = flatten_yaml_overrides(example)
    return compose_config(merge_overrides(PROFILES["cpu"].overrides, file_overrides, list(overrides))), ours


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir):
    return build_tiny_model("qwen3", default_model_dir, tmp_path_factory.mktemp("qwen3"))


def test_qwen3_example_composes_with_the_users_checkpoint(qwen3_dir):
    config, ours = _compose("examples/qwen3_cpu.yaml", f"actor_rollout_ref.model.path={qwen3_dir}")
    assert config.actor_rollout_ref.model.path == str(qwen3_dir)
    assert config.data.apply_chat_template_kwargs.enable_thinking is False
    assert config.algorithm.adv_estimator == "grpo" and config.actor_rollout_ref.model.lora_rank == 0
    assert ours["task"] == "basic_arithmetic"


def test_lora_example_composes_with_the_users_checkpoint(qwen3_dir):
    config, _ = _compose("examples/lora_cpu.yaml", f"actor_rollout_ref.model.path={qwen3_dir}")
    model = config.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (16, 32, "all-linear")


@pytest.mark.parametrize("example", ["examples/qwen3_cpu.yaml", "examples/lora_cpu.yaml"])
def test_an_example_without_a_model_path_names_the_key(example):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_backend.driver.cli",
            "train",
            "--backend",
            "cpu",
            "--config",
            example,
            "--print-config",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "actor_rollout_ref.model.path=???" in proc.stderr.strip().splitlines()[-1]
