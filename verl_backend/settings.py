"""rl-tpu's job settings: one typed table, resolved once in the ``verl train`` driver, delivered with the job.

Every behaviour setting of rl-tpu is a key of the job config's ``rl_tpu:`` section, declared once in
:data:`SETTINGS` (name, type, default, allowed values, help, whether it changes the checkpoint format, and who reads
it). Precedence, highest first: the command line (``rl_tpu.<key>=value``, or a flag that is the key's shortcut), the
``--config`` YAML's ``rl_tpu:`` section, an ``RL_TPU_*`` environment variable of the driver (a deprecated alias kept
for one release: it warns and names the key), then the default.

Ray workers never read their own environment for these: a worker on a host started before the job (a TPU slice
under KubeRay) did not inherit the driver's. The driver serialises the resolved settings into one record
(:data:`RECORD_ENV`, JSON) that goes into the job's ``runtime_env``, so every worker of the job on every host gets
it with the job; :func:`current` is the one typed loader, and a worker that finds no record raises instead of
running on defaults.

Settings as parameters: only a process's entry points call :func:`current` (the engine's initialisation, a rollout
replica's adapter, the rollout server's construction, the ``gloo`` checkpoint engine's construction, the TPU
platform's ``set_device``, the TaskRunner's resource pool creation, the default-model hook), once each; each builds
its section (:class:`EngineSettings`, :class:`RolloutSettings`, :class:`WeightSyncSettings`, or the plain values)
and hands it down as parameters. ``tests/verl_backend/test_settings_reads.py`` fails on a read anywhere else. The
driver's memory plan reads the typed settings too (:func:`from_mapping` over the composed config's ``rl_tpu``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Mapping

from verl_backend.errors import BadInputError

RECORD_ENV = "RL_TPU_SETTINGS"  # the job's resolved settings, JSON, in every worker's runtime_env
# process-wide variables the driver forwards from its own environment to every Ray worker of the job
# (driver.runner) and a rollout server actor takes from the process that creates it (rollout.sampling.server_env):
# the one list both use. Not the thread count: rl_tpu.num_threads goes by the record alone, and each process's entry
# point sets torch's count from it (the engine's initialisation, the rollout server, the driver before VeRL runs)
FORWARDED_ENV = ("OMP_WAIT_POLICY", "TORCH_DEVICE_BACKEND_AUTOLOAD", "TPU_SKIP_MDS_QUERY")
# litert export's quantization recipes (edge_export.quantize.RECIPES; not imported: the driver needs no litert)
EXPORT_RECIPES = ("none", "dynamic-int8", "weight-int8", "dynamic-int4", "dynamic-int4-block")


@dataclass(frozen=True)
class Setting:
    """One rl-tpu setting: the key ``rl_tpu.<name>`` of the job config.

    Attributes:
        name: the key under ``rl_tpu:``.
        type: ``bool``, ``int``, ``float`` or ``str`` (``dict`` for a JSON mapping).
        default: the value when nobody sets it.
        help: one line for ``--help`` and ``--print-config``.
        choices: the allowed values (``None``: any value of ``type``).
        minimum: the lowest allowed number (``int`` / ``float`` only).
        env: the deprecated ``RL_TPU_*`` environment variable that still sets it (one release), or ``None``.
        flag: the ``verl train`` flag that is a shortcut for it, or ``None``.
        checkpoint_format: changing it changes what a checkpoint holds (a resume across values is refused).
        reader: ``"driver"`` (read by ``verl train`` only) or ``"workers"`` (read inside Ray workers, from the record).
        mirrors: a VeRL config key this setting follows: users set that key, and the driver copies its value here
            for the workers VeRL hands no such key (:func:`mirror_from_config`).
        metavar: how ``--help`` names the flag's value (``None``: argparse's default).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    minimum: float | None = None
    env: str | None = None
    flag: str | None = None
    checkpoint_format: bool = False
    reader: str = "workers"
    mirrors: str | None = None
    metavar: str | None = None


