"""The VeRL plugin as VeRL itself sees it: entry-point discovery, platforms, engine, rollout, patches.

Each check runs in a fresh interpreter: VeRL resolves its platform once per process from ``VERL_PLATFORM``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, platform: str | None = "cpu") -> dict:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("VERL_PLATFORM", None)
    if platform:
        env["VERL_PLATFORM"] = platform
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_verl_finds_plugin_through_entry_point_and_registers_everything():
    out = _run(
        """
        import json, verl
        from importlib.metadata import entry_points
        from verl.plugin.platform import get_platform
        from verl.plugin.platform.platform_manager import PlatformRegistry
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.rollout.base import get_rollout_class
        from verl.workers.rollout.replica import RolloutReplicaRegistry
        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
        p = get_platform()
        print(json.dumps({
            "eps": [e.value for e in entry_points(group="verl.plugins")],
            "platforms": list(PlatformRegistry.registered_names()),
            "platform": type(p).__name__, "device": get_device_name(), "dist": get_nccl_backend(),
            "engine": EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__,
            "critic_engine": EngineRegistry.get_engine_cls("value_model", "fsdp2").__name__,
            "rollout": get_rollout_class("native", "async").__name__,
            "replica": RolloutReplicaRegistry.get("native").__name__,
            "mem_free_total": list(get_torch_device().mem_get_info()),
            "cpu_opts": p.ray_resource_options(1 / 3),
        }))
        """
    )
    assert "verl_backend.workers.plugin" in out["eps"]
    assert {"cpu", "tpu"} <= set(out["platforms"])
    assert out["platform"] == "PlatformCPU" and out["device"] == "cpu" and out["dist"] == "gloo"
    assert out["engine"] == "RlTpuFSDPEngineWithLMHead"
    assert out["critic_engine"] == "RlTpuFSDPEngineWithValueHead"
    assert out["rollout"] == "NativeServerAdapter" and out["replica"] == "NativeReplica"
    free, total = out["mem_free_total"]
    assert 0 < free <= total
    assert out["cpu_opts"] == {"num_cpus": pytest.approx(1 / 3)}


def test_import_verl_stays_light_until_a_process_imports_the_engine():
    """The plugin imports no heavy VeRL module itself: VeRL's agent-loop, reward and TransferQueue processes only
    import ``verl`` and must not pay for the FSDP engine (~2,000 modules, ~190 MiB each)."""
    out = _run(
        """
        import json, sys, verl
        light = {m: m in sys.modules for m in ("verl.workers.engine.fsdp.transformer_impl", "torchao",
                                               "verl.workers.engine_workers", "verl.checkpoint_engine.base")}
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
        from verl.workers.engine.base import EngineRegistry
        import verl.workers.engine_workers as ew
        import verl.utils.distributed as vdist
        from verl_backend.patches import PATCHES
        from verl_backend.patches.record import is_marked

        # the patch records, found by their target (a removed or renamed one is missing here), checked by their own
        # `applied`, which looks for the mark rl-tpu's replacement carries
        init_pg = "verl.utils.distributed.initialize_global_process_group_ray"
        rebind = "verl.workers.engine_workers.initialize_global_process_group_ray"
        records = {p.target: p for p in PATCHES}
        fn = vdist.initialize_global_process_group_ray
        print(json.dumps({
            "light": light,
            "engine": EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__,
            "ckpt": CheckpointEngineRegistry.get("native").__name__,
            "records": [t in records for t in (init_pg, rebind)],
            "applied": [init_pg in records and records[init_pg].applied(vdist),
                        rebind in records and records[rebind].applied(ew)],
            "marked": is_marked(fn, init_pg) and fn.__wrapped__ is not fn,
            "rebound": ew.initialize_global_process_group_ray is fn,
        }))
        """
    )
    assert not any(out["light"].values()), out["light"]
    assert out["engine"] == "RlTpuFSDPEngineWithLMHead" and out["ckpt"] == "NativeCheckpointEngine"
    assert out["records"] == [True, True], "a patch record of the process-group init is gone"
    assert out["applied"] == [True, True] and out["marked"] and out["rebound"], out


def test_tpu_platform_registers_without_starting_libtpu_and_asks_whole_chips():
    out = _run(
        """
        import json, verl
        from verl_backend.workers.platforms import PlatformTPU
        p = PlatformTPU()
        print(json.dumps({"available": p.is_platform_available(use_smi_check=True), "device": p.device_name,
                          "dist": p.communication_backend_name(), "res": p.ray_resource_name(),
                          "opts": [p.ray_resource_options(x) for x in (1 / 3, 1, 4)],
                          "env": p.visible_devices_envvar()}))
        """,
        platform=None,
    )
    assert out["available"] is False  # no chip here, and the probe did not hang or abort
    assert out["device"] == "tpu" and out["dist"] == "tpu_dist" and out["res"] == "TPU"
    # Ray refuses fractional TPU: a 1/3 share becomes one whole chip.
    assert out["opts"] == [{"resources": {"TPU": 1}}, {"resources": {"TPU": 1}}, {"resources": {"TPU": 4}}]
    assert out["env"] == "TPU_VISIBLE_CHIPS"


def test_tpu_eager_mode_setting_maps_to_torch_tpu_enum_and_rejects_bad_values(monkeypatch):
    from rl_tpu.device import DeviceError
    from verl_backend import settings
    from verl_backend.workers.platforms import tpu_runtime_from_settings

    monkeypatch.setenv(settings.RECORD_ENV, settings.record(settings.RlTpuSettings(tpu_eager_mode="fused")))
    # the job's record, as the platform's set_device reads it and hands it down
    assert tpu_runtime_from_settings(settings.current().tpu_eager_mode).eager_mode_enum_name == "DEFER_AND_FUSE"
    assert tpu_runtime_from_settings("strict").eager_mode_enum_name == "DEFER_NEVER"
    assert tpu_runtime_from_settings("debug").eager_mode_enum_name == "DEFER_NEVER_AND_LAUNCH_BLOCKING"
    with pytest.raises(DeviceError, match="turbo"):
        tpu_runtime_from_settings("turbo")


def test_verls_per_sample_builder_warning_shows_once_per_process():
    """VeRL 0.9.1's agent loop warns "No model-specific Continuous Token builder ..." for every sample of a llama
    model (208 lines in the default job); after ``import verl`` it shows once, and a different message still shows."""
    out = _run(
        """
        import io, json, logging, verl
        from verl.utils.tokenizer import continuous_token_wiring as ctw
        stream = io.StringIO()
        logging.getLogger(ctw.__name__).addHandler(logging.StreamHandler(stream))
        families = [str(ctw.infer_continuous_token_model_family(hf_model_type="llama")) for _ in range(5)]
        ctw.infer_continuous_token_model_family(hf_model_type="mistral")
        print(json.dumps({"families": families, "lines": stream.getvalue().splitlines()}))
        """
    )
    assert len(set(out["families"])) == 1  # VeRL's behaviour is unchanged: the same builder every time
    assert len(out["lines"]) == 2, out["lines"]
    assert "model_type='llama'" in out["lines"][0] and "model_type='mistral'" in out["lines"][1]
