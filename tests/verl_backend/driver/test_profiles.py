"""The backend profile table: one row per ``--backend``, read by the driver instead of branches on the name."""

from __future__ import annotations

import pytest

from verl_backend.driver.profiles import BACKENDS, PROFILES, profile
from verl_backend.errors import BadInputError


def test_every_device_backend_has_a_profile_with_verls_platform_name():
    from rl_tpu.device import BACKENDS as DEVICE_BACKENDS

    assert set(BACKENDS) == set(DEVICE_BACKENDS)
    assert {name: p.platform for name, p in PROFILES.items()} == {"cpu": "cpu", "tpu": "tpu", "cuda": "nvidia"}
    for name, p in PROFILES.items():
        assert p.name == name and p.slices in ("auto", "dry_run", "none")
        assert p.overrides.get("trainer.device", "cuda") == name  # each profile names its own device to VeRL
    assert PROFILES["cpu"].default_config.is_file() and PROFILES["cpu"].default_threads == 2
    assert PROFILES["tpu"].tpu_runtime and not PROFILES["cpu"].tpu_runtime
    assert PROFILES["cpu"].host_memory and not PROFILES["tpu"].host_memory


def test_unknown_backend_is_one_line_naming_the_known_ones():
    assert profile(" CPU ") is PROFILES["cpu"]
    with pytest.raises(BadInputError, match=r"--backend 'gpu' is unknown: choose one of tpu, cpu, cuda"):
        profile("gpu")


def test_a_missing_device_is_refused_by_its_profiles_check():
    import torch

    PROFILES["cpu"].check()  # always there
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here: the cuda profile's check passes")
    with pytest.raises(BadInputError, match="--backend cuda: no CUDA GPU visible"):
        PROFILES["cuda"].check()


def test_the_cpu_thread_default_gives_each_trainer_worker_its_cores():
    """``rl_tpu.num_threads=0`` on cpu: 2 threads for the one worker of the default job on 2 cores or more, fewer
    when the host's cores are shared by more trainer workers (a fake slice's ranks), never 0; a profile without a
    default leaves torch's own count (0)."""
    from verl_backend.driver.profiles import default_threads

    cap = PROFILES["cpu"].default_threads
    assert default_threads(cap, workers=1, cores=2) == 2
    assert default_threads(cap, workers=1, cores=64) == 2  # the cap: more was not measured to help
    assert default_threads(cap, workers=1, cores=1) == 1
    assert default_threads(cap, workers=4, cores=2) == 1  # the TPU dry run's 4 ranks on this machine
    assert default_threads(cap, workers=2, cores=4) == 2
    assert default_threads(PROFILES["tpu"].default_threads, workers=1, cores=8) == 0


def test_the_tpu_row_compiles_and_its_dry_run_compiles_as_torch_tpu_does(monkeypatch):
    """``--backend tpu`` turns both compile flags on (every eager op is a launch on a chip: docs/tpu.md); the TPU
    dry run is the tpu row's VeRL keys on CPU devices, with those flags on the ``tpu-on-cpu`` backend (TorchTPU's
    graphs on XLA:CPU) where torch-tpu is installed, and without them where it is not (inductor on CPU is not the
    TPU's compiler); the cpu row sets none."""
    from verl_backend import tpu_on_cpu
    from verl_backend.driver.profiles import TPU_MICRO_KEYS, tpu_dry_run

    assert dict(PROFILES["tpu"].settings) == {"compile_trainer": True, "compile_sampler": True}
    monkeypatch.setattr(tpu_on_cpu, "aot_python_path", lambda: "/venv-aot/bin/python")
    dry = tpu_dry_run(PROFILES["cpu"])
    assert dict(dry.settings) == {"compile_trainer": True, "compile_sampler": True, "compile_backend": "tpu-on-cpu"}
    monkeypatch.setattr(tpu_on_cpu, "aot_python_path", lambda: None)  # no torch-tpu: eager, as before
    dry = tpu_dry_run(PROFILES["cpu"])
    assert not dry.settings and not PROFILES["cpu"].settings
    assert all(dry.overrides[k] == "8" for k in TPU_MICRO_KEYS)  # the tpu row's VeRL keys, kept