SETTINGS: tuple[Setting, ...] = (
    # --- the trainer's and rollout's fast paths (read in the workers)
    Setting(
        "shared_weights",
        bool,
        True,
        "weight sync through shared memory when trainer and rollout share a host (false: the Ray object store)",
        env="RL_TPU_SHARED_WEIGHTS",
    ),
    Setting(
        "verify_weight_sync",
        bool,
        True,
        "after every weight sync the rollout proves it computes with the "
        "trainer's model (a probe's log-probs through its own sampler, per-tensor fingerprints; a mismatch stops "
        "the job in one line); false: syncs unverified, weight_sync/verified 0",
    ),
    Setting(
        "shared_prefix",
        bool,
        True,
        "the trainer holds each prompt once for its GRPO samples (Prefix Grouper); "
        "set it as VeRL's actor_rollout_ref.actor.use_prefix_grouper",
        env="RL_TPU_SHARED_PREFIX",
        mirrors="actor_rollout_ref.actor.use_prefix_grouper",
    ),
    Setting(
        "response_only_logits",
        bool,
        True,
        "the trainer runs the LM head only where a response token is "
        "predicted (false: at every position, as VeRL does)",
        env="RL_TPU_RESPONSE_ONLY_LOGITS",
    ),
    Setting(
        "logits_chunk_mib",
        int,
        128,
        "the trainer's LM head, log-softmax and entropy run over a micro batch's response tokens in chunks whose fp32 "
        "logits take at most this many MiB (the logits recomputed in the backward) when all of them would take more; "
        "on one CPU rank, where the model's logits are its head's plain linear map. 0: all at once",
        minimum=0,
    ),
    Setting(
        "trim_backward",
        bool,
        False,
        "on CPU, hand each transformer block's freed activation pages back to "
        "the OS during the actor's backward (off by default: benchmarks/bench_host_memory.py measured no lower peak "
        "beside plain_module)",
        env="RL_TPU_TRIM_BACKWARD",
    ),
    Setting(
        "plain_module",
        bool,
        True,
        "on one CPU rank, run the model without FSDP2 (its copies shard nothing there); false wraps it anyway",
        env="RL_TPU_PLAIN_MODULE",
        checkpoint_format=True,
    ),
    Setting(
        "num_threads",
        int,
        0,
        "torch threads per process (0: on cpu 2, or the host's cores over its trainer workers if fewer; torch's own "
        "count elsewhere)",
        minimum=0,
        env="RL_TPU_NUM_THREADS",
        flag="--num-threads",
    ),
    Setting(
        "rollout_num_threads",
        int,
        0,
        "torch threads the rollout samples with (0: rl_tpu.num_threads), in its "
        "server process or, with sampler_placement=worker, while the worker samples; e.g. 1 beside a 2-thread "
        "update in an async mode, so the rollout keeps to one core",
        minimum=0,
    ),
    Setting(
        "omp_wait_policy",
        str,
        "default",
        "OpenMP's OMP_WAIT_POLICY for every process of the job: passive (a "
        "waiting OpenMP thread sleeps, so processes with more threads than free cores, such as a rollout beside a "
        "multi-thread update, do not spin against each other), active, or default (the OpenMP runtime's own, or "
        "an OMP_WAIT_POLICY already exported)",
        choices=("default", "active", "passive"),
        reader="driver",
    ),
    Setting(
        "tpu_eager_mode",
        str,
        "strict",
        "TorchTPU eager mode on --backend tpu: strict (DEFER_NEVER), debug "
        "(DEFER_NEVER_AND_LAUNCH_BLOCKING), fused (DEFER_AND_FUSE)",
        choices=("strict", "debug", "fused"),
        env="RL_TPU_EAGER_MODE",
        flag="--tpu-eager-mode",
    ),
    Setting(
        "compile_sampler",
        bool,
        False,
        "the rollout's prefill and decode run as torch.compile graphs "
        "(fullgraph, one per bucket shape; backend tpu on TPU, inductor on CPU/CUDA); the CPU sampler's fast "
        "paths are then off; on by default with --backend tpu (the TPU profile's)",
    ),
    Setting(
        "compile_trainer",
        bool,
        False,
        "the actor's and reference policy's transformer blocks run as "
        "torch.compile graphs (fullgraph, static shapes; backend tpu on TPU, inductor on CPU/CUDA): needs padded "
        "micro batches (actor_rollout_ref.model.use_remove_padding=false, the TPU profile's); what cannot compile "
        "runs eagerly, said in one line; on by default with --backend tpu (the TPU profile's)",
    ),
    Setting(
        "compile_backend",
        str,
        "device",
        "the torch.compile backend of compile_trainer and compile_sampler: device (the device's: tpu on TPU, "
        "inductor on CPU/CUDA) or tpu-on-cpu (each graph lowered to StableHLO by TorchTPU as on a chip, in a "
        "lowering server from .venv-aot, then compiled and run by XLA:CPU; the TPU dry run's default where "
        ".venv-aot exists: verl_backend/tpu_on_cpu.py)",
        choices=("device", "tpu-on-cpu"),
    ),
    Setting(
        "compile_cache_dir",
        str,
        "",
        "with rl_tpu.compile_backend=tpu-on-cpu: the folder of each graph's StableHLO, by (graph, input shapes), "
        "shared by the host's processes, and of each process's graph counts (stats/); default the run folder's "
        "tpu-on-cpu/",
    ),
    Setting(
        "slice",
        str,
        "",
        "TPU slice the workers go on, e.g. v6e-16 or v5p-16:2x2x4, reserved whole (tpu "
        "default: $TPU_ACCELERATOR_TYPE); with --backend cpu a dry run on a fake slice",
        flag="--slice",
    ),
    Setting(
        "tpu_dry_run",
        bool,
        False,
        "--backend cpu only: run the job with the TPU profile's choices (padded "
        "micro batches, bf16 rollout, VeRL's bf16 FSDP mixed precision, the bucketed sampler inside the trainer "
        "worker with the CPU fast paths off, in-worker weight sync, no bypass, no prefix grouper, no fork "
        "server) on CPU devices and gloo, one rank per chip of a fake slice: --slice, default v6e-4 (4 ranks), "
        "reserved on a Ray cluster from `rl-tpu cluster up --fake-slice v6e-4` ($RAY_ADDRESS)",
        flag="--tpu-dry-run",
        reader="driver",
    ),
    Setting(
        "tpu_dry_run_compile",
        bool,
        True,
        "with rl_tpu.tpu_dry_run: the driver also lowers the job's graphs "
        "with TorchTPU and compiles them with libtpu for the fake slice's chip and topology (the --aot-only code "
        "path, in subprocesses while the job trains; needs .venv-aot from .ci/aot_venv, else skipped in one "
        "line); the run's summary says how many compiled and the per-chip HBM; off: only the graph list "
        "(aot/graphs.json in the run folder)",
        reader="driver",
    ),
    Setting(
        "slice_timeout_s",
        float,
        600.0,
        "seconds to wait for the slice reservation before failing",
        minimum=1,
        env="RL_TPU_SLICE_TIMEOUT_S",
    ),
    Setting(
        "rollout_slice",
        str,
        "",
        "TPU slice for the rollout replicas apart from the trainer's rl_tpu.slice, "
        "e.g. v6e-8: checked against the Ray cluster ($RAY_ADDRESS) before anything waits, then the job is "
        "VeRL's separate_async with this slice as its standalone rollout pool (one worker per chip, reserved "
        "whole with ray.util.tpu) and rl-tpu's gloo checkpoint engine",
        flag="--rollout-slice",
    ),
    Setting(
        "job_seed",
        int,
        None,
        "the job's seed: VeRL's data.seed (set that key; rl-tpu's default 1), "
        "mirrored for the workers: the data order, every worker's random/numpy/torch seed, and with "
        "actor_rollout_ref.rollout.seed each sample's own random stream (docs/reproducibility.md); unset: "
        "an unseeded run",
        mirrors="data.seed",
    ),
    # --- how the driver runs the job (read by verl train only)
    Setting(
        "fork_server",
        bool,
        True,
        "local CPU job: fork Ray's workers from one process that has imported "
        "torch and VeRL (imports held once, workers start in ~1 s)",
        env="RL_TPU_FORK_SERVER",
        reader="driver",
    ),
    Setting(
        "compact_malloc",
        bool,
        False,
        "CPU job: glibc malloc settings that keep the backward from fragmenting "
        "the heap (lower peak memory, update up to 2x slower)",
        env="RL_TPU_COMPACT_MALLOC",
        reader="driver",
    ),
    Setting(
        "task_runner",
        str,
        "driver",
        "where VeRL's TaskRunner runs: driver (in the verl process) or actor (its own Ray actor)",
        choices=("driver", "actor"),
        env="RL_TPU_TASK_RUNNER",
        reader="driver",
    ),
    # --- train, then ship: the final checkpoint exported with litert export (read by verl train only)
    Setting(
        "export",
        str,
        "",
        "after training, export the final checkpoint to this .litertlm (or .tflite) with "
        "litert export, verified through the LiteRT runtime and, for a .litertlm, scored on the run's held-out "
        "items beside PyTorch; a failed export exits 3 and leaves the checkpoint as it was",
        flag="--export",
        reader="driver",
        metavar="OUT.litertlm",
    ),
    Setting(
        "export_quantize",
        str,
        "none",
        "quantization of rl_tpu.export (litert export --quantize)",
        choices=EXPORT_RECIPES,
        flag="--quantize",
        reader="driver",
    ),
    Setting(
        "export_max_drop",
        float,
        5.0,
        "accuracy points the exported bundle may lose against PyTorch on the held-out items before rl_tpu.export fails",
        minimum=0.0,
        reader="driver",
    ),
    Setting(
        "model_cache",
        str,
        "",
        "folder the embedded default model (SmolLM2-135M-Instruct) is converted into, "
        "on the host verl train runs on and on each other host whose workers read it and do not have it "
        "(empty: ~/.cache/rl-tpu of the host verl train runs on; recorded as the absolute folder)",
        env="RL_TPU_CACHE",
    ),
    # --- the built-in data (used when data.train_files is not given)
    # the default task, for every backend's job (the CPU default's, a TPU job's without --config): additions of two
    # 1-2 digit terms, where the base model is right about half the time (docs/recipe.md)
    Setting("task", str, "basic_arithmetic", "reasoning-gym task of the built-in data", reader="driver"),
    Setting("train_size", int, 256, "built-in training problems", minimum=1, reader="driver"),
    Setting(
        "val_size",
        int,
        200,
        "built-in held-out problems (the before -> after line's 95% interval is about +-6 points at 200)",
        minimum=1,
        reader="driver",
    ),
    Setting("seed", int, 1, "seed of the built-in data (held-out: seed + 1000)", minimum=0, reader="driver"),
    Setting(
        "task_config",
        dict,
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 2,
            "operators": ["+"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
        "reasoning-gym task options, a mapping (JSON on the command line); the default is the default task's, "
        "and a task given without options takes reasoning-gym's own",
        reader="driver",
    ),
    Setting(
        "few_shot",
        int,
        0,
        "worked examples of the built-in reasoning-gym task put before every question (training and held-out) as "
        "earlier chat turns, each reply working the task's expression and ending in <answer></answer> tags: drawn at "
        "seed + 3000, none a training or held-out question; refused with rl_tpu.gsm8k_jsonl or data.train_files",
        minimum=0,
        reader="driver",
    ),
    Setting(
        "gsm8k_jsonl", str, "", "GSM8K jsonl (question, answer ending '#### N') to train on instead", reader="driver"
    ),
    Setting(
        "gsm8k_val_fraction",
        float,
        0.1,
        "share of the GSM8K rows held out for validation (0..0.9)",
        minimum=0.0,
        reader="driver",
    ),
)
BY_NAME = {s.name: s for s in SETTINGS}


def _default(value: Any, metadata: Mapping[str, Any] | None = None):
    """A dataclass field defaulting to ``value``; a mapping or list is copied for each instance."""
    if isinstance(value, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(value), metadata=metadata)
    return field(default=value, metadata=metadata)


BY_FLAG = {s.flag: s for s in SETTINGS if s.flag}

RlTpuSettings = make_dataclass(
    "RlTpuSettings",
    [(s.name, s.type, _default(s.default, {"help": s.help})) for s in SETTINGS],
    frozen=True,
)
RlTpuSettings.__module__ = __name__
RlTpuSettings.__doc__ = "The resolved ``rl_tpu:`` section of one job (fields: :data:`SETTINGS`)."


def parse_value(setting: Setting, raw: Any, where: str) -> Any:
    """``raw`` (a string from the command line or the environment, or a YAML value) as ``setting``'s type.

    Args:
        where: how the user gave it, for the error (``"rl_tpu.plain_module=maybe"``, ``"--config job.yaml"``).

    Raises:
        BadInputError: one line naming ``where``, the key and the values it takes.
    """
    kind, value = setting.type, raw
    if isinstance(raw, str):
        text = raw.strip().strip("\"'")
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise BadInputError(f"{where}: rl_tpu.{setting.name} takes true or false (or 1 / 0)")
            value = lowered in ("1", "true", "yes", "on")
        elif kind is dict:
            if text in ("", "null", "None"):
                value = None
            else:
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise BadInputError(f"{where}: rl_tpu.{setting.name} is not JSON ({exc.msg})") from None
        elif kind in (int, float):
            try:
                value = kind(text)
            except ValueError:
                raise BadInputError(
                    f"{where}: rl_tpu.{setting.name} takes {'a whole number' if kind is int else 'a number'}"
                ) from None
        else:
            value = text
    elif kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        value = float(raw)
    elif kind is int and isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    if value is not None and not (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))):
        raise BadInputError(f"{where}: rl_tpu.{setting.name} takes a {kind.__name__}, not {raw!r}")
    if kind is dict and value is not None and not isinstance(value, dict):
        raise BadInputError(f"{where}: rl_tpu.{setting.name} takes a mapping")
    if setting.choices is not None and value not in setting.choices:
        raise BadInputError(f"{where}: rl_tpu.{setting.name} takes one of {', '.join(map(str, setting.choices))}")
    if setting.minimum is not None and value < setting.minimum:
        raise BadInputError(f"{where}: rl_tpu.{setting.name} must be >= {setting.minimum:g}")
    return value


