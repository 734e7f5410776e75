"""rl-tpu's typed job settings: one table, a stated precedence, one clear line for bad input, one record that
workers load (and a worker without it refuses to run on defaults)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl_backend import settings as S
from verl_backend.errors import BadInputError


def test_precedence_is_cli_then_config_file_then_deprecated_env_then_default(capsys):
    env = {"RL_TPU_PLAIN_MODULE": "0", "RL_TPU_TRIM_BACKWARD": "0", "RL_TPU_SHARED_WEIGHTS": "0"}
    got = S.resolve(cli={"plain_module": "true"}, file={"plain_module": False, "trim_backward": True}, environ=env)
    assert got.plain_module is True  # command line over file and env
    assert got.trim_backward is True  # file over env
    assert got.shared_weights is False  # env (deprecated) over default
    assert got.response_only_logits is True and got.task_runner == "driver"  # defaults
    err = capsys.readouterr().err
    assert "RL_TPU_SHARED_WEIGHTS is deprecated" in err and "rl_tpu.shared_weights=0" in err
    assert "RL_TPU_PLAIN_MODULE" not in err  # an alias the file or command line overrode is not used, nor named


def test_a_flag_is_its_keys_shortcut_and_may_not_disagree_with_it():
    assert S.resolve({}, {}, {}, flags={"--num-threads": 3}).num_threads == 3
    assert S.resolve({"num_threads": "3"}, {}, {}, flags={"--num-threads": 3}).num_threads == 3
    assert S.resolve({}, {"num_threads": 2}, {}, flags={"--num-threads": 3}).num_threads == 3
    with pytest.raises(BadInputError, match=r"--num-threads 3 and rl_tpu.num_threads=2 disagree"):
        S.resolve({"num_threads": "2"}, {}, {}, flags={"--num-threads": 3})


@pytest.mark.parametrize(
    "cli, file, env, message",
    [
        ({"plain_module": "maybe"}, {}, {}, "rl_tpu.plain_module=maybe: rl_tpu.plain_module takes true or false"),
        (
            {},
            {"num_threads": "two"},
            {},
            "--config job.yaml rl_tpu.num_threads: rl_tpu.num_threads takes a whole number",
        ),
        (
            {},
            {},
            {"RL_TPU_TASK_RUNNER": "gpu"},
            "RL_TPU_TASK_RUNNER='gpu': rl_tpu.task_runner takes one of driver, actor",
        ),
        ({"num_threads": "-1"}, {}, {}, "rl_tpu.num_threads must be >= 0"),
        (
            {"plain_modul": "false"},
            {},
            {},
            "rl_tpu.plain_modul is not an rl-tpu setting (did you mean rl_tpu.plain_module?)",
        ),
        ({}, {"trim": True}, {}, "--config job.yaml: rl_tpu.trim is not an rl-tpu setting"),
        ({"shared_prefix": "false"}, {}, {}, "set actor_rollout_ref.actor.use_prefix_grouper instead"),
        ({"task_config": "{oops"}, {}, {}, "rl_tpu.task_config is not JSON"),
    ],
)
def test_bad_values_are_one_line_naming_where_they_came_from(cli, file, env, message):
    with pytest.raises(BadInputError) as err:
        S.resolve(cli, file, env, file_name="--config job.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_mirrored_settings_alias_becomes_the_verl_key_it_follows(capsys):
    assert S.env_overrides({"RL_TPU_SHARED_PREFIX": "0"}) == {"actor_rollout_ref.actor.use_prefix_grouper": "false"}
    assert "use actor_rollout_ref.actor.use_prefix_grouper=false" in capsys.readouterr().err
    assert S.env_overrides({}) == {}
    from omegaconf import OmegaConf

    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"use_prefix_grouper": False}}})
    assert S.mirror_from_config(S.RlTpuSettings(), config).shared_prefix is False


def test_workers_load_the_record_and_refuse_to_run_without_one(monkeypatch):
    chosen = S.RlTpuSettings(plain_module=False, num_threads=2, task_config={"min_terms": 2})
    monkeypatch.setenv(S.RECORD_ENV, S.record(chosen))
    assert S.current() == chosen
    assert S.current() is S.current()  # parsed once per record
    monkeypatch.setenv(S.RECORD_ENV, S.record(S.RlTpuSettings()))
    assert S.current().plain_module is True  # a new record is read anew
    monkeypatch.setenv(S.RECORD_ENV, '{"plain_module": false, "turbo": true}')
    with pytest.raises(BadInputError, match="unknown setting"):
        S.current()
    monkeypatch.delenv(S.RECORD_ENV)
    monkeypatch.setenv("RL_TPU_PLAIN_MODULE", "0")  # an inherited variable is no substitute for the record
    with pytest.raises(S.SettingsMissingError, match="verl train"):
        S.current()


def test_every_setting_is_typed_helped_and_defaulted():
    names = [s.name for s in S.SETTINGS]
    assert len(names) == len(set(names))
    for s in S.SETTINGS:
        assert s.help and s.reader in ("driver", "workers")
        assert S.parse_value(s, s.default, "default") == s.default or s.default is None
        if s.choices:
            assert s.default in s.choices
    assert [s.name for s in S.SETTINGS if s.checkpoint_format] == ["plain_module"]


def test_print_config_shows_the_resolved_section_and_help_lists_the_table(tmp_path):
    """The driver end to end (no Ray): a file, an env alias and the command line resolve as stated, and
    ``--print-config`` prints the ``rl_tpu:`` section with every key."""
    job = tmp_path / "job.yaml"
    job.write_text("rl_tpu:\n  plain_module: true\n  trim_backward: true\n  response_only_logits: false\n")
    env = {
        **os.environ,
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        "RL_TPU_TRIM_BACKWARD": "0",
        "RL_TPU_SHARED_WEIGHTS": "0",
        "RL_TPU_SHARED_PREFIX": "0",
    }
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_backend.driver.cli",
            "train",
            "--backend",
            "cpu",
            "--config",
            str(job),
            "--output-dir",
            str(tmp_path / "o"),
            "--print-config",
            "--num-threads",
            "3",
            "rl_tpu.plain_module=false",
            "data.train_files=x.parquet",
            "rl_tpu.model_cache=~/.cache/rl-tpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = (
        yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
        if "actor_rollout_ref:" in proc.stdout.splitlines()[0]
        else yaml.safe_load(proc.stdout)
    )
    ours = config["rl_tpu"]
    assert set(ours) == {s.name for s in S.SETTINGS}
    assert ours["plain_module"] is False and ours["trim_backward"] is True and ours["response_only_logits"] is False
    assert ours["shared_weights"] is False and ours["num_threads"] == 3 and ours["shared_prefix"] is False
    assert config["actor_rollout_ref"]["actor"]["use_prefix_grouper"] is False
    # recorded as the driver's absolute folder: the path workers on other hosts convert the default model to
    assert ours["model_cache"] == str(Path.home() / ".cache" / "rl-tpu")
    assert config["actor_rollout_ref"]["model"]["path"] == ours["model_cache"] + "/SmolLM2-135M-Instruct"
    assert "RL_TPU_SHARED_WEIGHTS is deprecated" in proc.stderr and "RL_TPU_TRIM_BACKWARD" not in proc.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "verl_backend.driver.cli", "train", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    ).stdout
    for s in S.SETTINGS:
        assert f"rl_tpu.{s.name}=" in helped


def test_docs_settings_page_is_generated_from_the_table(tmp_path):
    """docs/settings.md is the settings table as generated; a key added, dropped or re-described without
    regenerating it fails here (negative control: the page with one row removed differs)."""
    from pathlib import Path

    from verl_backend.settings import SETTINGS, settings_markdown

    page = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    generated = settings_markdown()
    assert page.read_text() == generated, "regenerate it: python -m verl_backend.settings > docs/settings.md"
    assert all(f"| `rl_tpu.{s.name}` |" in generated for s in SETTINGS)
    rows = generated.splitlines()
    dropped = "\n".join(r for r in rows if not r.startswith("| `rl_tpu.seed`")) + "\n"
    assert dropped != page.read_text()


def test_flags_and_sections_are_declared_by_the_table_only():
    """A setting's flag is a ``verl train`` option generated from its ``Setting`` (its help names the key it is a
    shortcut for), and reaches :func:`~verl_backend.settings.resolve` by :func:`~verl_backend.settings.given_flags`;
    each section's fields are table settings with the table's types and defaults, plus what the section derives.
    Negative control: a setting without a flag has no option, so the parser refuses it."""
    from dataclasses import MISSING, fields

    from verl_backend.driver.cli import _parser, parse_args

    flagged = [s for s in S.SETTINGS if s.flag]
    assert len(flagged) == 7
    parser = _parser()
    train = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    helps = {o: a.help for a in train._actions for o in a.option_strings}
    for s in flagged:
        assert s.flag in helps and f"shortcut for rl_tpu.{s.name}" in helps[s.flag]
    args = parse_args(["train", "--backend", "cpu", "--num-threads", "3", "--tpu-dry-run", "--quantize", "weight-int8"])
    given = S.given_flags(args)
    assert given["--num-threads"] == 3 and given["--tpu-dry-run"] is True and given["--slice"] is None
    got = S.resolve({}, {}, {}, flags=given)
    assert got.num_threads == 3 and got.tpu_dry_run is True and got.export_quantize == "weight-int8"
    with pytest.raises(BadInputError, match="unknown option '--plain-module'"):
        parse_args(["train", "--backend", "cpu", "--plain-module"])
    derived = {"RolloutSettings": {"threads"}}
    for section in (S.EngineSettings, S.RolloutSettings, S.WeightSyncSettings):
        for f in fields(section):
            if f.name in derived.get(section.__name__, ()):
                continue
            setting = S.BY_NAME[f.name]  # a KeyError here: a field the table does not declare
            assert f.type is setting.type and (f.default if f.default is not MISSING else None) == setting.default
            assert f"rl_tpu.{f.name}" in section.__doc__


def test_the_default_task_is_declared_once_for_every_backend(tmp_path):
    """The built-in data's defaults are the table's: the CPU default job's config names no task, and a TPU job
    without --config gets the very same problems (additions of two 1-2 digit terms, 200 held out). A task given
    without options takes reasoning-gym's own (the default options belong to the default task)."""
    default = S.resolve({}, {}, {})
    assert default.task == "basic_arithmetic" and default.task_config["operators"] == ["+"] and default.val_size == 200
    assert S.resolve({"task": "chain_sum"}, {}, {}).task_config is None
    assert S.resolve({}, {"task": "basic_arithmetic"}, {}).task_config is None
    assert S.resolve({}, {"task": "chain_sum", "task_config": {"min_terms": 2}}, {}).task_config == {"min_terms": 2}
    from verl_backend.driver.profiles import PROFILES

    assert "rl_tpu" not in yaml.safe_load(PROFILES["cpu"].default_config.read_text())
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("VERL_PLATFORM", None)
    sections = {}
    for backend in ("cpu", "tpu"):
        proc = subprocess.run(
            [sys.executable, "-m", "verl_backend.driver.cli", "train", "--backend", backend, "--print-config"]
            + ["--output-dir", str(tmp_path / backend)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = proc.stdout[proc.stdout.index("actor_rollout_ref:") :] if "actor_rollout_ref:" in proc.stdout else ""
        sections[backend] = yaml.safe_load(text)["rl_tpu"]
    keys = ("task", "task_config", "train_size", "val_size", "seed")
    assert {k: sections["cpu"][k] for k in keys} == {k: sections["tpu"][k] for k in keys}
    assert sections["tpu"]["task_config"] == default.task_config
    files = [sorted((tmp_path / b / "data").glob("*.parquet")) for b in ("cpu", "tpu")]
    assert [p.read_bytes() for p in files[0]] == [p.read_bytes() for p in files[1]] and files[0]
