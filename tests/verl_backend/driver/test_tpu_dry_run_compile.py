"""The TPU dry run's compile check (``--tpu-dry-run``, ``rl_tpu.tpu_dry_run_compile``,
``verl_backend/driver/aot/dry_run.py``): the run's (graph, input shapes) list equals ``--aot-only``'s for the same
job, and the check's outcomes (compiled, skipped without torch-tpu, failed, off) are one line each, never a failure
of the training run. The lowering itself runs once here on a tiny model (skipped without ``.venv-aot``); the e2e dry
run (``test_tpu_dry_run.py``, slow) checks the wiring in ``verl train``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_backend.driver.aot import run as aot_run
from verl_backend.driver.aot.dry_run import SKIPPED_NO_TORCH_TPU, DryRunCompile, compile_line, record
from verl_backend.driver.aot.graphs import graph_list, graph_list_differences

# the e2e dry run's job (test_tpu_dry_run.py), its micro batches left to fit_default_micro_batches (4 workers)
JOB = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.max_response_length=16",
]


def _composed(monkeypatch, tmp_path: Path, argv: list[str], where: str):
    """The config ``verl train argv`` composes, caught where that path hands it on (``where``: ``aot`` is
    ``--aot-only``'s run_aot_only, ``plan`` is ``--print-config``'s memory plan); nothing runs."""
    from verl_backend.driver.cli import main

    caught = {}
    if where == "aot":
        import verl_backend.driver.aot.job as job

        def fake(config, slice_name, model_path=None, all_buckets=False):
            caught.update(config=config, slice=slice_name, model_path=model_path, all_buckets=all_buckets)
            return 0

        monkeypatch.setattr(job, "run_aot_only", fake)
    else:
        import verl_backend.driver.train as train

        monkeypatch.setattr(
            train,
            "show_memory_plan",
            lambda config, slice_name, backend: caught.update(config=config, slice=slice_name),
        )
    assert main(["train", *argv, "--output-dir", str(tmp_path)]) == 0
    return caught


def test_the_dry_runs_graph_list_is_aot_onlys_and_a_missing_bucket_is_found(monkeypatch, tmp_path, tiny_model_dir):
    from verl_backend.driver.aot.job import aot_jobs
    from verl_backend.driver.job_shape import job_shape
    from verl_backend.driver.profiles import PROFILES

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = f"actor_rollout_ref.model.path={tiny_model_dir}"
    # the dry run's job is the embedded default config's (--backend cpu's): --aot-only is given it as --config
    default = str(PROFILES["cpu"].default_config)
    aot = _composed(
        monkeypatch,
        tmp_path / "aot",
        ["--backend", "tpu", "--aot-only", "--slice", "v6e-4", "--config", default, model, *JOB],
        "aot",
    )
    dry = _composed(
        monkeypatch, tmp_path / "dry", ["--backend", "cpu", "--tpu-dry-run", "--print-config", model, *JOB], "plan"
    )
    assert aot["slice"] == dry["slice"] == "v6e-4:2x2"
    # what the dry run records (DryRunCompile.start writes aot/graphs.json before anything else)
    DryRunCompile(dry["config"], dry["slice"], tmp_path / "run", enabled=False).start()
    recorded = json.loads((tmp_path / "run" / "aot" / "graphs.json").read_text())
    assert recorded == graph_list(dry["config"])
    # what --aot-only lowers for the same job: the graphs of its lowering subprocess's jobs
    lowered = [g for j in aot_jobs(job_shape(aot["config"]), model_path=aot["model_path"]) for g in j["graphs"]]
    assert len(lowered) == len(recorded) >= 4
    assert graph_list_differences(recorded, lowered) == []
    # the update, the no-grad log-prob forward (old policy recomputed, KL loss's reference), the sampler
    assert {g["kind"] for g in recorded} == {
        "block",
        "lm_head",
        "block_forward",
        "lm_head_forward",
        "prefill",
        "decode",
    }
    # negative control: one of --aot-only's decode buckets left out is reported, naming it
    decodes = [i for i, g in enumerate(lowered) if g["kind"] == "decode"]
    assert decodes
    fewer = lowered[: decodes[-1]] + lowered[decodes[-1] + 1 :]
    assert graph_list_differences(recorded, fewer) == [f"only in the first list: {recorded[decodes[-1]]['graph']}"]
    # and at other shapes, and in another order
    bigger = [dict(g, batch=g["batch"] * 2) if g["kind"] == "prefill" else g for g in lowered]
    assert any(
        line.startswith("only in the second list: sampler.prefill[")
        for line in graph_list_differences(recorded, bigger)
    )
    assert graph_list_differences(recorded, lowered[::-1]) == ["the same graphs in another order"]


CONFIG = {
    "actor_rollout_ref": {
        "model": {"path": None},
        "actor": {"ppo_micro_batch_size_per_gpu": 1},
        "rollout": {"n": 2, "max_num_seqs": 64, "prompt_length": 16, "response_length": 16},
    },
    "data": {"train_batch_size": 2, "max_prompt_length": 16, "max_response_length": 16},
    "trainer": {"n_gpus_per_node": 4, "nnodes": 1},
}


@pytest.fixture
def config(tiny_model_dir):
    import copy

    c = copy.deepcopy(CONFIG)
    c["actor_rollout_ref"]["model"]["path"] = str(tiny_model_dir)
    return c


def test_without_torch_tpu_the_check_is_skipped_in_one_line(monkeypatch, tmp_path, config):
    import verl_backend.driver.aot.dry_run as dry_run

    def missing():
        raise aot_run.AotError("no torch-tpu")

    monkeypatch.setattr(dry_run, "aot_python", missing)
    check = DryRunCompile(config, "v6e-4:2x2", tmp_path).start()
    assert not check.running
    entry = check.finish()
    assert entry["status"] == "skipped" and entry["line"] == SKIPPED_NO_TORCH_TPU
    assert compile_line(entry) == "[rl-tpu] TPU compile check: skipped: torch-tpu not installed (.ci/aot_venv)"
    assert json.loads((tmp_path / "aot" / "graphs.json").read_text()) == graph_list(config)  # recorded anyway


def test_off_records_the_graph_list_only(tmp_path, config):
    entry = DryRunCompile(config, "v6e-4:2x2", tmp_path, enabled=False).start().finish()
    assert entry["status"] == "off" and "rl_tpu.tpu_dry_run_compile=false" in entry["line"]
    assert (tmp_path / "aot" / "graphs.json").is_file() and not (tmp_path / "aot" / "spec.json").exists()


def test_a_lowering_that_crashes_is_one_line_and_the_summary_keeps_its_keys(tmp_path, config):
    (tmp_path / "summary.json").write_text(json.dumps({"training_steps": 2}))
    entry = DryRunCompile(config, "v6e-4:2x2", tmp_path, python="/bin/false").start().finish(timeout_s=60)
    assert entry["status"] == "failed" and "\n" not in entry["line"]
    assert entry["line"].startswith("failed: TorchTPU's lowering (subprocess) exited with code 1")
    record(tmp_path, entry)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["training_steps"] == 2 and summary["tpu_compile"]["status"] == "failed"


def test_the_check_lowers_and_compiles_the_recorded_graphs_for_the_fake_slice(tmp_path, config):
    try:
        python = aot_run.aot_python()
    except aot_run.AotError as exc:
        pytest.skip(f"torch-tpu is not installed: {exc}")
    check = DryRunCompile(config, "v6e-4:2x2", tmp_path, python=python).start()
    assert check.running  # in the background: the caller trains meanwhile
    entry = check.finish(timeout_s=900)
    print(compile_line(entry))
    assert entry["status"] == "compiled", entry["line"]
    assert entry["topology"] == "v6e:2x2" and entry["errors"] == []
    recorded = json.loads((tmp_path / "aot" / "graphs.json").read_text())
    lowered = json.loads((tmp_path / "aot" / "lowered.json").read_text())
    # block and lm_head are a forward and a backward graph each
    assert entry["compiled"] == len(lowered) == len(recorded) + 2
    assert {r["graph"].rsplit(".", 1)[0] if r["graph"].endswith((".fwd", ".bwd")) else r["graph"] for r in lowered} == {
        g["graph"] for g in recorded
    }
    assert entry["hbm_bytes"] == 32 * 2**30
    assert 0 < entry["per_chip"]["training_peak"] < entry["hbm_bytes"]
    assert 0 < entry["per_chip"]["largest_sampler_graph"] < entry["hbm_bytes"]
    assert entry["line"].startswith(
        f"{entry['compiled']} of {entry['compiled']} graphs lowered by TorchTPU and "
        "compiled by libtpu for v6e-4:2x2 (v6e:2x2), no chip; per chip: training "
    )
