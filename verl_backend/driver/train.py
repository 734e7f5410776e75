"""``verl train``: resolve the settings, plan the job, check it, prepare its run folder and data, run VeRL."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from verl_backend import settings as job_settings
from verl_backend.driver.bypass_guard import guard_bypass
from verl_backend.driver.console import StepLines, capture, job_line
from verl_backend.driver.data_prep import prepare_data, validate_data_files
from verl_backend.driver.export_step import check_export
from verl_backend.driver.memory_fit import check_memory_fits, fit_packed_weights, show_memory_plan
from verl_backend.driver.plan import (
    compose_config,
    DEFAULT_MICRO_KEYS,
    drop_replaced_micro_batches,
    fit_default_micro_batches,
    flatten_yaml_overrides,
    guard_user_reward,
    merge_overrides,
    model_path_overrides,
    normalized_path,
    slice_defaults,
    split_rl_tpu,
)
from verl_backend.driver.preflight import (
    check_adv_estimator,
    check_batch_sizes,
    check_native_rollout,
    check_prompt_lengths,
    check_user_reward,
    check_whole_numbers,
    fit_epochs_to_steps,
)
from verl_backend.driver.preflight_async import (
    check_rollout_slice_config,
    check_trainer_mode,
    rollout_slice_keys,
)
from verl_backend.driver.profiles import default_threads, profile
from verl_backend.driver.run_folder import lock_run_folder, prepare_run_folder
from verl_backend.driver.runner import (
    fork_server_here,
    job_runtime_env,
    run_with_restarts,
)
from verl_backend.errors import BadInputError
from verl_backend.models import cache_root


def run_train(args) -> int:
    """``verl train``: check and compose the config, then run VeRL's trainer (see the README)."""
    from contextlib import ExitStack

    # the fork server started for this run (verl_backend.host_memory.fork_server), stopped whatever happens
    fork_server: dict = {}
    try:
        with ExitStack() as console_capture:  # the run's console and train.log (driver/console.py)
            return _run_train(args, fork_server, console_capture)
    finally:
        if fork_server.get("pid"):
            from verl_backend.host_memory.fork_server import stop

            stop(fork_server["pid"])


def _keys(overrides: list[str]) -> set[str]:
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


@dataclass
class _Job:
    """What the driver has read off the command line, the ``--config`` file and the backend's profile, before VeRL
    composes the config: the backend, the resolved settings, the user's overrides and the merged list."""

    backend: Any
    settings: Any
    config_path: str | None
    file_overrides: list[str]
    cli_overrides: list[str]
    #: the rl_tpu keys the user gave (command line or file): the profile's own settings go under them
    given: set[str]
    #: VeRL keys the user gave (file or command line), and on the command line alone
    user_keys: set[str] = field(default_factory=set)
    cli_keys: set[str] = field(default_factory=set)
    slice_keys: dict[str, str] = field(default_factory=dict)
    slice_from: str = ""
    rollout_keys: dict[str, str] = field(default_factory=dict)
    merged: list[str] = field(default_factory=list)
    #: ``{key: value}`` of :attr:`merged`
    keys: dict[str, str] = field(default_factory=dict)


def _run_train(args, fork_server: dict, console_capture) -> int:
    """``verl train`` in order: the job's settings, its overrides, its run folder (and console and fork server),
    the composed config and its checks, then ``--aot-only``, ``--print-config`` or the run itself."""
    job = _resolve_settings(args)
    _merge_overrides(args, job)
    job.settings = _apply_threads(job.backend, job.settings, job.keys)
    out = _run_folder(args, job.keys)
    if job.settings.compile_backend == "tpu-on-cpu" and not job.settings.compile_cache_dir:
        job.settings = replace(job.settings, compile_cache_dir=str(out / "tpu-on-cpu"))
    console = None
    if not args.print_config:
        if not getattr(args, "aot_only", False):  # --aot-only prints its own report, nothing else runs
            # from here on the terminal shows what driver/console.py lets through; everything goes to train.log
            verbose = bool(getattr(args, "verbose", False)) or os.environ.get("VERL_TRAIN_VERBOSE") == "1"
            console = console_capture.enter_context(capture(out / "train.log", verbose=verbose))
            console_capture.callback(_stop_ray)  # before the capture ends: Ray forwards workers' lines until it stops
        fork_server_here(job.backend, fork_server, job.settings)  # first: while this process has one thread, no Ray
        if console is not None:
            console.pump()
        lock_run_folder(out)
    config = _compose_and_check(args, job, out)
    settings = job.settings
    if getattr(args, "aot_only", False):  # the job's graphs lowered and compiled for the slice's chip, no chip here
        from verl_backend.driver.aot.job import run_aot_only

        return run_aot_only(
            config,
            settings.slice,
            model_path=getattr(args, "aot_model_path", None),
            all_buckets=getattr(args, "aot_all_buckets", False),
        )
    if args.print_config:
        return _print_config(config, job)
    _check_before_run(config, job)
    return _run(args, config, job, out, fork_server, console)


