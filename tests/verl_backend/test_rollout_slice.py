"""``rl_tpu.rollout_slice`` (``--rollout-slice``) before anything waits: the name is a slice, the Ray cluster has it
(counted as ``ray_cluster.pools.place_pools`` counts, by its cluster check), then one refusal line: not yet mapped
onto VeRL's rollout pool. The cluster is a real one-node Ray started here whose resources name one v6e-4 slice (the
``TPU-<pod type>-head`` resource Ray's TPU nodes carry)."""

from __future__ import annotations

import pytest

from verl_backend.driver.preflight_async import check_rollout_slice
from verl_backend.errors import BadInputError


@pytest.fixture(autouse=True)
def no_ray_joined_yet(monkeypatch):
    """Each test starts as the driver's pre-flight does: this process joined no Ray cluster. (An earlier test of the
    same pytest process can leave one joined: Ray starts a local cluster by itself on a first ``ray.put``.)"""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _line(value: str, trainer_slice: str = "") -> str:
    with pytest.raises(BadInputError) as caught:
        check_rollout_slice(value, trainer_slice)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_unset_passes_bad_names_and_no_cluster_are_one_line(monkeypatch):
    check_rollout_slice("")
    assert _line("v6e-7").startswith("rl_tpu.rollout_slice=v6e-7: 'v6e-7' (7 chips) has no standard v6e topology; "
                                     "use one of v6e-1, v6e-4, v6e-8")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _line("v6e-4") == ("rl_tpu.rollout_slice=v6e-4: a rollout slice needs a Ray cluster that has it; set "
                              "$RAY_ADDRESS (locally: rl-tpu cluster up --fake-slice v6e-4)")


def test_checked_against_the_cluster_then_refused():
    import shutil
    import tempfile

    import ray

    temp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    ray.init(num_cpus=1, resources={"TPU": 4, "TPU-v6e-4-head": 1}, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False, _temp_dir=temp)
    try:
        assert _line("v6e-4").startswith("rl_tpu.rollout_slice=v6e-4: the cluster has it, but rl-tpu does not yet "
                                         "map a rollout slice onto VeRL's rollout pool")
        assert "x1 requested but this cluster has 0" in _line("v6e-8")
        # trainer and rollout of one pod type need two such slices (place_pools)
        assert "x2 requested but this cluster has 1" in _line("v6e-4", trainer_slice="v6e-4")
        assert "the cluster has it" in _line("v6e-4", trainer_slice="v4-16")
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_flag_is_the_keys_shortcut_and_is_checked_before_ray(tmp_path):
    from test_cli import _one_error_line, verl

    line = _one_error_line(verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "--print-config",
                                "--rollout-slice", "v6e-7"))
    assert line.startswith("verl: error: rl_tpu.rollout_slice=v6e-7: 'v6e-7' (7 chips) has no standard v6e topology")