def _unknown(name: str, where: str) -> BadInputError:
    import difflib

    close = difflib.get_close_matches(name, list(BY_NAME), n=1)
    hint = f" (did you mean rl_tpu.{close[0]}?)" if close else ""
    return BadInputError(f"{where}: rl_tpu.{name} is not an rl-tpu setting{hint}; `verl train --help` lists them")


def resolve(
    cli: Mapping[str, Any],
    file: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    file_name: str = "--config",
    flags: Mapping[str, Any] | None = None,
) -> "RlTpuSettings":
    """The job's settings: command line > ``--config`` file > deprecated ``RL_TPU_*`` variable > default.

    Args:
        cli: ``rl_tpu.<name>=value`` words of the command line, as ``{name: "value"}``.
        file: the ``--config`` YAML's ``rl_tpu:`` mapping.
        environ: the driver's environment (default ``os.environ``), read only for the deprecated aliases.
        file_name: the config file's path, for errors.
        flags: shortcut flags the user gave, ``{"--num-threads": 2}`` (``None`` values are ignored); a flag and
            its key both given with different values is refused.

    Raises:
        BadInputError: an unknown key, a value of the wrong type or out of range, or a flag and key that disagree.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in file:
        if name not in BY_NAME:
            raise _unknown(name, file_name)
    for name in cli:
        if name not in BY_NAME:
            raise _unknown(name, "command line")
    for s in SETTINGS:
        if s.mirrors and (s.name in cli or s.name in file):
            raise BadInputError(f"rl_tpu.{s.name} follows VeRL's own key: set {s.mirrors} instead")
        if s.mirrors:
            continue  # mirror_from_config sets it; its env alias is a VeRL override (env_overrides)
        if s.name in cli:
            values[s.name] = parse_value(s, cli[s.name], f"rl_tpu.{s.name}={cli[s.name]}")
        elif s.name in file:
            values[s.name] = parse_value(s, file[s.name], f"{file_name} rl_tpu.{s.name}")
        elif s.env and environ.get(s.env, "").strip():
            values[s.name] = parse_value(s, environ[s.env], f"{s.env}={environ[s.env]!r}")
            _deprecated(s.env, f"rl_tpu.{s.name}={environ[s.env]}")
    if ("task" in cli or "task" in file) and "task_config" not in values:
        values["task_config"] = None  # the default options belong to the default task: this one takes its own
    for flag, given in (flags or {}).items():
        if given is None:
            continue
        s = BY_FLAG[flag]
        value = parse_value(s, str(given), f"{flag} {given}")
        if s.name in cli and values[s.name] != value:
            raise BadInputError(f"{flag} {given} and rl_tpu.{s.name}={cli[s.name]} disagree: give one of them")
        values[s.name] = value
    return RlTpuSettings(**values)


def _deprecated(env: str, instead: str) -> None:
    print(
        f"[rl-tpu] warning: {env} is deprecated and will be removed; use {instead} (a job config key)",
        file=sys.stderr,
        flush=True,
    )


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """VeRL overrides from the deprecated variables of mirrored settings (``RL_TPU_SHARED_PREFIX=0`` ->
    ``{"actor_rollout_ref.actor.use_prefix_grouper": "false"}``), each with its warning. They rank above the
    backend's defaults and below ``--config`` and the command line, as every alias does.

    Raises:
        BadInputError: a value that is not true / false.
    """
    environ = os.environ if environ is None else environ
    out = {}
    for s in SETTINGS:
        if s.mirrors and s.env and environ.get(s.env, "").strip():
            value = parse_value(s, environ[s.env], f"{s.env}={environ[s.env]!r}")
            _deprecated(s.env, f"{s.mirrors}={str(value).lower()}")
            out[s.mirrors] = str(value).lower()
    return out


def mirror_from_config(settings: "RlTpuSettings", config) -> "RlTpuSettings":
    """``settings`` with each mirrored setting copied from the composed VeRL ``config`` (an OmegaConf mapping)."""
    from dataclasses import replace

    from omegaconf import OmegaConf

    updates = {}
    for s in SETTINGS:
        if s.mirrors:
            value = OmegaConf.select(config, s.mirrors, default=s.default)
            updates[s.name] = parse_value(s, str(value), s.mirrors) if s.type is bool else value
    return replace(settings, **updates)


def as_dict(settings: "RlTpuSettings") -> dict[str, Any]:
    """``{name: value}`` in table order (for ``config.yaml``, ``--print-config`` and the record)."""
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


def record(settings: "RlTpuSettings") -> str:
    """The serialised record workers load (:func:`current`): compact JSON of every setting."""
    return json.dumps(as_dict(settings), sort_keys=True, separators=(",", ":"))


def digest(text: str) -> str:
    """A short fingerprint of a record (12 hex digits), logged by the driver and by each worker that loads it."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class SettingsMissingError(RuntimeError):
    """A worker of an rl-tpu job found no settings record in its environment (start jobs with ``verl train``)."""