def _resolve_settings(args) -> _Job:
    """The job's backend and settings: VeRL's versions checked, the backend's profile (its platform set for VeRL
    before anything imports it), the ``--config`` file's and the command line's overrides split into VeRL's and
    ``rl_tpu.*``, resolved (:func:`verl_backend.settings.resolve`), the TPU dry run's profile when asked, the
    profile's settings under the user's, its host settings in place, the model cache as this host sees it.

    Raises:
        BadInputError: a bad setting, flag or ``--max-restarts``, or a backend that cannot run here.
    """
    from verl_backend.patches import check_versions

    check_versions()  # one line for a VeRL (or TransferQueue) outside the range rl-tpu's patches were tested with
    backend = profile(args.backend)
    if not (backend.tpu_runtime and args.print_config):  # a dry run composes the TPU config without a chip
        backend.check()
    # The platform must be chosen before VeRL is imported anywhere in this process or its workers.
    os.environ["VERL_PLATFORM"] = backend.platform
    if int(getattr(args, "max_restarts", 0) or 0) < 0:
        raise BadInputError(f"--max-restarts {args.max_restarts}: give 0 (no restart) or more")
    config_path = args.config or backend.default_config
    file_overrides, file_ours = flatten_yaml_overrides(config_path) if config_path else ([], {})
    cli_overrides, cli_ours = split_rl_tpu(list(args.overrides))
    if "task" in cli_ours and "task_config" not in cli_ours and cli_ours["task"] != file_ours.get("task"):
        file_ours = {k: v for k, v in file_ours.items() if k != "task_config"}  # belongs to the file's task
    settings = job_settings.resolve(
        cli_ours, file_ours, file_name=f"--config {config_path}", flags=job_settings.given_flags(args)
    )
    backend, settings = _tpu_dry_run(backend, settings, args)
    given = set(cli_ours) | set(file_ours)  # the profile's own settings, under the user's
    settings = replace(
        settings,
        **{k: v for k, v in backend.settings.items() if k not in given},
        # the folder as this host sees it: workers on other hosts convert the default model to this very path
        model_cache=str(cache_root(settings.model_cache)),
    )
    settings = _apply_profile(backend, settings)
    file_overrides, cli_overrides = guard_user_reward(file_overrides), guard_user_reward(cli_overrides)
    return _Job(backend, settings, config_path, file_overrides, cli_overrides, given)


