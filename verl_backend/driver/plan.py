"""Job config planning for ``verl train``: the overrides VeRL's trainer runs with.

The job is VeRL's own: its config is composed from ``verl/trainer/config/ppo_trainer.yaml`` with Hydra and run by
``verl.trainer.main_ppo.run_ppo`` as ``python -m verl.trainer.main_ppo`` does. This module decides the overrides, in
the order that wins last: the backend profile's defaults (:mod:`verl_backend.driver.profiles`), the ``--config``
file, the command line; it separates rl-tpu's own ``rl_tpu.*`` keys, routes a user's reward function through the
guarded scorer, makes paths absolute, and fits the default job's micro batches to a slice's workers.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from verl_backend.driver.preflight import check_model_folder
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
    ``override_config``/``mixed_precision``/``env_vars``/``override_optimizer_config`` (passed whole). The keys of a
    ``reward_kwargs`` mapping, which VeRL reads but does not declare, are added (``+key=value``); once added, a later
    plain ``key=value`` on the command line replaces the value.

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
        if prefix.endswith("custom_reward_function.reward_kwargs") and isinstance(node, dict):
            out.extend(f"+{prefix}.{k}={_format_value(v)}" for k, v in node.items())
        elif isinstance(node, dict) and node and not whole:
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
    ``+``/``~`` prefix of the source that set it last, except that a key an earlier source added (``+key``, a key
    VeRL does not declare) stays added when a later one gives it plainly: its value replaces the earlier one.
    """
    merged: dict[str, str] = {}
    for override in [f"{k}={v}" for k, v in backend_defaults.items()] + file_overrides + cli_overrides:
        key = next(iter(_override_keys([override])))
        earlier = merged.pop(key, None)  # re-insert so the order follows the source that wins
        if earlier is not None and earlier.startswith("+") and not override.startswith(("+", "~")):
            override = "+" + override
        merged[key] = override
    return list(merged.values())


