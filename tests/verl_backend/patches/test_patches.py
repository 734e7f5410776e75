"""Every rl-tpu patch (``verl_backend.patches``) is in place once its module is imported and changes what it should;
every record of a name read (VeRL's, Ray's) finds that name; every record of the project names its range, reason and
upstream (or the search that found none); a library outside a record's tested range is refused in one line.

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

from rl_tpu.patches.record import Patch, problems, searched
from verl_backend.errors import BadInputError
from verl_backend.patches import RECORDS, UnsupportedVersionError, check_versions

TARGETS = [p.target for p in RECORDS]


def _every_record() -> tuple[Patch, ...]:
    """Every touch-point record of the project: the worker side's, the FSDP2 and TorchTPU ones, rl_tpu's and
    edge_export's."""
    from edge_export import litert_patches
    from rl_tpu.patches import records
    from verl_backend.patches import fsdp2_internals, torch_tpu_aot

    return RECORDS + fsdp2_internals.RECORDS + torch_tpu_aot.PATCHES + records() + litert_patches.PATCHES


def _run(code: str, **env: str) -> dict:
    full = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "VERL_PLATFORM": "cpu", **env}
    for key in ("TQ_NUM_THREADS", "RL_TPU_SETTINGS"):
        if key not in env:
            full.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
        check=False,
    )
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
        from verl_backend.patches import RECORDS

        out = {"tq_before": tq_client.TQ_NUM_THREADS}
        os.environ["TQ_NUM_THREADS"] = "1"
        from verl_backend.patches.transfer_queue import apply_num_threads
        apply_num_threads()
        out["tq_after"] = tq_client.TQ_NUM_THREADS
        out["applied"] = {p.target: p.applied(importlib.import_module(p.module)) for p in RECORDS}

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
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
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
            # Ray's privates, read through rl_tpu.patches.ray_internals, on a running Ray
            from verl_backend.errors import BadInputError, record_bad_input, recorded_bad_input
            from rl_tpu.patches import ray_internals as ri

            @ray.remote(num_cpus=0)
            class Doomed:
                def ping(self):
                    return 1

            doomed = Doomed.remote()
            ray.get(doomed.ping.remote())
            ray.kill(doomed)
            import time
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                    a.get("ActorClassName") == "Doomed" and a.get("State") == "DEAD" """
        """for a in ri.actor_table().values()):
                time.sleep(0.2)
            dead = [a.get("DeathCause") is not None for a in ri.actor_table().values()
                    if a.get("ActorClassName") == "Doomed" and a.get("State") == "DEAD"]
            record_bad_input(BadInputError("first"))
            record_bad_input(BadInputError("second"))  # the first one is kept
            kv = [ri.kv_ready(), recorded_bad_input(), recorded_bad_input()]  # read once, then gone
        finally:
            ray.shutdown()
        print(json.dumps({"msg": msg, "original": original, "pools": pools, "dead": dead, "kv": kv}))
        """,
        RL_TPU_SETTINGS=settings_module.record(settings),
    )
    assert "has 8 CPU available but the resource pools need 10" in out["msg"]
    assert out["original"] == "Total available GPUs 0 is less than total desired GPUs 1"  # VeRL's, on CPU
    assert out["pools"] == ["SliceResourcePool", "RayResourcePool"]
    assert out["dead"] == [True]  # ray._private.state.actors(): the killed actor, dead, with its cause
    assert out["kv"] == [True, "first", None]  # internal_kv: put (kept), get, delete


def test_task_runner_runs_in_the_driver_through_the_undecorated_class():
    from verl.trainer.main_ppo import TaskRunnerV1

    from verl_backend.driver import runner
    from rl_tpu.patches.ray_internals import undecorated_class

    cls = undecorated_class(TaskRunnerV1)
    assert isinstance(cls, type) and cls.__name__ == "TaskRunnerV1" and callable(cls.run)
    assert type(runner.task_runner_class("driver")).__name__ == "_TaskRunnerInDriver"
    assert runner.task_runner_class("actor") is TaskRunnerV1
    assert undecorated_class(cls) is None  # a plain class: nothing under it


def test_verl_main_body_check_fails_when_verl_changes_it():
    """The negative control of the main-body record: a ``main`` whose body calls something else is not applied."""
    import types

    from verl_backend.patches import verl_internals as vi

    def main(config):
        auto_set_device(config)  # noqa: F821
        validate_config(config=config)  # noqa: F821
        run_ppo(config)  # noqa: F821

    def changed(config):
        auto_set_device(config)  # noqa: F821
        run_ppo(config)  # noqa: F821  (no validation: VeRL moved it)
        validate_config(config=config)  # noqa: F821

    assert vi.MAIN_BODY.applied(types.SimpleNamespace(main=main))
    assert not vi.MAIN_BODY.applied(types.SimpleNamespace(main=changed))


def test_engine_override_checks_fail_when_verl_changes_the_method():
    """Negative controls of the FSDPEngine records: a renamed parameter, a caller that stops calling it, a flag no
    longer set."""
    import types
    from contextlib import contextmanager

    from verl_backend.patches import verl_internals as vi

    class FSDPEngine:
        def __init__(self):
            self._is_lora = self._qat_enabled = self._is_offload_param = self._is_offload_optimizer = False

        def _build_model_optimizer(self):
            module = self._build_module()
            return self._build_fsdp_module(module)

        def _build_module(self):
            pass

        def _build_fsdp_module(self, module):
            self._autocast_dtype = self.scaler = None

        @contextmanager
        def _gradient_sync_context(self, *, is_last_micro_batch):
            yield

        def forward_backward_batch(self):
            with self._gradient_sync_context(is_last_micro_batch=True):
                pass

    fake = types.SimpleNamespace(FSDPEngine=FSDPEngine)
    records = (vi.ENGINE_BUILD, vi.ENGINE_FSDP, vi.ENGINE_GRAD_SYNC, vi.ENGINE_STATE)
    assert [r.applied(fake) for r in records] == [True, True, True, True]

    class Renamed(FSDPEngine):
        def _build_fsdp_module(self, model):  # VeRL renamed the parameter
            self._autocast_dtype = self.scaler = None

        def forward_backward_batch(self):  # and no longer defers the gradient sync
            pass

    class NoFlags(FSDPEngine):
        def __init__(self):
            self._is_lora = False

    assert [r.applied(types.SimpleNamespace(FSDPEngine=Renamed)) for r in records] == [True, False, False, True]
    assert vi.ENGINE_STATE.applied(types.SimpleNamespace(FSDPEngine=NoFlags)) is False


def test_engine_state_reads_verls_flags_and_unwrapped_precision_sets_its_attributes():
    import types

    import torch

    from verl_backend.patches.verl_internals import EngineState, engine_state, set_unwrapped_precision

    engine = types.SimpleNamespace(_is_lora=True, _qat_enabled=False, _is_offload_param=1, scaler=object())
    assert engine_state(engine) == EngineState(lora=True, qat=False, offload_param=True, offload_optimizer=False)
    set_unwrapped_precision(engine, torch.float32)
    assert engine._autocast_dtype is torch.float32 and engine.scaler is None


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


def test_every_record_names_its_range_reason_and_upstream():
    from rl_tpu.patches.record import installed_version

    every = _every_record()
    targets = [p.target for p in every]
    assert len(set(targets)) == len(targets)
    assert {p.library for p in every} >= {
        "verl",
        "TransferQueue",
        "ray",
        "torch",
        "transformers",
        "litert-torch",
        "torch-tpu",
    }
    for patch in every:
        assert problems(patch) == [], (patch.target, problems(patch))
        found = installed_version(patch.library)
        assert found is None or patch.supports(found), patch.target  # the installed one is the tested one


BAD_UPSTREAM = [
    "",
    "   ",
    None,
    "no upstream issue found",
    "https://example.com/bug/1",
    "see verl#6237",
    "none found",
    "none found: searched verl-project/verl issues for ''",
]


@pytest.mark.parametrize("upstream", BAD_UPSTREAM)
def test_a_record_without_an_upstream_is_refused(upstream):
    """The negative control of the check above: a record whose upstream is empty, missing or neither a GitHub issue
    or pull request nor the search that found none is refused."""
    good = RECORDS[0]
    bad = Patch(
        target=good.target,
        module=good.module,
        library=good.library,
        versions=good.versions,
        why=good.why,
        upstream=upstream,
        apply=good.apply,
        applied=good.applied,
    )
    assert any("upstream" in p for p in problems(bad)), problems(bad)


def test_a_complete_record_passes_and_each_field_is_checked():
    ok = dict(
        target="pkg.mod.name",
        module="pkg.mod",
        library="pkg",
        versions="==1.0",
        why="one line",
        upstream="https://github.com/owner/repo/issues/12",
        apply=None,
        applied=lambda m: True,
    )
    assert problems(Patch(**ok)) == []
    assert problems(Patch(**{**ok, "upstream": searched("owner/repo", "a query", "a note")})) == []
    assert problems(Patch(**{**ok, "upstream": "https://github.com/owner/repo/pull/7 (fixed in 2.0)"})) == []
    for field, value, found in [
        ("target", "", "no target"),
        ("library", " ", "no library"),
        ("versions", "", "no version range"),
        ("why", "two\nlines", "why is not"),
        ("why", "", "why is not"),
    ]:
        assert any(p.startswith(found) for p in problems(Patch(**{**ok, field: value}))), (field, value)


def test_installed_versions_pass():
    check_versions()  # would raise for an untested VeRL or TransferQueue
    check_versions({"verl": "0.9.1", "TransferQueue": "0.1.11", "ray": "2.60.0"})


@pytest.mark.parametrize(
    "installed, line",
    [
        (
            {"verl": "0.9.2", "TransferQueue": "0.1.11"},
            (
                "verl 0.9.2 is outside the tested range ==0.9.1 of rl-tpu's patch "
                "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install verl==0.9.1"
            ),
        ),
        (
            {"verl": "0.9.1", "TransferQueue": "0.2.0"},
            (
                "TransferQueue 0.2.0 is outside the tested range ==0.1.11 of rl-tpu's patch "
                "transfer_queue.client.TQ_NUM_THREADS; install TransferQueue==0.1.11"
            ),
        ),
        (
            {"verl": "0.9.1", "TransferQueue": "0.1.11", "ray": "2.61.0"},
            (
                "ray 2.61.0 is outside the tested range <2.61,>=2.60 of rl-tpu's patch ray._private.state.actors; "
                'install "ray<2.61,>=2.60"'
            ),
        ),
        (
            {"verl": "not-a-version", "TransferQueue": None},
            (
                "verl not-a-version is outside the tested range ==0.9.1 of rl-tpu's patch "
                "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install verl==0.9.1"
            ),
        ),
    ],
)
def test_version_outside_the_tested_range_is_refused_in_one_line(installed, line):
    with pytest.raises(UnsupportedVersionError) as info:
        check_versions(installed)
    assert str(info.value) == line
    assert isinstance(info.value, BadInputError)  # the CLI prints it as one line, exit 2


def test_a_library_that_is_not_installed_is_not_checked():
    check_versions({"verl": "0.9.1", "TransferQueue": None})


def test_verl_train_refuses_an_untested_verl_before_running(monkeypatch, capsys):
    from rl_tpu.patches import record
    from verl_backend import patches
    from verl_backend.driver import cli

    monkeypatch.setattr(record, "installed_version", lambda lib: "0.9.2" if lib == "verl" else None)
    monkeypatch.setattr(patches, "_checked", False)
    assert cli.main(["train", "--backend", "cpu", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        (
            "verl: error: verl 0.9.2 is outside the tested range ==0.9.1 of rl-tpu's patch "
            "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install "
            "verl==0.9.1"
        )
    ]


def test_plugin_refuses_an_untested_verl_in_one_line_and_registers_nothing():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
            import json
            from rl_tpu.patches import record
            record.installed_version = lambda lib: "0.9.2" if lib == "verl" else None
            import verl
            from verl.plugin.platform.platform_manager import PlatformRegistry
            print(json.dumps({"platforms": list(PlatformRegistry.registered_names())}))
            """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "VERL_PLATFORM": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu" not in json.loads(proc.stdout.strip().splitlines()[-1])["platforms"]
    assert "Traceback" not in proc.stderr
    ours = [line for line in proc.stderr.splitlines() if "outside the tested range" in line]
    assert len(ours) == 1 and ours[0].endswith(
        "rl-tpu: verl 0.9.2 is outside the tested range ==0.9.1 of rl-tpu's patch "
        "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available; install verl==0.9.1"
    )