def _merge_overrides(args, job: _Job) -> None:
    """The job's VeRL overrides in precedence order, into ``job``: the backend's defaults (less the micro batches
    the user replaced), the deprecated aliases of VeRL keys, the slice's keys (``--slice``: one worker per chip;
    ``rl_tpu.rollout_slice``: VeRL's standalone rollout pool, checked against the cluster now), then the file's and
    the command line's; ``job.settings.slice`` as resolved.

    Raises:
        BadInputError: a slice on a backend that takes none, a slice the cluster cannot give.
    """
    backend, settings = job.backend, job.settings
    job.user_keys, job.cli_keys = _keys(job.file_overrides + job.cli_overrides), _keys(job.cli_overrides)
    user = {o.split("=", 1)[0].lstrip("+~"): o.partition("=")[2] for o in job.file_overrides + job.cli_overrides}
    defaults = drop_replaced_micro_batches(dict(backend.overrides), user)
    defaults.update(job_settings.env_overrides())  # deprecated aliases of VeRL keys: above defaults, below the rest
    job.slice_from = (
        f"--slice {args.slice}"
        if getattr(args, "slice", None)
        else f"the TPU dry run's fake slice {settings.slice}"
        if settings.tpu_dry_run and settings.slice == backend.default_slice
        else f"rl_tpu.slice={settings.slice}"
        if settings.slice
        else "$TPU_ACCELERATOR_TYPE"
    )
    if backend.slices == "auto" or (backend.slices == "dry_run" and settings.slice):
        # cpu + --slice: a dry run of a TPU job's placement on a (fake) slice, one CPU worker per chip
        job.slice_keys, resolved_slice = slice_defaults(
            settings.slice, "--slice" if getattr(args, "slice", None) else "rl_tpu.slice"
        )
        job.settings = replace(settings, slice=resolved_slice)
        defaults.update(job.slice_keys)
    elif settings.slice:
        raise BadInputError(
            f"rl_tpu.slice (--slice) applies to --backend tpu (or cpu, as a dry run), not {backend.name}"
        )
    # a rollout slice of its own: checked against the cluster now, then VeRL's standalone rollout pool (separate_async)
    job.rollout_keys = rollout_slice_keys(job.settings.rollout_slice, job.settings.slice, backend.slices)
    defaults.update(job.rollout_keys)
    job.merged = [normalized_path(o) for o in merge_overrides(defaults, job.file_overrides, job.cli_overrides)]
    job.keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in job.merged}


def _compose_and_check(args, job: _Job, out: Path):
    """VeRL's composed config for the job (the model path, the built-in data and the run folder's directories
    added where the user gave none), with the checks that need it: whole numbers, the advantage estimator, the
    micro batches fitted to the workers, the bypass guard, batch sizes, the rollout slice, the trainer mode, the
    packed weights' fit on this host. The resolved settings (the mirrored keys copied in) go in its ``rl_tpu``.

    Raises:
        BadInputError: one line for the first check that fails.
    """
    backend, keys, settings = job.backend, job.keys, job.settings
    extra = model_path_overrides(keys, settings.model_cache) + prepare_data(keys, settings, out)
    if "trainer.default_local_dir" not in keys:
        extra.append(f"trainer.default_local_dir={out / 'checkpoints'}")
    for key, folder in (("trainer.validation_data_dir", "validation"), ("trainer.rollout_data_dir", "rollouts")):
        if key not in keys:  # per-item scores: the accuracy interval (report.py) and the step lines' accuracy
            extra.append(f"{key}={out / folder}")
    config = compose_config(job.merged + extra)
    check_whole_numbers(config)
    check_adv_estimator(config)  # fed by VeRL 0.9.1's V1 trainer, or one line
    default_config = backend.default_config or profile("cpu").default_config
    if job.config_path and Path(job.config_path).resolve() == Path(default_config).resolve():
        # the embedded default (--backend cpu's, and the dry run's), also when given to --aot-only as --config: the
        # TPU dry run and `--backend tpu --aot-only --config <it>` are then the same job (aot/graphs.json)
        fit_default_micro_batches(config, job.cli_keys)
    elif any(key in backend.overrides for key in DEFAULT_MICRO_KEYS):  # the TPU profile's, under the user's keys
        fit_default_micro_batches(config, job.user_keys, "the TPU profile's default")
    guard_bypass(config, job.user_keys)
    from_slice = job.slice_keys and all(keys.get(k) == v for k, v in job.slice_keys.items())
    check_batch_sizes(config, workers_from=job.slice_from if from_slice else "")
    check_rollout_slice_config(config, settings.rollout_slice, job.rollout_keys, job.user_keys)
    check_trainer_mode(config)  # separate_async's requirements (VeRL 0.9.1) we do not meet: one line each
    said = fit_packed_weights(config, backend)  # a CPU job that fits only without the rollout's packed copies
    if said:  # --print-config's stdout stays YAML
        print(said, flush=True, file=sys.stderr if args.print_config else sys.stdout)
    from omegaconf import open_dict

    job.settings = job_settings.mirror_from_config(settings, config)
    with open_dict(config):
        config.rl_tpu = job_settings.as_dict(job.settings)  # printed, saved in config.yaml; workers get the record
    return config