def split_rl_tpu(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separate ``rl_tpu.<key>=value`` settings (ours, checked by :func:`verl_backend.settings.resolve`) from VeRL's
    Hydra overrides."""
    verl, ours = [], {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        if key.startswith("rl_tpu."):
            if "=" not in o:
                raise BadInputError(
                    f"{o!r}: give rl_tpu settings as rl_tpu.<key>=<value>; `verl train --help` lists them"
                )
            ours[key[len("rl_tpu.") :]] = o.split("=", 1)[1].strip()
        else:
            verl.append(o)
    return verl, ours


def guard_user_reward(overrides: list[str]) -> list[str]:
    """Route a user's ``reward.custom_reward_function.path/name`` through :func:`guarded_score`.

    The user's function is still the one that scores; the wrapper turns an exception or a NaN into one clear
    error naming the function and the sample. VeRL's older top-level ``custom_reward_function.path/name`` (which
    VeRL 0.9.1 migrates under ``reward.``) is routed the same way; before, it was passed on and silently lost.
    """
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        bare = key.lstrip("+").removeprefix("reward.")  # VeRL's old top-level custom_reward_function.* too
        if bare == "custom_reward_function.path" and value.strip("\"'") not in (
            "",
            "null",
            "pkg://verl_backend.data.rewards",
        ):
            out.append(f"+reward.custom_reward_function.reward_kwargs.user_fn_path={value}")
        elif bare == "custom_reward_function.name":
            out.append(f"+reward.custom_reward_function.reward_kwargs.user_fn_name={value}")
        else:
            out.append(o)
    return out


PATH_KEYS = (
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "critic.model.tokenizer_path",
)


DATA_FILE_KEYS = ("data.train_files", "data.val_files")


def normalized_path(override: str) -> str:
    """A model-path override with ``~`` expanded and no trailing ``/``: VeRL 0.9.1's ``HFModelConfig`` asserts
    on a trailing slash (a traceback deep in Hydra instantiation) and does not expand ``~``. A data file given as
    one ``~/...`` path is expanded too (Hydra's override grammar rejects a bare ``~`` there)."""
    key, sep, value = override.partition("=")
    bare = key.lstrip("+~")
    if not sep or bare not in PATH_KEYS + DATA_FILE_KEYS:
        return override
    raw = value.strip("\"'")
    if raw in ("", "null", "None"):
        return override
    if bare in DATA_FILE_KEYS:
        return f"{key}={os.path.expanduser(raw)}" if raw.startswith("~") else override
    path = os.path.expanduser(raw)
    path = path.rstrip("/") or "/"
    return f"{key}={path}"


def model_path_overrides(keys: dict[str, str], model_cache: str = "") -> list[str]:
    """The model-path keys the job gets: none where the user named a model (checked here), else the embedded default
    model, converted into ``model_cache`` (``rl_tpu.model_cache``) first if it is not there.

    Raises:
        BadInputError: a named model folder that is not one, or a model cache that cannot be written.
    """
    from verl_backend.models import ensure_default_model

    for role in ("actor_rollout_ref.model", "critic.model"):
        raw = keys.get(f"{role}.path", "").strip("\"'")
        if raw not in ("", "null", "None") and not raw.startswith("${"):
            check_model_folder(f"{role}.path", Path(os.path.expanduser(raw)), keys.get(f"{role}.tokenizer_path"))
    if "actor_rollout_ref.model.path" in keys:
        return []
    path = ensure_default_model(cache=model_cache)
    extra = [f"actor_rollout_ref.model.path={path}"]
    if "critic.model.path" not in keys:
        extra.append(f"critic.model.path={path}")
    return extra


def slice_defaults(slice_arg: str | None, given_as: str = "rl_tpu.slice") -> tuple[dict[str, str], str]:
    """Resource-pool keys for a TPU slice: one VeRL node per host, one worker per chip (whole chips).

    ``slice_arg`` is ``"v6e-16"`` or ``"v6e-16:4x4"`` (``rl_tpu.slice``, ``--slice``: ``given_as`` names which, for
    the error); empty reads
    ``TPU_ACCELERATOR_TYPE``/``TPU_TOPOLOGY`` of this host (set on every TPU VM and by ``rl-tpu cluster up
    --fake-slice``).

    Returns:
        ``(keys, slice)``: the VeRL overrides and the slice as ``"<type>:<topology>"`` for the settings record (the
        TaskRunner reserves it, :mod:`verl_backend.workers.slice_pool`); ``({}, "")`` when neither is given.

    Raises:
        BadInputError: unknown accelerator type or a topology that type does not have.
    """
    from rl_tpu.topology import TopologyError, parse_slice

    if slice_arg:
        acc, _, topo = slice_arg.partition(":")
    elif os.environ.get("TPU_ACCELERATOR_TYPE"):
        acc, topo = os.environ["TPU_ACCELERATOR_TYPE"], os.environ.get("TPU_TOPOLOGY", "")
    else:
        return {}, ""
    try:
        spec = parse_slice(acc, topo or None)
    except TopologyError as exc:
        raise BadInputError(f"{given_as if slice_arg else '$TPU_ACCELERATOR_TYPE'}={slice_arg or acc}: {exc}") from None
    keys = {"trainer.nnodes": str(spec.hosts), "trainer.n_gpus_per_node": str(spec.chips_per_host)}
    return keys, f"{spec.accelerator_type}:{spec.topology}"


def drop_replaced_micro_batches(defaults: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    """The backend profile's overrides less each per-chip micro batch size (``…_micro_batch_size_per_gpu``) whose
    global form (``…_micro_batch_size``) the user gives a value (``user``: the ``--config`` file's and the command
    line's ``{key: value}``; a ``null`` is no value): VeRL refuses a section with both, and the user's is the one
    meant."""
    suffix = "_per_gpu"
    given = {k for k, v in user.items() if str(v).strip().lower() not in ("null", "none", "~", "")}
    return {
        k: v
        for k, v in defaults.items()
        if not (k.endswith("_micro_batch_size" + suffix) and k[: -len(suffix)] in given)
    }


DEFAULT_MICRO_KEYS = (
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
)


def fit_default_micro_batches(config, user_keys: set[str], source: str = "the embedded default") -> None:
    """Lower default micro batch sizes to what each worker gets, when there are many workers.

    ``verl_backend/configs/grpo_cpu.yaml`` sizes its micro batches for one worker (log-prob 8, update 4 of 16
    sequences a step); the TPU profile sets 8 of each (``profiles.TPU_MICRO_KEYS``). On a slice (``--slice v6e-16``:
    16 workers) each worker may get fewer sequences than that, which VeRL's engine cannot split into micro batches
    of 8, and :func:`check_batch_sizes` would refuse the README's own command. Shares are counted as that check
    counts them: a PPO update's over the data-parallel ranks (workers / Ulysses size), a step's log-probs over the
    workers. A micro batch size the user set (``user_keys``, or its global form, which VeRL's critic config
    interpolates into the per-chip key) is never changed; that one is refused there. Keys VeRL does not read are
    left alone: under dynamic batch sizes, the critic's without GAE. ``source`` names where the defaults came from.
    Each change is printed as one ``[rl-tpu]`` line.
    """
    from omegaconf import OmegaConf

    from verl_backend.driver.job_keys import runs_critic

    workers = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    n, batch = int(config.actor_rollout_ref.rollout.n), int(config.data.train_batch_size)
    critic = runs_critic(lambda key, default: OmegaConf.select(config, key, default=default))
    for key in DEFAULT_MICRO_KEYS:
        section = key.rsplit(".", 1)[0]
        if key in user_keys or key[: -len("_per_gpu")] in user_keys or (section == "critic" and not critic):
            continue
        micro = OmegaConf.select(config, key)
        if (
            not micro
            or OmegaConf.select(config, f"{section}.use_dynamic_bsz")
            or OmegaConf.select(config, f"{section}.log_prob_use_dynamic_bsz")
        ):
            continue
        if key.endswith("ppo_micro_batch_size_per_gpu"):
            mini = OmegaConf.select(config, f"{section}.ppo_mini_batch_size")
            engine = OmegaConf.select(config, f"{section}.{'fsdp' if section == 'critic' else 'fsdp_config'}") or {}
            sp = max(
                int(OmegaConf.select(config, f"{section}.ulysses_sequence_parallel_size") or 1),
                int(engine.get("ulysses_sequence_parallel_size") or 1),
            )
            ranks = max(1, workers // sp)
            share = int(mini) * n // ranks if mini else 0
        else:
            ranks, share = workers, batch * n // workers
        if share < 1 or share % int(micro) == 0:
            continue  # divides, or nothing to split (check_batch_sizes names that)
        fitted = math.gcd(int(micro), share)
        OmegaConf.update(config, key, fitted)
        print(
            f"[rl-tpu] {key} lowered from {micro} ({source}) to {fitted}: each of the {ranks} "
            f"{'data-parallel ranks' if ranks != workers else 'workers'} gets {share} sequence(s) at a time",
            flush=True,
        )
