"""Every rl-tpu patch (``verl_backend.patches``) is in place once its module is imported and changes what it should;
a library outside a patch's tested range is refused in one line.

The checks that need VeRL's platform (chosen once per process from ``VERL_PLATFORM``), its FSDP engine or a Ray
cluster run in a fresh interpreter; the rest run here on the real libraries.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from verl_backend.errors import BadInputError
from verl_backend.patches import PATCHES, UnsupportedVersionError, check_versions

TARGETS = [p.target for p in PATCHES]


def _run(code: str, **env: str) -> dict:
    full = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "VERL_PLATFORM": "cpu", **env}
    for key in ("TQ_NUM_THREADS", "RL_TPU_SETTINGS"):
        if key not in env:
            full.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def on_cpu_platform() -> dict:
    """One CPU-platform process: every patch's ``applied`` after importing its module, and what the patched and the
    original functions do (process group init, reference-model offload policy, step hook, TransferQueue threads,
    rollout registration)."""
    return _run(
        """
        import importlib, json, os, sys, types
        import transfer_queue.client as tq_client  # imported before $TQ_NUM_THREADS is set, as in the driver
        import verl
        from verl_backend.patches import PATCHES

        out = {"tq_before": tq_client.TQ_NUM_THREADS}
        os.environ["TQ_NUM_THREADS"] = "1"
        from verl_backend.patches.transfer_queue import apply_num_threads
        apply_num_threads()
        out["tq_after"] = tq_client.TQ_NUM_THREADS
        out["applied"] = {p.target: p.applied(importlib.import_module(p.module)) for p in PATCHES}

        import torch.distributed as dist
        import verl.checkpoint_engine.base as ckpt
        import verl.utils.distributed as vdist
        import verl.workers.engine_workers as ew
        out["rebound"] = [m.initialize_global_process_group_ray is vdist.initialize_global_process_group_ray
                          for m in (ew, ckpt)]
        try:
            vdist.initialize_global_process_group_ray.__wrapped__(backend="cpu:gloo,cpu:gloo")
            out["init_original"] = "initialized"
        except Exception as e:
            out["init_original"] = f"{type(e).__name__}: {e}"
        vdist.initialize_global_process_group_ray(backend="cpu:gloo,cpu:gloo")
        out["init_patched"] = [dist.is_initialized(), dist.get_world_size()]
        dist.destroy_process_group()

        import verl.workers.engine.fsdp.transformer_impl as ti
        out["pin"] = [ti.CPUOffloadPolicy(pin_memory=True).pin_memory,
                      ti.CPUOffloadPolicy.__wrapped__(pin_memory=True).pin_memory]

        from verl.trainer.ppo.v1.trainer_base import PPOTrainer
        from verl_backend.workers import preemption
        trainer = types.SimpleNamespace(global_steps=1)
        out["hook_original"] = repr(PPOTrainer.on_step_begin.__wrapped__(trainer))
        preemption._REQUESTED.set()  # as after a SIGTERM
        try:
            PPOTrainer.on_step_begin(trainer); out["hook_patched"] = "returned"
        except preemption.Terminated as e:
            out["hook_patched"] = f"Terminated(step={e.step})"

        from verl.workers.rollout.base import get_rollout_class
        out["rollout"] = get_rollout_class("native", "async").__name__

        # separate_async's DetachActorWorker: save pi_old, update in place (an optimizer step), restore
        import torch
        import verl.utils.fsdp_utils as fu
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        def pi_old_kept(save, load, model):
            full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            with torch.no_grad():
                before = {n: full(p) for n, p in model.named_parameters()}
                saved = save(model)
                for p in model.parameters():
                    p.add_(1.0)
                load(model, *saved)
                return all(torch.equal(before[n], full(p)) for n, p in model.named_parameters())

        plain = torch.nn.Linear(4, 3)
        out["plain_patched"] = pi_old_kept(fu.fsdp2_sharded_save_to_cpu, fu.fsdp2_sharded_load_from_cpu, plain)
        try:
            fu.fsdp2_sharded_save_to_cpu.__wrapped__(plain)
            out["plain_original"] = "saved"
        except AssertionError:
            out["plain_original"] = "AssertionError"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        sharded = fully_shard(torch.nn.Linear(4, 3), mesh=init_device_mesh("cpu", (1,)))
        out["fsdp2_original"] = pi_old_kept(fu.fsdp2_sharded_save_to_cpu.__wrapped__,
                                            fu.fsdp2_sharded_load_from_cpu.__wrapped__, sharded)
        out["fsdp2_patched"] = pi_old_kept(fu.fsdp2_sharded_save_to_cpu, fu.fsdp2_sharded_load_from_cpu, sharded)
        dist.destroy_process_group()
        print(json.dumps(out))
        """,
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
    )


@pytest.mark.parametrize("target", TARGETS)
def test_patch_is_in_place_once_its_module_is_imported(on_cpu_platform, target):
    assert on_cpu_platform["applied"][target] is True


def test_process_group_init_dedupes_the_cpu_backend_everywhere_verl_imported_it(on_cpu_platform):
    from verl_backend.patches.verl import _dedupe_backend

    assert _dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert _dedupe_backend("cpu:gloo,tpu:tpu_dist") == "cpu:gloo,tpu:tpu_dist"
    assert "Duplicate device type cpu" in on_cpu_platform["init_original"]  # what VeRL 0.9.1 does on CPU
    assert on_cpu_platform["init_patched"] == [True, 1]
    assert on_cpu_platform["rebound"] == [True, True]


def test_reference_model_offload_drops_pinning_on_cpu(on_cpu_platform):
    assert on_cpu_platform["pin"] == [False, True]


def test_step_hook_ends_a_sigtermed_run_at_the_step_boundary(on_cpu_platform):
    assert on_cpu_platform["hook_original"] == "None"
    assert on_cpu_platform["hook_patched"] == "Terminated(step=None)"  # no step completed yet


def test_transfer_queue_takes_the_thread_cap_set_after_its_import(on_cpu_platform):
    assert on_cpu_platform["tq_before"] == 8 and on_cpu_platform["tq_after"] == 1


def test_native_rollout_is_in_verls_rollout_table(on_cpu_platform):
    assert on_cpu_platform["rollout"] == "NativeServerAdapter"


def test_detached_actor_keeps_pi_old_on_cpu_for_sharded_and_plain_modules(on_cpu_platform):
    # VeRL 0.9.1's save aliases a CPU shard (.cpu() is a no-op), so pi_old moved with the update: the negative control
    assert on_cpu_platform["fsdp2_original"] is False
    assert on_cpu_platform["fsdp2_patched"] is True
    assert on_cpu_platform["plain_original"] == "AssertionError"  # rl_tpu.plain_module: no DTensor parameters
    assert on_cpu_platform["plain_patched"] is True


def test_resource_check_counts_cpus_and_slice_pool_replaces_verls(job_settings):
    settings = job_settings(slice="v4-16")  # 2 hosts x 4 chips
    from verl_backend import settings as settings_module

    out = _run(
        """
        import json, ray, verl
        from verl.single_controller.ray.base import ResourcePoolManager
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            ResourcePoolManager({"global_pool": [1]}, mapping={})._check_resource_available()
            too_big = ResourcePoolManager({"global_pool": [5, 5]}, mapping={})
            try:
                too_big._check_resource_available(); msg = None
            except ValueError as e:
                msg = str(e)
            try:
                ResourcePoolManager._check_resource_available.__wrapped__(
                    ResourcePoolManager({"global_pool": [1]}, mapping={})); original = None
            except ValueError as e:
                original = str(e)
            pools = []
            for create in (ResourcePoolManager.create_resource_pool,
                           ResourcePoolManager.create_resource_pool.__wrapped__):
                mgr = ResourcePoolManager({"global_pool": [4, 4]}, mapping={"actor": "global_pool"})
                create(mgr)
                pools.append(type(mgr.get_resource_pool("actor")).__name__)
        finally:
            ray.shutdown()
        print(json.dumps({"msg": msg, "original": original, "pools": pools}))
        """,
        RL_TPU_SETTINGS=settings_module.record(settings),
    )
    assert "has 8 CPU available but the resource pools need 10" in out["msg"]
    assert out["original"] == "Total available GPUs 0 is less than total desired GPUs 1"  # VeRL's, on CPU
    assert out["pools"] == ["SliceResourcePool", "RayResourcePool"]


def test_metrics_file_is_appended_not_truncated(tmp_path, monkeypatch):
    import verl  # noqa: F401  (the plugin applies the patches)
    from verl.utils import tracking

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    for step in (1, 2):  # a run, then the run resumed after a crash
        logger = tracking.FileLogger("project", "experiment")
        logger.log({"x": step}, step)
        logger.finish()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    with tracking.open(path, "wb"):  # the one name FileLogger calls, as VeRL's module sees it
        pass
    assert path.read_text().count("\n") == 2
    with tracking.open(path, "w"):  # other modes are untouched
        pass
    assert path.read_text() == ""


def test_trl_without_value_head_class_is_not_available(tmp_path, monkeypatch):
    """TRL 1.x: ``trl`` importable, ``AutoModelForCausalLMWithValueHead`` gone (a package with neither path)."""
    import verl  # noqa: F401
    import verl.utils.model as model_utils
    from verl.models.transformers import monkey_patch

    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trl", raising=False)
    try:
        assert model_utils.is_trl_available.__wrapped__() is True  # VeRL's own check: importable is enough
        assert model_utils.is_trl_available() is False
        assert monkey_patch.is_trl_available() is False
    finally:
        sys.modules.pop("trl", None)


def test_critic_loads_without_flash_attn(tiny_model_dir):
    import importlib.util

    import torch
    import verl  # noqa: F401
    import verl.utils.model as model_utils
    from transformers import AutoConfig

    assert importlib.util.find_spec("flash_attn") is None, "this check is for a machine without flash-attn"
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1, attn_implementation="sdpa")
    critic = model_utils.load_valuehead_model(str(tiny_model_dir), torch.float32, config, False)
    assert type(critic).__name__ == "LlamaForTokenClassification"
    assert critic.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="not a value head model"):  # VeRL's: flash_attention_2, then TRL
        model_utils.load_valuehead_model.__wrapped__(str(tiny_model_dir), torch.float32, config, False)


def test_replay_buffer_polls_every_fifth_of_a_second():
    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from verl_backend.patches.verl import REPLAY_POLL_S

    buffer = ReplayBuffer("sync", OmegaConf.create({}), None, "drop", OmegaConf.create({}))
    assert buffer.poll_interval == REPLAY_POLL_S == 0.2
    plain = ReplayBuffer.__new__(ReplayBuffer)
    ReplayBuffer.__init__.__wrapped__(plain, "sync", OmegaConf.create({}), None, "drop", OmegaConf.create({}))
    assert plain.poll_interval == 2.0  # VeRL's hard-coded default


def test_every_patch_names_its_range_reason_and_upstream():
    from importlib.metadata import version

    assert len(set(TARGETS)) == len(TARGETS)
    for patch in PATCHES:
        assert patch.supports(version(patch.library)), patch.target  # the installed one is the tested one
        assert patch.why and "\n" not in patch.why, patch.target
        assert patch.upstream is None or patch.upstream.startswith("https://github.com/"), patch.target


def test_installed_versions_pass():
    check_versions()  # would raise for an untested VeRL or TransferQueue
    check_versions({"verl": "0.9.1", "TransferQueue": "0.1.11"})


@pytest.mark.parametrize("installed, line", [
    ({"verl": "0.9.2", "TransferQueue": "0.1.11"},
     ("verl 0.9.2 is outside the tested range ==0.9.1 of rl-tpu's patch "
      "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install verl==0.9.1")),
    ({"verl": "0.9.1", "TransferQueue": "0.2.0"},
     ("TransferQueue 0.2.0 is outside the tested range ==0.1.11 of rl-tpu's patch "
      "transfer_queue.client.TQ_NUM_THREADS; install TransferQueue==0.1.11")),
    ({"verl": "not-a-version", "TransferQueue": None},
     ("verl not-a-version is outside the tested range ==0.9.1 of rl-tpu's patch "
      "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install verl==0.9.1")),
])
def test_version_outside_the_tested_range_is_refused_in_one_line(installed, line):
    with pytest.raises(UnsupportedVersionError) as info:
        check_versions(installed)
    assert str(info.value) == line
    assert isinstance(info.value, BadInputError)  # the CLI prints it as one line, exit 2


def test_a_library_that_is_not_installed_is_not_checked():
    check_versions({"verl": "0.9.1", "TransferQueue": None})


def test_verl_train_refuses_an_untested_verl_before_running(monkeypatch, capsys):
    from verl_backend import patches
    from verl_backend.driver import cli
    from verl_backend.patches import record

    monkeypatch.setattr(record, "installed_version", lambda lib: "0.9.2" if lib == "verl" else "0.1.11")
    monkeypatch.setattr(patches, "_checked", False)
    assert cli.main(["train", "--backend", "cpu", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("verl: error: verl 0.9.2 is outside the tested range ==0.9.1 of rl-tpu's patch "
                    "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install "
                    "verl==0.9.1")]


def test_plugin_refuses_an_untested_verl_in_one_line_and_registers_nothing():
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(
            """
            import json
            from verl_backend.patches import record
            record.installed_version = lambda lib: "0.9.2" if lib == "verl" else "0.1.11"
            import verl
            from verl.plugin.platform.platform_manager import PlatformRegistry
            print(json.dumps({"platforms": list(PlatformRegistry.registered_names())}))
            """)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "VERL_PLATFORM": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu" not in json.loads(proc.stdout.strip().splitlines()[-1])["platforms"]
    assert "Traceback" not in proc.stderr
    ours = [line for line in proc.stderr.splitlines() if "outside the tested range" in line]
    assert len(ours) == 1 and ours[0].endswith(
        "rl-tpu: verl 0.9.2 is outside the tested range ==0.9.1 of rl-tpu's patch "
        "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install verl==0.9.1")
