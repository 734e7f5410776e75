"""Device backend table, detection, thread setting, and TorchTPU on a machine without a chip.

TorchTPU checks run in subprocesses (its registration happens on ``import torch`` and a TPU runtime start without
a chip aborts the process). They need ``torch_tpu`` importable (``pip install rl-tpu[tpu]``) and skip otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rl_tpu.device import (
    BACKENDS,
    DeviceError,
    TPURuntimeConfig,
    apply_tpu_runtime,
    detect_backend,
    get_backend,
    require_tpu,
    set_num_threads,
    torch_tpu_installed,
    tpu_chip_available,
)

needs_torch_tpu = pytest.mark.skipif(
    not torch_tpu_installed(), reason="torch_tpu (TorchTPU) is not installed: pip install rl-tpu[tpu]"
)


def test_backend_table() -> None:
    assert set(BACKENDS) == {"tpu", "cpu", "cuda"}
    tpu, cpu, cuda = BACKENDS["tpu"], BACKENDS["cpu"], BACKENDS["cuda"]
    assert (tpu.torch_device, tpu.dist_backend, tpu.compile_backend, tpu.ray_resource) == (
        "tpu",
        "tpu_dist",
        "tpu",
        "TPU",
    )
    assert tpu.visible_devices_env == "TPU_VISIBLE_CHIPS"
    assert (cpu.torch_device, cpu.dist_backend, cpu.compile_backend, cpu.ray_resource) == (
        "cpu",
        "gloo",
        "inductor",
        None,
    )
    assert cpu.visible_devices_env is None
    assert (cuda.torch_device, cuda.dist_backend, cuda.ray_resource) == ("cuda", "nccl", "GPU")
    assert cuda.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    for name, b in BACKENDS.items():
        assert b.name == name
    torch.device(cpu.torch_device), torch.device(cuda.torch_device)  # "tpu" exists only once TorchTPU registers
    with pytest.raises(Exception):
        tpu.name = "x"  # frozen


def test_get_backend_by_name_and_unknown_name() -> None:
    assert get_backend("CPU") is BACKENDS["cpu"]
    assert get_backend(BACKENDS["tpu"]) is BACKENDS["tpu"]
    with pytest.raises(DeviceError, match=r"unknown backend 'xla': choose one of tpu, cpu, cuda") as e:
        get_backend("xla")
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_detect_backend_here_is_cpu() -> None:
    want = torch.accelerator.current_accelerator()
    assert detect_backend() is BACKENDS[want.type if want is not None else "cpu"]
    if want is None:
        assert detect_backend().name == "cpu"


def test_no_chip_here() -> None:
    tpu_chip_available.cache_clear()
    assert tpu_chip_available(timeout_s=300) is False
    with pytest.raises(DeviceError) as e:
        require_tpu()
    msg = str(e.value)
    assert "\n" not in msg and "no TPU chip" in msg and "--backend cpu" in msg
    assert ("pip install rl-tpu[tpu]" in msg) == (not torch_tpu_installed())


def test_tpu_runtime_config() -> None:
    assert TPURuntimeConfig().eager_mode_enum_name == "DEFER_NEVER"
    assert TPURuntimeConfig(eager_mode="debug").eager_mode_enum_name == "DEFER_NEVER_AND_LAUNCH_BLOCKING"
    assert TPURuntimeConfig(eager_mode="fused").eager_mode_enum_name == "DEFER_AND_FUSE"
    with pytest.raises(DeviceError, match="eager_mode 'lazy'.*strict, debug, fused"):
        TPURuntimeConfig(eager_mode="lazy")
    if not hasattr(torch, "tpu"):
        with pytest.raises(DeviceError, match="TorchTPU"):
            apply_tpu_runtime(TPURuntimeConfig())


def test_set_num_threads() -> None:
    before = torch.get_num_threads()
    try:
        assert set_num_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_num_threads(2) == 2 and torch.get_num_threads() == 2
        for bad in (0, -1, True, "2"):
            with pytest.raises(DeviceError, match="num_threads="):
                set_num_threads(bad)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ TorchTPU installed, no chip (subprocess)
def _run_with_torch_tpu(code: str, extra_env: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "TORCH_TPU_"))}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.update(TPU_SKIP_MDS_QUERY="1", PYTHONWARNINGS="ignore", **(extra_env or {}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_torch_tpu
def test_torch_tpu_registers_on_import_without_starting_a_chip() -> None:
    facts = _run_with_torch_tpu(
        """
        import json, torch
        from rl_tpu.device import BACKENDS, detect_backend, TPURuntimeConfig, apply_tpu_runtime
        out = {"has_tpu_module": hasattr(torch, "tpu"),
               "accelerator": str(torch.accelerator.current_accelerator()),
               "detected": detect_backend().name,
               "eager_modes": sorted(m for m in torch.tpu.EagerMode.__members__ if not m.startswith("_"))}
        apply_tpu_runtime(TPURuntimeConfig(eager_mode="fused"))
        out["applied"] = True
        print(json.dumps(out))
        """
    )
    assert facts["has_tpu_module"] is True
    assert facts["accelerator"] == "None" and facts["detected"] == "cpu"
    assert facts["eager_modes"] == ["DEFER_AND_FUSE", "DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING"]
    assert facts["applied"] is True


@needs_torch_tpu
def test_autoload_off_keeps_torch_tpu_out() -> None:
    facts = _run_with_torch_tpu(
        'import json, torch; print(json.dumps({"has_tpu_module": hasattr(torch, "tpu")}))',
        {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    assert facts["has_tpu_module"] is False


@needs_torch_tpu
def test_tpu_launch_env_with_fake_hosts() -> None:
    """Multi-host launch variables derived from TPU_WORKER_HOSTNAMES and JOB_COMPLETION_INDEX (pure Python)."""
    facts = _run_with_torch_tpu(
        """
        import json, os, torch
        torch.tpu.distributed.set_tpu_launch_env(nnodes=2, nproc_per_node=4)
        keys = ["NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCH_TPU_SLICEBUILDER_ADDRESSES"]
        out = {k: os.environ.get(k) for k in keys}
        try:
            torch.tpu.distributed.set_tpu_launch_env(nnodes=3)
            out["mismatch"] = None
        except ValueError as e:
            out["mismatch"] = str(e)
        print(json.dumps(out))
        """,
        {"TPU_WORKER_HOSTNAMES": "host-a,host-b", "JOB_COMPLETION_INDEX": "1", "TORCH_TPU_DEVICES_PER_HOST": "4"},
    )
    assert facts["NNODES"] == "2" and facts["NODE_RANK"] == "1"
    assert facts["MASTER_ADDR"] == "host-a" and facts["MASTER_PORT"] == "29500"
    assert facts["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",") == [
        f"{h}:{8070 + i}" for h in ("host-a", "host-b") for i in range(4)
    ]
    assert facts["mismatch"] and "TPU_WORKER_HOSTNAMES" in facts["mismatch"]


@needs_torch_tpu
def test_starting_the_runtime_without_a_chip_fails_in_the_child_only() -> None:
    """What the probe guards against: allocating on ``tpu`` with no chip fails (raises or aborts the process)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; torch.ones(1, device='tpu')"],
        env={**os.environ, "TPU_SKIP_MDS_QUERY": "1", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0
