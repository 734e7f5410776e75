"""Pre-flight of VeRL's asynchronous trainer modes (``trainer.v1.trainer_mode``): ``colocate_async`` passes,
``separate_async`` is refused in one line per requirement it does not meet (VeRL 0.9.1's own asserts in
``verl/trainer/ppo/v1/trainer_separate_async.py`` fire on the same configs, much later, inside Ray)."""

from __future__ import annotations

import pytest

SEP = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "trainer.v1.separate_async.parameter_sync_step=1",
]


def _compose_cpu_default(model_dir, *overrides: str):
    """The CPU default job (verl_backend/configs/grpo_cpu.yaml: train_batch_size 4, ppo_mini_batch_size 4) on
    ``model_dir``, composed without Ray."""
    from verl_backend.driver.plan import (
        compose_config,
        flatten_yaml_overrides,
        merge_overrides,
    )
    from verl_backend.driver.profiles import PROFILES

    backend = PROFILES["cpu"]
    file_overrides, _ = flatten_yaml_overrides(backend.default_config)
    return compose_config(
        merge_overrides(backend.overrides, file_overrides, [f"actor_rollout_ref.model.path={model_dir}", *overrides])
    )


def _verl_separate_async_assert(config) -> str | None:
    """VeRL's own check: the asserts at the top of ``PPOTrainerSeparateAsync.__init__`` (only called on configs
    that fail one, so the trainer itself never starts)."""
    from verl.trainer.ppo.v1 import PPOTrainerSeparateAsync

    try:
        PPOTrainerSeparateAsync(config)
    except AssertionError as exc:
        return str(exc)
    raise AssertionError("VeRL accepted the config")  # pragma: no cover


@pytest.mark.parametrize(
    "overrides, ours, verls",
    [
        # VeRL 0.9.1 trainer_separate_async.py:56-63
        (
            SEP + ["trainer.v1.separate_async.parameter_sync_step=4"],
            (
                "needs data.train_batch_size (4) == "
                "trainer.v1.separate_async.parameter_sync_step (4) × actor_rollout_ref.actor.ppo_mini_batch_size (4) "
                "(VeRL 0.9.1 asserts it); set trainer.v1.separate_async.parameter_sync_step=1"
            ),
            "train_batch_size must equal",
        ),
        (
            SEP + ["data.train_batch_size=8", "trainer.v1.separate_async.parameter_sync_step=4"],
            "set trainer.v1.separate_async.parameter_sync_step=2",
            "train_batch_size must equal",
        ),
        # :64-67, a rollout pool of its own (VeRL's default rollout.nnodes is 0)
        (
            ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1"],
            (
                "actor_rollout_ref.rollout.nnodes=0: trainer.v1.trainer_mode=separate_async samples on a rollout "
                "pool of its own; set actor_rollout_ref.rollout.nnodes to 1 or more"
            ),
            "nnodes must be > 0",
        ),
        # :68-70
        (
            SEP + ["actor_rollout_ref.rollout.checkpoint_engine.backend=naive"],
            (
                "actor_rollout_ref.rollout.checkpoint_engine.backend=naive: VeRL's separate_async needs an engine that "
                "sends to another pool"
            ),
            "please use nccl/nixl/mooncake",
        ),
        # VeRL accepts ours (not naive), but it is colocated: refused here only
        (
            SEP + ["actor_rollout_ref.rollout.checkpoint_engine.backend=native"],
            "actor_rollout_ref.rollout.checkpoint_engine.backend=native is colocated",
            None,
        ),
        # VeRL 0.9.1 trainer_separate_async.py:181: logger.info(..., flush=True) is a TypeError (tried on --backend cpu)
        (
            SEP + ["actor_rollout_ref.rollout.checkpoint_engine.backend=gloo", "actor_rollout_ref.hybrid_engine=false"],
            "actor_rollout_ref.hybrid_engine=false: VeRL 0.9.1's separate_async then fails while it sets up",
            None,
        ),
        (
            ["trainer.v1.trainer_mode=fully_async"],
            ("trainer.v1.trainer_mode=fully_async: give one of sync, colocate_async, separate_async"),
            None,
        ),
    ],
)
def test_separate_async_requirements_are_refused_in_one_line(monkeypatch, tiny_model_dir, overrides, ours, verls):
    from verl_backend.driver.preflight_async import check_trainer_mode
    from verl_backend.errors import BadInputError

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    config = _compose_cpu_default(tiny_model_dir, *overrides)
    with pytest.raises(BadInputError) as caught:
        check_trainer_mode(config)
    assert ours in str(caught.value) and "\n" not in str(caught.value)
    if verls:  # the same config fails VeRL's own assert
        assert verls in _verl_separate_async_assert(config)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.v1.trainer_mode=sync"],
        ["trainer.v1.trainer_mode=colocate_async"],
        SEP + ["actor_rollout_ref.rollout.checkpoint_engine.backend=gloo"],
    ],
)
def test_what_the_backend_can_run_passes(monkeypatch, tiny_model_dir, overrides):
    from verl_backend.driver.preflight_async import check_trainer_mode

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    check_trainer_mode(_compose_cpu_default(tiny_model_dir, *overrides))


def test_verl_train_refuses_separate_async_before_ray(tmp_path):
    from test_cli import _one_error_line, verl

    line = _one_error_line(verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "--print-config", *SEP))
    assert line.startswith(
        "verl: error: actor_rollout_ref.rollout.checkpoint_engine.backend=naive: VeRL's "
        "separate_async needs an engine that sends to another pool"
    )
