"""``rl_tpu.rollout_slice`` (``--rollout-slice``) before anything waits: the backend places slices, the trainer has a
slice, the name is a slice, the Ray cluster has it (counted as ``ray_cluster.pools.place_pools`` counts, by its
cluster check); then it is VeRL's standalone rollout pool keys, and a job that gives other values for them is
refused in one line. The cluster is a real one-node Ray started here whose resources name one v6e-4 slice (the
``TPU-<pod type>-head`` resource Ray's TPU nodes carry). The run on a fake two-slice cluster:
``test_rollout_slice_e2e.py``."""

from __future__ import annotations

import pytest

from verl_backend.driver.preflight_async import (
    check_rollout_slice_config,
    rollout_slice_keys,
)
from verl_backend.errors import BadInputError


@pytest.fixture(autouse=True)
def no_ray_joined_yet(monkeypatch):
    """Each test starts as the driver's pre-flight does: this process joined no Ray cluster. (An earlier test of the
    same pytest process can leave one joined: Ray starts a local cluster by itself on a first ``ray.put``.)"""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _line(value: str, trainer_slice: str = "v4-16", slices: str = "dry_run") -> str:
    with pytest.raises(BadInputError) as caught:
        rollout_slice_keys(value, trainer_slice, slices)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_unset_passes_bad_names_and_no_cluster_are_one_line(monkeypatch):
    assert rollout_slice_keys("") == {}
    assert _line("v6e-4", slices="none") == (
        "rl_tpu.rollout_slice=v6e-4: a rollout slice applies to --backend tpu "
        "(or cpu, as a dry run on a fake slice); drop it"
    )
    assert _line("v6e-4", trainer_slice="") == (
        "rl_tpu.rollout_slice=v6e-4: the trainer needs a slice of its own "
        "too; set rl_tpu.slice (--slice), e.g. --slice v6e-4"
    )
    assert _line("v6e-7").startswith(
        "rl_tpu.rollout_slice=v6e-7: 'v6e-7' (7 chips) has no standard v6e topology; use one of v6e-1, v6e-4, v6e-8"
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _line("v6e-4") == (
        "rl_tpu.rollout_slice=v6e-4: a rollout slice needs a Ray cluster that has it; set "
        "$RAY_ADDRESS (locally: rl-tpu cluster up --fake-slice v6e-4)"
    )


def test_checked_against_the_cluster_then_the_rollout_pool_keys():
    import shutil
    import tempfile

    import ray

    temp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    ray.init(
        num_cpus=1,
        resources={"TPU": 4, "TPU-v6e-4-head": 1},
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        _temp_dir=temp,
    )
    try:
        assert rollout_slice_keys("v6e-4", "v4-16", "dry_run") == {
            "trainer.v1.trainer_mode": "separate_async",
            "actor_rollout_ref.rollout.nnodes": "1",
            "actor_rollout_ref.rollout.n_gpus_per_node": "4",
            "actor_rollout_ref.rollout.checkpoint_engine.backend": "gloo",
        }
        assert "x1 requested but this cluster has 0" in _line("v6e-8")
        # trainer and rollout of one pod type need two such slices (place_pools)
        assert "x2 requested but this cluster has 1" in _line("v6e-4", trainer_slice="v6e-4")
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_flag_is_the_keys_shortcut_and_is_checked_before_ray(tmp_path):
    from test_cli import _one_error_line, verl

    line = _one_error_line(
        verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "--print-config", "--rollout-slice", "v6e-7")
    )
    assert line.startswith("verl: error: rl_tpu.rollout_slice=v6e-7: 'v6e-7' (7 chips) has no standard v6e topology")


def _composed(**given):
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {
            "trainer": {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 4}}},
            "data": {"train_batch_size": 8},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}, "rollout": {"nnodes": 2, "n_gpus_per_node": 4}},
        }
    )
    for key, value in given.items():
        OmegaConf.update(config, key.replace("__", "."), value)
    OmegaConf.set_struct(config, True)
    return config


KEYS = {
    "trainer.v1.trainer_mode": "separate_async",
    "actor_rollout_ref.rollout.nnodes": "2",
    "actor_rollout_ref.rollout.n_gpus_per_node": "4",
    "actor_rollout_ref.rollout.checkpoint_engine.backend": "gloo",
}


def test_the_job_keeps_the_slices_pool_shape_and_gets_a_sync_step_that_fits():
    config = _composed()
    check_rollout_slice_config(config, "v6e-8", KEYS, set())
    assert config.trainer.v1.separate_async.parameter_sync_step == 2  # 8 = 2 x 4: VeRL's identity, fitted
    given = _composed()
    check_rollout_slice_config(given, "v6e-8", KEYS, {"trainer.v1.separate_async.parameter_sync_step"})
    assert given.trainer.v1.separate_async.parameter_sync_step == 4  # the user's: left for check_trainer_mode
    check_rollout_slice_config(_composed(trainer__v1__trainer_mode="sync"), "", {}, set())  # no rollout slice
    with pytest.raises(BadInputError) as caught:
        check_rollout_slice_config(_composed(actor_rollout_ref__rollout__n_gpus_per_node=2), "v6e-8", KEYS, set())
    assert str(caught.value) == (
        "rl_tpu.rollout_slice=v6e-8 sets actor_rollout_ref.rollout.n_gpus_per_node=4, but "
        "the job gives 2; drop actor_rollout_ref.rollout.n_gpus_per_node (the rollout slice "
        "decides it)"
    )
    with pytest.raises(BadInputError) as caught:
        check_rollout_slice_config(_composed(trainer__v1__trainer_mode="colocate_async"), "v6e-8", KEYS, set())
    assert "sets trainer.v1.trainer_mode=separate_async, but the job gives colocate_async" in str(caught.value)
