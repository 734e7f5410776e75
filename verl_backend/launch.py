"""Build and run a VeRL 0.9.1 PPO/GRPO job on an rl-tpu backend.

The job is VeRL's own: the config is composed from ``verl/trainer/config/ppo_trainer.yaml`` with Hydra, and run
by ``verl.trainer.main_ppo.run_ppo`` with VeRL's ``TaskRunnerV1`` exactly as ``python -m verl.trainer.main_ppo``
does. This module only decides the overrides (backend defaults < ``--config`` file < command line), prepares the
embedded default model and data, and routes logs into one output folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from verl_backend.errors import BadInputError

def _format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_format_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if text.startswith("${"):
        return text
    return json.dumps(text)


def flatten_yaml_overrides(path: str | os.PathLike) -> tuple[list[str], dict[str, Any]]:
    """Turn a nested YAML of VeRL keys into Hydra overrides ``a.b.c=value``.

    The top-level ``rl_tpu`` mapping (our own settings: built-in data) is returned separately, untouched.
    Keys starting with ``+`` are kept as additions. Dicts are flattened to leaves except under keys ending in
    ``override_config``/``mixed_precision``/``env_vars``/``override_optimizer_config`` (passed whole).

    Returns:
        ``(overrides, rl_tpu_settings)``.

    Raises:
        BadInputError: the file is missing, not YAML, or not a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"--config {p}: no such file; pass a YAML file of VeRL config keys (see examples/)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise BadInputError(f"--config {p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return [], {}
    if not isinstance(data, dict):
        raise BadInputError(f"--config {p}: top level must be a mapping of VeRL config keys, got {type(data).__name__}")
    ours = data.pop("rl_tpu", None) or {}
    if not isinstance(ours, dict):
        raise BadInputError(f"--config {p}: 'rl_tpu' must be a mapping of rl-tpu settings")
    out: list[str] = []

    def walk(prefix: str, node: Any) -> None:
        whole = prefix.endswith(("override_config", "mixed_precision", "env_vars", "override_optimizer_config"))
        if isinstance(node, dict) and node and not whole:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out.append(f"{prefix}={_format_value(node)}")

    if data:
        walk("", data)
    return out, ours


def _override_keys(overrides: list[str]) -> dict[str, str]:
    keys = {}
    for o in overrides:
        if "=" not in o:
            raise BadInputError(
                f"override {o!r} is not key=value; write VeRL keys like data.train_batch_size=8 "
                "(prefix + to add a key VeRL does not define)"
            )
        k, v = o.split("=", 1)
        keys[k.lstrip("+~")] = v
    return keys


def compose_config(overrides: list[str]):
    """Compose VeRL's ``ppo_trainer`` config with ``overrides`` (Hydra syntax).

    Raises:
        BadInputError: an override names a key VeRL does not have, or has a bad value.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            return compose(config_name="ppo_trainer", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        msg = " ".join(str(exc).split())
        raise BadInputError(
            f"VeRL config: {msg[:400]}; check the key against `verl train --print-config` "
            "(prefix + to add a key VeRL does not define)"
        ) from None
    finally:
        GlobalHydra.instance().clear()


def merge_overrides(backend_defaults: dict[str, str], file_overrides: list[str], cli_overrides: list[str]) -> list[str]:
    """Later sources win per key: backend defaults, then the ``--config`` file, then the command line.

    Each key appears once in the result (Hydra refuses ``+key`` twice); the surviving override keeps the
    ``+``/``~`` prefix of the source that set it last.
    """
    merged: dict[str, str] = {}
    for override in [f"{k}={v}" for k, v in backend_defaults.items()] + file_overrides + cli_overrides:
        key = next(iter(_override_keys([override])))
        merged.pop(key, None)  # re-insert so the order follows the source that wins
        merged[key] = override
    return list(merged.values())