def test_save_checkpoint_record_fails_when_verl_changes_the_save():
    import types

    from verl_backend.patches import verl_internals as vi

    class PPOTrainer:
        def _save_checkpoint(self):
            return f"global_step_{self.global_steps}"

    class TakesStep:
        def _save_checkpoint(self, step):  # VeRL passed the step instead of reading global_steps
            return f"global_step_{step}"

    assert vi.SAVE_CHECKPOINT.applied(types.SimpleNamespace(PPOTrainer=PPOTrainer))
    assert not vi.SAVE_CHECKPOINT.applied(types.SimpleNamespace(PPOTrainer=TakesStep))
    saved = types.SimpleNamespace(global_steps=3, _save_checkpoint=lambda: saved.calls.append(3), calls=[])
    vi.save_checkpoint(saved)
    assert saved.calls == [3]


def test_replica_server_record_fails_when_verl_renames_the_fields():
    import types

    from verl_backend.patches import verl_internals as vi

    class RolloutReplica:
        @property
        def server_handle(self):
            return self._server_handle

        @property
        def server_address(self):
            return self._server_address

    class Renamed:  # VeRL keeps the properties but stores the server elsewhere
        @property
        def server_handle(self):
            return self._servers[0]

        @property
        def server_address(self):
            return self._server_address

    assert vi.REPLICA_SERVER.applied(types.SimpleNamespace(RolloutReplica=RolloutReplica))
    assert not vi.REPLICA_SERVER.applied(types.SimpleNamespace(RolloutReplica=Renamed))
    replica = RolloutReplica()
    vi.set_replica_server(replica, "actor", "native://1.2.3.4/replica-0")
    assert (replica.server_handle, replica.server_address) == ("actor", "native://1.2.3.4/replica-0")