_LOADED: tuple[str, Any] | None = None


def current() -> "RlTpuSettings":
    """The settings record this process was started with (``$RL_TPU_SETTINGS``, set by ``verl train`` in the job's
    ``runtime_env``), parsed once per record.

    Raises:
        SettingsMissingError: no record: this process was not started by a ``verl train`` job.
        BadInputError: a record that does not parse as the settings table.
    """
    global _LOADED
    text = os.environ.get(RECORD_ENV)
    if not text:
        raise SettingsMissingError(
            f"no rl-tpu settings record (${RECORD_ENV}) in this process: rl-tpu's engine and rollout run inside a "
            "job started by `verl train`, which delivers it to every Ray worker with the job's runtime_env"
        )
    if _LOADED is not None and _LOADED[0] == text:
        return _LOADED[1]
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInputError(f"${RECORD_ENV} is not a settings record ({exc.msg})") from None
    settings = from_mapping(raw, f"${RECORD_ENV}")
    _LOADED = (text, settings)
    return settings


def from_mapping(raw: Mapping[str, Any], where: str) -> "RlTpuSettings":
    """An already resolved ``rl_tpu:`` section (the record's JSON, or the composed config's ``rl_tpu`` mapping that
    ``verl train`` writes with :func:`as_dict`) as :class:`RlTpuSettings`, each value checked by :func:`parse_value`;
    a key left out takes its default.

    Args:
        raw: ``{name: value}`` (a plain mapping; an OmegaConf one is converted first).
        where: where it came from, for the errors (``"$RL_TPU_SETTINGS"``, ``"config rl_tpu"``).

    Raises:
        BadInputError: an unknown name (the driver and this process run different rl-tpu versions), or a value of
            the wrong type or out of range.
    """
    if not isinstance(raw, dict):
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(raw, DictConfig):
                raw = OmegaConf.to_container(raw, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf comes with VeRL
            pass
    unknown = set(raw) - set(BY_NAME)
    if unknown:
        raise BadInputError(
            f"{where} names unknown setting(s) {sorted(unknown)}: the driver and this worker "
            "run different rl-tpu versions"
        )
    return RlTpuSettings(**{n: parse_value(BY_NAME[n], v, where) for n, v in raw.items()})


# --- the sections: what each process entry point hands down as parameters (torchtitan-style component configs).
# The entry point reads the job's record once (:func:`current`) and builds its section with one function; nothing
# below it reads the record (tests/verl_backend/test_settings_reads.py fails when a module does). A section's fields
# are table settings, declared in :data:`SETTINGS` only (name, type, default, help), plus what the section derives.


def _section(name: str, keys: tuple[str, ...], doc: str, derived: tuple[tuple[str, type, Any, str], ...] = ()):
    """A frozen dataclass ``name`` whose fields are the table settings ``keys`` (their types and defaults from
    :data:`SETTINGS`) followed by ``derived`` ``(name, type, default, help)`` fields; its docstring is ``doc`` with
    one attribute line per field, from the settings' help."""
    specs = [(k, BY_NAME[k].type, _default(BY_NAME[k].default)) for k in keys]
    specs += [(n, t, field(default=d)) for n, t, d, _ in derived]
    cls = make_dataclass(name, specs, frozen=True)
    cls.__module__ = __name__
    lines = [f"        {k}: ``rl_tpu.{k}``: {BY_NAME[k].help}." for k in keys]
    lines += [f"        {n}: {h}" for n, _, _, h in derived]
    cls.__doc__ = f"{doc}\n\n    Attributes:\n" + "\n".join(lines)
    return cls


def _section_of(cls, settings: "RlTpuSettings", **derived):
    """``cls``'s section of the job's ``settings``: each table field copied, the ``derived`` ones given."""
    return cls(**{f.name: getattr(settings, f.name) for f in fields(cls) if f.name not in derived}, **derived)


EngineSettings = _section(
    "EngineSettings",
    (
        "shared_weights",
        "compile_trainer",
        "compile_backend",
        "compile_cache_dir",
        "trim_backward",
        "response_only_logits",
        "logits_chunk_mib",
        "shared_prefix",
        "plain_module",
        "num_threads",
    ),
    "The training engine's switches (built by :func:`engine_settings` in the engine's initialisation, "
    ":class:`verl_backend.workers.engine.RlTpuFSDPEngineWithLMHead`).",
)


def engine_settings(settings: "RlTpuSettings") -> "EngineSettings":
    """The engine's section of the job's ``settings``."""
    return _section_of(EngineSettings, settings)


RolloutSettings = _section(
    "RolloutSettings",
    ("shared_weights", "verify_weight_sync", "compile_sampler", "compile_backend", "compile_cache_dir", "job_seed"),
    "The native rollout's switches (built by :func:`rollout_settings` where a rollout starts: the replica's adapter "
    ":class:`verl_backend.rollout.adapter.NativeServerAdapter` and the server "
    ":class:`verl_backend.rollout.server.NativeRolloutServer`).",
    derived=(
        (
            "threads",
            int,
            0,
            "torch threads the rollout samples with: ``rl_tpu.rollout_num_threads``, else ``rl_tpu.num_threads`` "
            "(0: leave the process's count as it is).",
        ),
    ),
)


def rollout_settings(settings: "RlTpuSettings") -> "RolloutSettings":
    """The rollout's section of the job's ``settings``."""
    return _section_of(RolloutSettings, settings, threads=int(settings.rollout_num_threads or settings.num_threads))


WeightSyncSettings = _section(
    "WeightSyncSettings",
    ("shared_weights", "verify_weight_sync", "rollout_slice"),
    "The ``gloo`` checkpoint engine's switches (built by :func:`weight_sync_settings` in the engine's construction, "
    ":class:`verl_backend.weight_sync.gloo_engine.GlooCheckpointEngine`).",
)


def weight_sync_settings(settings: "RlTpuSettings") -> "WeightSyncSettings":
    """The ``gloo`` checkpoint engine's section of the job's ``settings``."""
    return _section_of(WeightSyncSettings, settings)


# --- the command line: each setting with a flag is an option of `verl train`, declared by its Setting


def flag_dest(flag: str) -> str:
    """argparse's attribute name for ``flag`` (``--num-threads`` -> ``num_threads``)."""
    return flag.lstrip("-").replace("-", "_")


def flag_options() -> list[tuple[str, dict[str, Any]]]:
    """``(flag, argparse keyword arguments)`` for every setting with a flag, in table order: a ``bool`` is a switch
    that sets it true, a setting with choices takes one of them; each help says which key it is a shortcut for.
    A flag not given parses as ``None`` (the key's own precedence then decides: :func:`resolve`)."""
    out = []
    for s in SETTINGS:
        if not s.flag:
            continue
        kwargs: dict[str, Any] = {"default": None, "help": f"{s.help} (shortcut for rl_tpu.{s.name})"}
        if s.type is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = s.type
            if s.choices:
                kwargs["choices"] = list(s.choices)
            if s.metavar:
                kwargs["metavar"] = s.metavar
        out.append((s.flag, kwargs))
    return out


def given_flags(args) -> dict[str, Any]:
    """``{flag: value}`` of the parsed ``verl train`` arguments ``args`` for every setting's flag (``None``: not
    given), for :func:`resolve`'s ``flags``."""
    return {s.flag: getattr(args, flag_dest(s.flag), None) for s in SETTINGS if s.flag}


def help_table(width: int = 118) -> str:
    """The table as ``--help`` prints it: ``rl_tpu.<name>=<default>  [choices] help (env alias, flag)``."""
    lines = []
    for s in SETTINGS:
        default = (
            ""
            if s.default in (None, "")
            else json.dumps(s.default)
            if s.type is dict
            else str(s.default).lower()
            if s.type is bool
            else s.default
        )
        extra = [
            x
            for x in (
                f"choices: {'|'.join(s.choices)}" if s.choices else "",
                f"flag {s.flag}" if s.flag else "",
                "changes the checkpoint format" if s.checkpoint_format else "",
                f"was ${s.env}" if s.env else "",
            )
            if x
        ]
        text = f"  rl_tpu.{s.name}={default}"
        lines.append(f"{text:<38}{s.help}" + (f" ({'; '.join(extra)})" if extra else ""))
    return "\n".join(lines)


def settings_markdown() -> str:
    """``docs/settings.md``: the precedence rules and one row per :data:`SETTINGS` entry (key, default, type and
    allowed values, flag, who reads it, what it does). ``python -m verl_backend.settings > docs/settings.md``
    regenerates the page; ``tests/verl_backend/test_settings.py`` fails when the two differ."""

    def default(s: Setting) -> str:
        if s.default in (None, ""):
            return "(none)"
        return json.dumps(s.default) if s.type is dict else str(s.default).lower() if s.type is bool else str(s.default)

    def kind(s: Setting) -> str:
        if s.choices:
            return " \\| ".join(f"`{c}`" for c in s.choices)
        text = {dict: "mapping (JSON)"}.get(s.type, s.type.__name__)
        return text + (f" ≥ {s.minimum:g}" if s.minimum is not None else "")

    rows = ["| key | default | type | flag | read by | what it does |", "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        notes = [
            x
            for x in (
                "changes the checkpoint format" if s.checkpoint_format else "",
                f"follows VeRL's `{s.mirrors}`" if s.mirrors else "",
                f"deprecated alias `${s.env}`" if s.env else "",
            )
            if x
        ]
        what = s.help.replace("|", "\\|") + (f" ({'; '.join(notes)})" if notes else "")
        rows.append(
            f"| `rl_tpu.{s.name}` | `{default(s)}` | {kind(s)} | {f'`{s.flag}`' if s.flag else ''} | "
            f"{s.reader} | {what} |"
        )
    intro = [
        "# rl-tpu's settings: the `rl_tpu:` section of the job config",
        "",
        "<!-- generated by `python -m verl_backend.settings > docs/settings.md` from verl_backend/settings.py; "
        "a test fails when they differ -->",
        "",
        "rl-tpu's own behaviour settings are keys of the job config's `rl_tpu:` section, given on the command line",
        "(`rl_tpu.plain_module=false`) or in the `--config` YAML (`rl_tpu:` then `plain_module: false`). Precedence,",
        "highest first: the command line (a flag is its key's shortcut; the two may not disagree), "
        "the `--config` file,",
        "an `RL_TPU_*` environment variable of the `verl` process (deprecated: it warns and names the key), "
        "the default.",
        "They are checked once, before anything starts (one line naming a bad key or value), printed by",
        "`verl train --print-config` and `verl train --help`, and written into the run's `config.yaml`. "
        "The driver hands",
        "them to every Ray worker of the job, on every host, as one record in the job's `runtime_env`; a worker never",
        'reads its own environment for them, and a worker without the record refuses to run. "read by": `driver` (the',
        "`verl train` process only) or `workers` (inside the Ray workers, from the record).",
        "",
        "Everything else is VeRL's own Hydra keys (`verl train --print-config` shows the composed config).",
        "",
    ]
    return "\n".join(intro + rows) + "\n"


if __name__ == "__main__":  # python -m verl_backend.settings > docs/settings.md
    print(settings_markdown(), end="")