def _print_config(config, job: _Job) -> int:
    """``--print-config``: the composed config as YAML, the per-chip memory plan under it (driver/memory_fit.py)
    and each rollout replica's weight-sync route; 0."""
    from omegaconf import OmegaConf

    from verl_backend.rollout.native_kwargs import native_engine_kwargs
    from verl_backend.weight_sync import plan_routes

    settings, backend = job.settings, job.backend
    print(OmegaConf.to_yaml(config))
    show_memory_plan(config, settings.slice, backend)
    placement = native_engine_kwargs(config.actor_rollout_ref.rollout).sampler_placement
    routes = plan_routes(
        config,
        cpu=backend.platform == "cpu",
        shared_weights=bool(settings.shared_weights),
        rollout_slice=settings.rollout_slice or None,
        placement=placement,
    )
    print(routes)  # each replica's route
    return 0


def _check_before_run(config, job: _Job) -> None:
    """The checks a run needs and ``--print-config`` does not: memory against the slice or host, the data files,
    prompt lengths, the user's reward function and estimator, the native rollout's keys, the compiled trainer's
    padded micro batches, the export's settings; then the epochs fitted to the steps.

    Raises:
        BadInputError: one line for the first check that fails.
    """
    backend, settings = job.backend, job.settings
    check_memory_fits(config, settings.slice, backend)  # a TPU job past its chips' HBM stops here, one line
    validate_data_files(config, job.keys)
    check_prompt_lengths(config)
    check_user_reward(config)
    check_adv_estimator(config, before_run=True)  # after the user's file: it may register its own
    check_native_rollout(config)
    if settings.compile_trainer:  # bounded graphs need one shape of micro batch
        from rl_tpu.compiled_blocks import refusal

        reason = refusal(bool(config.actor_rollout_ref.model.get("use_remove_padding", False)), backend.name)
        if reason and "compile_trainer" in backend.settings and "compile_trainer" not in job.given:
            reason += (
                f"; the {backend.name} profile turned rl_tpu.compile_trainer on: rl_tpu.compile_trainer=false "
                "runs the blocks eagerly"
            )
        if reason:
            raise BadInputError(reason)
    if settings.compile_backend == "tpu-on-cpu":
        _check_tpu_on_cpu(backend.name, settings)
    check_export(settings, config)
    fit_epochs_to_steps(config)


def _check_tpu_on_cpu(backend_name: str, settings) -> None:
    """``rl_tpu.compile_backend=tpu-on-cpu`` runs TorchTPU's graphs on the host's CPU: only with ``--backend cpu``,
    and only with torch-tpu in ``.venv-aot``.

    Raises:
        BadInputError: another backend, or no torch-tpu.
    """
    from verl_backend.tpu_on_cpu import aot_python_path

    if backend_name != "cpu":
        raise BadInputError(
            f"rl_tpu.compile_backend=tpu-on-cpu executes TorchTPU's graphs on XLA:CPU: use it with --backend cpu "
            f"(--tpu-dry-run), not --backend {backend_name}, whose compile backend is its device's"
        )
    if aot_python_path() is None:
        raise BadInputError(
            "rl_tpu.compile_backend=tpu-on-cpu needs torch-tpu 0.2.0 in .venv-aot: make it with .ci/aot_venv, or "
            "leave rl_tpu.compile_backend=device"
        )


