"""``rl_tpu.rollout_num_threads`` and ``rl_tpu.omp_wait_policy``: the rollout samples with its own thread count (the
trainer worker's own count put back after), and OpenMP's wait policy reaches this process, the fork server and the
job's ``runtime_env`` for every worker."""

from __future__ import annotations

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from verl_backend import settings as S


class CountingSampler:
    """Stands in for the sampler here: records the torch thread count it ran with (the thing under test)."""

    def __init__(self):
        self.threads: list[int] = []

    def generate(self, prompts, params, seeds=None):
        self.threads.append(torch.get_num_threads())
        return []


@pytest.fixture
def threads_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "chosen, expected", [({"rollout_num_threads": 1, "num_threads": 2}, 1), ({"num_threads": 1}, 1), ({}, 2)]
)
def test_the_rollout_samples_with_its_own_thread_count_and_puts_the_workers_back(
    monkeypatch, threads_back, chosen, expected
):
    from verl_backend.rollout.sampling import run_sampler

    section = S.rollout_settings(S.RlTpuSettings(**chosen))  # what the rollout's entry point hands down
    torch.set_num_threads(2)  # the trainer worker's count (an update with 2 threads)
    sampler = CountingSampler()
    run_sampler(sampler, [[1, 2, 3]], None, threads=section.threads)
    assert sampler.threads == [expected]
    assert torch.get_num_threads() == 2


@pytest.fixture
def environ_back():
    """``_apply_profile`` and ``job_runtime_env`` set variables in this process for the processes it starts: put the
    environment back as it was, so no later test inherits them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_the_wait_policy_is_set_for_this_process_and_every_worker(monkeypatch, tmp_path, environ_back):
    from verl_backend.driver.profiles import PROFILES
    from verl_backend.driver.runner import job_runtime_env
    from verl_backend.driver.train import _apply_profile

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for key in ("OMP_NUM_THREADS", "VERL_PLATFORM", "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        monkeypatch.setenv(key, os.environ.get(key, "cpu" if key == "VERL_PLATFORM" else "1"))
    settings = _apply_profile(PROFILES["cpu"], S.RlTpuSettings(omp_wait_policy="passive"))
    # (verl train applies the profile before it starts the fork server, whose torch then loads OpenMP with it)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # before the fork server starts from this process
    config = OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 2, "runtime_env": {}}}})  # as VeRL composes it
    job_runtime_env(config, tmp_path, settings, {})
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert json.loads(env[S.RECORD_ENV])["omp_wait_policy"] == "passive"  # and recorded with the run


def test_an_unknown_wait_policy_is_one_line():
    with pytest.raises(S.BadInputError, match="omp_wait_policy takes one of default, active, passive"):
        S.resolve({"omp_wait_policy": "spin"}, {})


def test_the_thread_count_goes_by_the_record_alone(monkeypatch, tmp_path, environ_back, threads_back):
    """``rl_tpu.num_threads`` reaches a trainer worker in the settings record only: the job's runtime_env carries
    no ``OMP_NUM_THREADS`` (not even one the driver's shell exported), and the engine's initialisation, where a
    worker reads its record, sets torch's count from it. Negative control: an engine whose record says 0 leaves the
    process's count alone."""
    from verl_backend.driver.runner import job_runtime_env
    from verl_backend.workers.engine import _JobSettingsHere

    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a user's shell
    monkeypatch.setenv("VERL_PLATFORM", os.environ.get("VERL_PLATFORM", "cpu"))  # set by verl train before this
    settings = S.RlTpuSettings(num_threads=1)
    config = OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 2, "runtime_env": {}}}})
    job_runtime_env(config, tmp_path, settings, {})
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert "OMP_NUM_THREADS" not in env and json.loads(env[S.RECORD_ENV])["num_threads"] == 1

    class Base:
        def initialize(self):
            return "built"

    class Engine(_JobSettingsHere, Base):
        pass

    torch.set_num_threads(2)
    monkeypatch.setenv(S.RECORD_ENV, env[S.RECORD_ENV])
    assert Engine().initialize() == "built" and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setenv(S.RECORD_ENV, S.record(S.RlTpuSettings(num_threads=0)))
    Engine().initialize()
    assert torch.get_num_threads() == 2
