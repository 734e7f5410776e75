"""``rl_tpu.export`` (``verl train --export``): what is refused before training, the held-out items and scorer
handed to ``litert export``, and a failed export after training (exit 3, recorded, checkpoint as it was)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_backend import settings as job_settings
from verl_backend.driver import export_step
from verl_backend.errors import BadInputError


def _config(**over):
    config = OmegaConf.create(
        {
            "trainer": {"save_freq": 6},
            "actor_rollout_ref": {
                "actor": {"checkpoint": {"save_contents": ["model", "optimizer", "extra", "hf_model"]}}
            },
            "data": {"max_prompt_length": 128, "max_response_length": 64, "val_files": []},
            "reward": {
                "custom_reward_function": {
                    "path": "pkg://verl_backend.data.rewards",
                    "name": "guarded_score",
                    "reward_kwargs": {},
                }
            },
        }
    )
    for key, value in over.items():
        OmegaConf.update(config, key, value)
    return config


def _settings(**values):
    return replace(job_settings.RlTpuSettings(), **values)


def test_export_recipes_match_litert_export():
    from edge_export.quantize import RECIPES

    assert job_settings.EXPORT_RECIPES == tuple(RECIPES)


def test_flags_are_shortcuts_for_the_export_keys():
    resolved = job_settings.resolve({}, {}, flags={"--export": "m.litertlm", "--quantize": "dynamic-int8"})
    assert (resolved.export, resolved.export_quantize) == ("m.litertlm", "dynamic-int8")
    with pytest.raises(BadInputError, match="export_quantize"):
        job_settings.resolve({"export_quantize": "int3"}, {})


@pytest.mark.parametrize(
    "values, config_over, match",
    [
        ({"export": "model.onnx"}, {}, r"\.litertlm .*or \.tflite"),
        ({"export": "m.litertlm"}, {"trainer.save_freq": -1}, r"trainer.save_freq=-1 saves no checkpoint"),
        ({"export": "m.litertlm"}, {"actor_rollout_ref.actor.checkpoint.save_contents": ["model"]}, r"no hf_model"),
        ({"export_quantize": "dynamic-int8"}, {}, r"rl_tpu.export_quantize=dynamic-int8 applies to the export"),
        ({"export_max_drop": 1.0}, {}, r"rl_tpu.export_max_drop=1.0 applies"),
    ],
)
def test_refused_before_training(tmp_path, monkeypatch, values, config_over, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError, match=match):
        export_step.check_export(_settings(**values), _config(**config_over))


def test_a_folder_or_unwritable_place_is_refused(tmp_path):
    (tmp_path / "dir.litertlm").mkdir()
    with pytest.raises(BadInputError, match="is a folder"):
        export_step.check_export(_settings(export=str(tmp_path / "dir.litertlm")), _config())
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user that writes anywhere (root)")
        with pytest.raises(BadInputError, match="cannot be written"):
            export_step.check_export(_settings(export=str(locked / "sub" / "m.litertlm")), _config())
    finally:
        locked.chmod(0o700)


def test_a_good_request_passes(tmp_path):
    export_step.check_export(_settings(export=str(tmp_path / "new" / "m.litertlm")), _config())
    export_step.check_export(_settings(), _config())  # no export asked for: nothing to check


def test_scorer_is_the_runs_reward_function():
    assert export_step.scorer_for(_config()) == "verl_backend.data.rewards:compute_score"
    user = _config(
        **{"reward.custom_reward_function.reward_kwargs": {"user_fn_path": "/r/my.py", "user_fn_name": "score"}}
    )
    assert export_step.scorer_for(user) == "/r/my.py:score"
    plain = _config(**{"reward.custom_reward_function.path": None})
    assert export_step.scorer_for(plain) == "verl.utils.reward_score:default_compute_score"


def test_heldout_items_round_trip_and_score_with_the_runs_reward(tmp_path):
    """The built-in held-out parquet becomes --eval items that litert export's loader reads and the project's
    reward function scores: the right answer scores 1, a wrong one less."""
    from edge_export.evaluate import load_scorer, read_items
    from verl_backend.data import reasoning_gym_to_parquet

    parquet = tmp_path / "val.parquet"
    reasoning_gym_to_parquet("basic_arithmetic", parquet, size=3, seed=1001, split="test")
    config = _config(**{"data.val_files": [str(parquet)]})
    count = export_step.write_heldout_items(config, tmp_path / "heldout.jsonl")
    items = read_items(str(tmp_path / "heldout.jsonl"))
    assert count == len(items) == 3
    score = load_scorer(export_step.scorer_for(config))
    for item in items:
        assert item["messages"][-1]["role"] == "user"
        assert score(f"<answer>{item['answer']}</answer>", item["answer"], item) == 1.0
        assert score("<answer>no idea</answer>", item["answer"], item) < 1.0


def test_a_reward_file_is_a_scorer(tmp_path):
    from edge_export.evaluate import load_scorer

    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    score = load_scorer(f"{reward}:compute_score")
    assert score("7", "7", {}) == 1.0 and score("8", "7", {}) == 0.0


def test_failed_export_exits_3_records_it_and_leaves_the_checkpoint(tmp_path, capsys):
    """A checkpoint litert export cannot read (its weights file is cut short): exit 3, the cause in summary.json
    and on stderr, the command to rerun, and the checkpoint's bytes unchanged."""
    from verl_backend.driver.console import Console
    from verl_backend.driver.train import _export

    ckpt = tmp_path / "run" / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      cut")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}
    run = tmp_path / "run"
    (run / "summary.json").write_text(json.dumps({"training_steps": 2}))
    console = Console(None, None, verbose=True)  # not capturing: the error goes to this process's stderr
    code = _export(_config(), run, _settings(export=str(tmp_path / "out" / "m.tflite")), console)
    assert code == export_step.EXPORT_FAILED == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["training_steps"] == 2  # what the report wrote is kept
    entry = summary["export"]
    assert entry["status"] == "failed" and entry["exit_code"] != 0 and entry["error"]
    assert entry["checkpoint"] == str(ckpt)
    err = capsys.readouterr().err
    assert "verl: error: export of the final checkpoint failed:" in err and "litert export " in err
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()} == before
    assert not Path(tmp_path / "out" / "m.tflite").exists()