def _run(args, config, job: _Job, out: Path, fork_server: dict, console) -> int:
    """The run: the run folder and the job's runtime_env prepared, ``config.yaml`` saved, VeRL's trainer run with
    restarts (the TPU dry run's compile check beside it), the report written, then the export. Returns the exit
    code: 0, or :data:`~verl_backend.driver.export_step.EXPORT_FAILED` when the export failed."""
    import gc

    from omegaconf import OmegaConf

    from verl_backend.driver.report import write_report
    from verl_backend.host_memory.heap import trim_host_heap

    settings = job.settings
    prepare_run_folder(config, out)
    job_runtime_env(config, out, settings, fork_server)
    OmegaConf.save(config, out / "config.yaml")
    gc.collect()  # what set-up read (data checks, tokenizer) is not needed while the driver waits on Ray
    trim_host_heap()
    console.say(job_line(config, job.backend.name, settings.num_threads, out))
    tpu_compile = _start_dry_run_compile(config, settings, out, console)
    if settings.tpu_dry_run and settings.compile_backend != "tpu-on-cpu":
        how = "compiled by inductor" if settings.compile_trainer or settings.compile_sampler else "as torch eager"
        console.say(
            f"[rl-tpu] TPU dry run: the model runs {how} on CPU, not as TorchTPU's graphs ("
            + ("rl_tpu.compile_backend=device" if aot_python_here() else "torch-tpu not installed: .ci/aot_venv")
            + ")"
        )
    if settings.num_threads:  # this process runs VeRL's TaskRunner (rl_tpu.task_runner=driver, the default)
        from rl_tpu.device import set_num_threads

        set_num_threads(settings.num_threads)
    start = time.time()
    rollouts = config.trainer.get("rollout_data_dir")
    with StepLines(
        out / "metrics.jsonl",
        config.trainer.total_training_steps,
        console.say,
        rollouts=Path(rollouts) if rollouts else None,
    ):
        run_with_restarts(
            config, max_restarts=int(getattr(args, "max_restarts", 0) or 0), task_runner=settings.task_runner
        )
    validation = config.trainer.get("validation_data_dir")
    summary = write_report(out, wall_s=time.time() - start, validation_dir=Path(validation) if validation else None)
    console.say(summary)
    if tpu_compile is not None:  # never a failure of the run: compiled, skipped or failed, in one line
        from verl_backend.driver.aot.dry_run import compile_line, record

        if tpu_compile.running:
            console.say("[rl-tpu] TPU compile check: waiting for the lowering and compile subprocesses")
        entry = tpu_compile.finish()
        record(out, entry)
        console.say(compile_line(entry))
    if settings.compile_backend == "tpu-on-cpu":
        _report_executed_graphs(config, settings, out, console, since=start)
    if settings.export:  # train, then ship: the final checkpoint through litert export (driver/export_step.py)
        return _export(config, out, settings, console)
    return 0


def aot_python_here() -> bool:
    from verl_backend.tpu_on_cpu import aot_python_path

    return aot_python_path() is not None


def _report_executed_graphs(config, settings, out: Path, console, since: float = 0.0) -> None:
    """With ``rl_tpu.compile_backend=tpu-on-cpu``: the graphs the run's processes executed, counted and set against
    the job's bucket plan (:func:`verl_backend.driver.aot.executed.executed_entry`), and a step estimated on the
    slice's chip from them (:func:`verl_backend.driver.aot.executed.step_estimate`) beside the CPU step measured
    here, into ``summary.json`` as ``tpu_on_cpu`` and two console lines; ``since``: the run's start (seconds since the
    epoch), the stats of processes that wrote before it left out. Never a failure of the run."""
    from verl_backend.driver.aot.dry_run import record
    from verl_backend.driver.aot.executed import executed_entry, read_stats, step_estimate
    from verl_backend.driver.job_shape import job_shape
    from verl_backend.driver.model_shape import shape_of_path
    from verl_backend.driver.report import read_metrics

    folder = Path(settings.compile_cache_dir)
    job = job_shape(config, settings=settings)
    entry = executed_entry(folder, job, since)
    console.say(f"[rl-tpu] TPU graphs (tpu-on-cpu): {entry['line']}")
    steps = [r["data"].get("timing_s/step") for r in read_metrics(out / "metrics.jsonl")]
    steps = [float(t) for t in steps if isinstance(t, (int, float))]
    cpu_s = sum(steps) / len(steps) if steps else None
    try:
        if not settings.slice:
            raise ValueError("no slice to estimate for (rl_tpu.slice; the TPU dry run's default is v6e-4)")
        params = shape_of_path(job.model_path, job.trust_remote_code).params
        estimate = step_estimate(folder, read_stats(folder, since), job, settings.slice, max(1, len(steps)), params)
    except Exception as exc:  # a report, never a failure of the run that trained
        estimate = {"error": (str(exc).splitlines() or [type(exc).__name__])[0][:300]}
    estimate["cpu_step_s"] = cpu_s
    entry["step_estimate"] = estimate
    if estimate.get("step_s") is not None:
        coll = estimate["collectives_s"]
        line = (
            f"{settings.slice} ({estimate['generation']}): {1e3 * estimate['step_s']:.2f} ms a step = graphs "
            f"{1e3 * estimate['graphs_s']:.2f} ms at their libtpu roofline bounds + FSDP2 collectives "
            + (f"{1e3 * coll:.2f} ms over ICI" if coll is not None else "(no ICI figure for this chip)")
            + "; eager ops between graphs not counted; measured here on CPU: "
            + (f"{cpu_s:.1f} s a step" if cpu_s is not None else "n/a")
        )
        if estimate.get("error"):
            line += f"; a graph libtpu could not compile: {estimate['error']}"
    else:
        line = f"not estimated: {estimate.get('error')}"
    estimate["line"] = line
    record(out, entry, "tpu_on_cpu")
    console.say(f"[rl-tpu] TPU step estimate: {line}")