def test_the_features_two_patches_run_come_from_the_plugin(monkeypatch):
    """patches/ imports nothing of the workers above it (issue #46): the slice pools and the step-boundary stop that
    two VeRL patches run are handed over by the plugin; a patched method run without them says so in one line."""
    from verl_backend.patches import verl as verl_patches
    from verl_backend.workers import plugin

    assert verl_patches.FEATURES == {
        "resource_pools": plugin._place_pools_on_slices,
        "step_begin": plugin._at_step_begin,
    }
    monkeypatch.setattr(verl_patches, "FEATURES", {})
    with pytest.raises(RuntimeError, match="feature 'step_begin', which the plugin did not hand over"):
        verl_patches._step_begin_hook(lambda trainer: None)(object())


class _Trainer:
    """The two things of VeRL's ``PPOTrainer`` the bounded refill reads: its config and its step."""

    def __init__(self, max_num_gen_batches: int):
        from omegaconf import OmegaConf

        self.config = OmegaConf.create(
            {
                "algorithm": {"filter_groups": {"max_num_gen_batches": max_num_gen_batches}},
                "data": {"train_batch_size": 4},
            }
        )
        self.global_steps = 1
        self.submitted: list[int] = []

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        self.submitted.append(num_prompts)
        return num_prompts


def _dapo_buffer(trainer: _Trainer, init=None, filter_metric: str = "reward"):
    """VeRL's sync replay buffer with DAPO's filter on and ``trainer``'s refill, built by ``init`` (default: the
    patched ``ReplayBuffer.__init__``)."""
    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    buffer = ReplayBuffer.__new__(ReplayBuffer)
    (init or ReplayBuffer.__init__)(
        buffer,
        "sync",
        OmegaConf.create({}),
        None,
        "drop",
        OmegaConf.create({}),
        refill_fn=trainer._add_prompts_to_generate,
        filter_groups_metric=filter_metric,
        train_batch_size=4,
        gen_batch_size=1,
    )
    return buffer


