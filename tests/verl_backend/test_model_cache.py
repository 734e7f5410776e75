"""The embedded default model's folder (``rl_tpu.model_cache``): a setting of the job, recorded as an absolute
folder, and converted on each host whose workers read it and do not have it (a host other than the driver's), once
per host however many of its processes ask at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from verl_backend import settings as S
from verl_backend.models import DEFAULT_MODEL_NAME, cache_root, is_hf_model_dir


def test_the_cache_folder_is_a_setting_with_the_old_variable_as_its_alias(tmp_path, capsys):
    assert S.resolve({}, {}, environ={}).model_cache == ""
    aliased = S.resolve({}, {}, environ={"RL_TPU_CACHE": str(tmp_path)})
    assert aliased.model_cache == str(tmp_path) and "rl_tpu.model_cache" in capsys.readouterr().err
    assert S.resolve({"model_cache": "/x"}, {}, environ={"RL_TPU_CACHE": str(tmp_path)}).model_cache == "/x"
    assert cache_root("") == Path.home() / ".cache" / "rl-tpu"
    assert cache_root("~/models") == Path.home() / "models"  # absolute: the same path on every host


def test_a_worker_converts_the_default_model_on_a_host_that_lacks_it(tmp_path, monkeypatch):
    import verl  # noqa: F401  (rl-tpu's plugin applies its patches)
    from verl.utils.fs import copy_to_local

    cache = tmp_path / "cache"
    monkeypatch.setenv(S.RECORD_ENV, S.record(S.RlTpuSettings(model_cache=str(cache))))
    other = tmp_path / "users-model"
    assert copy_to_local(str(other)) == str(other) and not other.exists()  # not the default model: left alone
    assert not cache.exists()
    folder = cache / DEFAULT_MODEL_NAME
    assert copy_to_local(str(folder)) == str(folder)  # what HFModelConfig calls in every worker
    assert is_hf_model_dir(folder) and (folder / "tokenizer.json").is_file()
    monkeypatch.delenv(S.RECORD_ENV)  # no job: nothing is converted
    assert copy_to_local(str(tmp_path / "c2" / DEFAULT_MODEL_NAME)) and not (tmp_path / "c2").exists()


def test_processes_converting_at_once_take_turns(tmp_path):
    script = textwrap.dedent(f"""
        import verl_backend.models as m
        calls = []
        real = m._convert
        m._convert = lambda *a: (calls.append(1), real(*a))
        folder = m.ensure_default_model(cache={str(tmp_path)!r})
        print("converted" if calls else "found", m._converted(folder))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = sorted(p.communicate(timeout=300)[0].strip() for p in procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["converted True", "found True"]  # one conversion; the other waited and found it done
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [DEFAULT_MODEL_NAME]


def test_the_engines_convert_it_before_building_the_module(tmp_path, monkeypatch):
    """The critic's model config reaches its worker pickled (no ``copy_to_local`` on that host): rl-tpu's engines
    convert the default model before VeRL builds the module from it."""
    from types import SimpleNamespace

    from verl_backend.workers.engine import (
        RlTpuFSDPEngineWithLMHead,
        RlTpuFSDPEngineWithValueHead,
        _DefaultModelHere,
    )

    for engine in (RlTpuFSDPEngineWithLMHead, RlTpuFSDPEngineWithValueHead):
        assert engine._build_module is _DefaultModelHere._build_module  # first in the order: before VeRL's

    class VerlEngine:  # stands in for VeRL's engine, which would read the folder here
        def _build_module(self):
            return is_hf_model_dir(self.model_config.local_path)

    class Engine(_DefaultModelHere, VerlEngine):
        pass

    folder = tmp_path / "cache" / DEFAULT_MODEL_NAME
    monkeypatch.setenv(S.RECORD_ENV, S.record(S.RlTpuSettings(model_cache=str(folder.parent))))
    engine = Engine()
    engine.model_config = SimpleNamespace(local_path=str(folder))
    assert engine._build_module() is True