def _start_dry_run_compile(config, settings, out: Path, console):
    """With ``rl_tpu.tpu_dry_run``: the same job's graphs lowered and compiled for the fake slice's chip beside the
    training (:class:`~verl_backend.driver.aot.dry_run.DryRunCompile`), started and said; else ``None``."""
    if not settings.tpu_dry_run:
        return None
    from verl_backend.driver.aot.dry_run import DryRunCompile

    tpu_compile = DryRunCompile(config, settings.slice, out, enabled=settings.tpu_dry_run_compile).start()
    if tpu_compile.running:
        console.say(
            f"[rl-tpu] TPU compile check: lowering {tpu_compile.folder / 'graphs.json'}'s graphs with "
            f"TorchTPU and compiling them for {settings.slice} with libtpu, beside the training"
        )
    return tpu_compile


def _stop_ray() -> None:
    """End this job's Ray (started by VeRL's ``run_ppo``), if it did start, so that no worker line Ray still forwards
    reaches the terminal after the console's capture (it would at exit otherwise)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _export(config, out: Path, settings, console) -> int:
    """Export the final checkpoint (``rl_tpu.export``), record it in ``summary.json``; 0, or 3 when it failed."""
    import json

    from verl_backend.driver.export_step import (
        EXPORT_FAILED,
        export_final_checkpoint,
        export_lines,
    )

    entry = export_final_checkpoint(config, out, settings)
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary["export"] = entry
    tmp = path.with_name(".summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, path)
    for line in export_lines(entry):
        if entry["status"] == "written":
            console.say(line)
        else:  # the terminal's stderr, not the captured one
            console.error(f"verl: error: {line}")
    return 0 if entry["status"] == "written" else EXPORT_FAILED


def _tpu_dry_run(backend, settings, args):
    """``rl_tpu.tpu_dry_run``: the TPU profile on CPU devices (:func:`verl_backend.driver.profiles.tpu_dry_run`) on
    ``--slice`` or its default fake slice. Returns ``(backend, settings)``, unchanged when the setting is off.

    Raises:
        BadInputError: another backend than cpu, ``rl_tpu.compact_malloc`` (CPU host-memory machinery the TPU
            profile has not), a slice of one chip (the TPU profile's FSDP2 over several ranks), or a run with no
            Ray cluster to reserve the fake slice on (``$RAY_ADDRESS``).
    """
    if not settings.tpu_dry_run:
        return backend, settings
    from verl_backend.driver.profiles import tpu_dry_run

    backend = tpu_dry_run(backend)
    if settings.compact_malloc:
        raise BadInputError(
            "rl_tpu.compact_malloc=true is the CPU profile's host-memory setting; the TPU dry run "
            "(rl_tpu.tpu_dry_run) keeps the TPU profile's, which has none: drop one of them"
        )
    settings = replace(settings, slice=settings.slice or backend.default_slice)
    from rl_tpu.topology import TopologyError, parse_slice

    acc, _, topo = settings.slice.partition(":")
    try:
        chips = parse_slice(acc, topo or None).chips
    except TopologyError:
        chips = 2  # named by the slice check below, with the key the user gave
    if chips < 2:
        raise BadInputError(
            f"rl_tpu.tpu_dry_run on the slice {settings.slice} ({chips} chip): the dry run stands "
            "several gloo ranks in for chips; give --slice v6e-4 (the default) or another of 2 chips "
            "or more"
        )
    if not args.print_config and not os.environ.get("RAY_ADDRESS"):
        raise BadInputError(
            f"rl_tpu.tpu_dry_run (--tpu-dry-run) reserves the fake slice {settings.slice} on a Ray "
            f"cluster: start one with `rl-tpu cluster up --fake-slice {settings.slice.split(':')[0]}`, "
            "export the RAY_ADDRESS it prints (and RAY_AUTH_MODE=disabled), then run this again"
        )
    print(
        f"[rl-tpu] TPU dry run: the tpu profile's choices on CPU devices, {chips} gloo ranks on the fake slice "
        f"{settings.slice}",
        flush=True,
    )
    return backend, settings


def _apply_profile(backend, settings):
    """The settings as this backend takes them: TPU-only keys refused elsewhere, and the host malloc settings of
    ``rl_tpu.compact_malloc`` put in place for every process started from here on."""
    if not backend.tpu_runtime and settings.tpu_eager_mode != "strict":
        raise BadInputError(
            f"rl_tpu.tpu_eager_mode={settings.tpu_eager_mode} (--tpu-eager-mode) applies to "
            f"--backend tpu only, not {backend.name}"
        )
    if settings.compact_malloc and backend.host_memory:
        from verl_backend.host_memory.heap import host_malloc_env, tune_host_malloc

        os.environ.update(host_malloc_env())  # every process started from here on (Ray's, the workers)
        tune_host_malloc()  # this one, and the fork server forked from it (verl_backend.host_memory.fork_server)
    if settings.omp_wait_policy != "default":
        # read by OpenMP when torch loads: this process, the fork server started from it, and every worker (runner.py
        # puts it in the job's runtime_env)
        os.environ["OMP_WAIT_POLICY"] = settings.omp_wait_policy.upper()
    if not backend.tpu_runtime:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # skip TorchTPU's 5-20 s import hook
    return settings


def _apply_threads(backend, settings, keys: dict[str, str]):
    """``rl_tpu.num_threads`` resolved: the user's count, else the profile's default for this host's cores and the
    job's trainer workers (:func:`verl_backend.driver.profiles.default_threads`). It goes to every process by the
    settings record alone: each entry point sets torch's count from it (this process before VeRL runs, the engine's
    initialisation, the rollout server); no ``OMP_NUM_THREADS`` is set for it."""
    if not settings.num_threads:

        def count(key: str) -> int:  # an interpolation or a bad value: VeRL's own checks name it later
            try:
                return max(1, int(keys.get(key, 1)))
            except ValueError:
                return 1

        workers = count("trainer.n_gpus_per_node") * count("trainer.nnodes")
        settings = replace(
            settings, num_threads=default_threads(backend.default_threads, workers, len(os.sched_getaffinity(0)))
        )
    return settings


def _run_folder(args, keys: dict[str, str]) -> Path:
    """``--output-dir`` or ``outputs/<trainer.experiment_name>``, created.

    Raises:
        BadInputError: it is a file, or cannot be created.
    """
    experiment = keys.get("trainer.experiment_name", "grpo_smollm2").strip("\"'")
    out = Path(args.output_dir or Path("outputs") / experiment).resolve()
    what = "--output-dir" if args.output_dir else "run folder"
    if out.exists() and not out.is_dir():
        raise BadInputError(f"{what} {out} is a file, not a folder: give a folder path (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInputError(
            f"{what} {out}: cannot create it ({exc.strerror}); give a folder that can be written"
        ) from None
    return out