def test_dapo_refill_is_bounded_by_max_num_gen_batches_which_v1_ignores():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from verl_backend.errors import BadInputError

    trainer = _Trainer(max_num_gen_batches=3)  # 3 batches of 4 prompts a step: the first and 8 refilled
    buffer = _dapo_buffer(trainer)
    assert buffer.refill_fn(4) == 4 and buffer.refill_fn(4) == 4
    with pytest.raises(BadInputError, match=r"max_num_gen_batches=3: step 1 .*algorithm.filter_groups.enable=false"):
        buffer.refill_fn(1)
    assert trainer.submitted == [4, 4]  # the refill past the bound is not dispatched
    trainer.global_steps = 2  # the count is per step
    assert buffer.refill_fn(8) == 8

    unbounded = _Trainer(max_num_gen_batches=0)  # VeRL's default: no bound, VeRL's own function
    assert _dapo_buffer(unbounded).refill_fn == unbounded._add_prompts_to_generate
    plain = _dapo_buffer(_Trainer(3), init=ReplayBuffer.__init__.__wrapped__)  # negative control: VeRL's own
    assert plain.refill_fn(100) == 100  # __init__ leaves the refill unbounded


def test_dapo_sample_counts_every_group_graded_and_verls_aggregator_adds_them_up():
    """Under DAPO on the reward the patched buffer's ``sample`` adds the groups trained on, the groups replaced and
    their scores (which VeRL hands only to a wandb table); VeRL's own ``MetricsAggregator`` sums them over a step's
    sampling rounds, by their names. Control: filtering on another metric leaves ``sample`` VeRL's own."""
    from verl.trainer.ppo.v1.replay_buffer import DAPO_FILTERED_REWARD_COUNTS_KEY
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    from verl_backend.driver.report import graded_reward
    from verl_backend.patches import verl as verl_patches

    rounds = iter([{DAPO_FILTERED_REWARD_COUNTS_KEY: {1.0: 3, 0.0: 2}}, {}, {}])  # 3 groups all right, 2 all wrong

    def sample(global_steps, partition_id, batch_size):
        return "batch", dict(next(rounds))

    counting = verl_patches.graded_group_metrics(sample, DAPO_FILTERED_REWARD_COUNTS_KEY)
    aggregator = MetricsAggregator()
    for _ in range(2):  # two sampling rounds of 2 groups each (trainer.parameter_sync_step=2)
        batch, metrics = counting(global_steps=1, partition_id="train", batch_size=2)
        assert batch == "batch"
        metrics.pop(DAPO_FILTERED_REWARD_COUNTS_KEY, None)
        aggregator.add_step_metrics(metrics, sample_count=16)
    step = aggregator.get_aggregated_metrics()
    assert step[verl_patches.KEPT_GROUPS_KEY] == 4 and step[verl_patches.REPLACED_GROUPS_KEY] == 5
    assert step[verl_patches.REPLACED_SCORE_SUM_KEY] == 3.0
    # the 4 groups trained on averaged 0.5: (4 * 0.5 + 3) / 9 over all 9 groups graded
    assert graded_reward(dict(step, **{"critic/score/mean": 0.5})) == (pytest.approx(5 / 9), 9)
    assert graded_reward({"critic/score/mean": 0.5}) is None  # DAPO off
    assert counting(global_steps=1, partition_id="val", batch_size=2) == ("batch", {})  # validation: nothing added

    buffer = _dapo_buffer(_Trainer(3))
    assert buffer.sample.__name__ == "sample_counting"
    on_acc = _dapo_buffer(_Trainer(3), filter_metric="acc")  # control: the metric is not the reward
    assert on_acc.sample.__func__.__qualname__.endswith("ReplayBuffer.sample")
