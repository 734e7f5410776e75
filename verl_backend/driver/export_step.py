"""Train, then ship: ``rl_tpu.export`` (``verl train --export OUT``) runs ``litert export`` on the final checkpoint.

Checked before anything starts (:func:`check_export`): the output's suffix and folder, the ``export`` extra, and a
run that ends with a Hugging Face checkpoint to export. After training (:func:`export_final_checkpoint`), the
highest ``checkpoints/global_step_N/actor/huggingface`` goes through ``litert export`` in its own process (its memory
goes back when it ends; the checkpoint is only read): the file is verified through the LiteRT runtime, and a
``.litertlm`` bundle is also scored on the run's held-out items (``data.val_files``, greedy, at most
``data.max_response_length`` tokens) with the run's own reward function, through the LiteRT-LM runtime beside
PyTorch. The outcome goes into ``summary.json`` under ``export``; a failed export makes ``verl train`` exit 3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from verl_backend.errors import BadInputError

EXPORT_FAILED = 3  # verl train's exit status when the export of a finished run fails (litert export's own code)
SUFFIXES = (".litertlm", ".tflite")


def target_path(settings) -> Path | None:
    """``rl_tpu.export`` as an absolute path (relative to the current folder), or ``None`` when not asked for."""
    return Path(settings.export).expanduser().resolve() if settings.export else None


def check_export(settings, config) -> None:
    """Refuse, before training, an export that could not happen after it.

    Raises:
        BadInputError: one line naming the key (``rl_tpu.export`` / ``--export`` and the others) and the fix: a
            suffix other than .litertlm/.tflite, a folder that cannot be written, the ``export`` extra missing,
            ``rl_tpu.export_quantize`` / ``export_max_drop`` given without an export, a run that saves no final
            checkpoint (``trainer.save_freq`` ≤ 0) or no Hugging Face model in it (``checkpoint.save_contents``).
    """
    target = target_path(settings)
    if target is None:
        for key, default in (("export_quantize", "none"), ("export_max_drop", 5.0)):
            if getattr(settings, key) != default:
                raise BadInputError(
                    f"rl_tpu.{key}={getattr(settings, key)} applies to the export of the final "
                    "checkpoint: give rl_tpu.export=OUT.litertlm (--export) too, or drop it"
                )
        return
    what = f"rl_tpu.export={settings.export} (--export)"
    if target.suffix not in SUFFIXES:
        raise BadInputError(f"{what}: give a .litertlm (LiteRT-LM bundle, for the phone runtime) or .tflite path")
    if target.is_dir():
        raise BadInputError(f"{what} is a folder: give a file path ending in {target.suffix or '.litertlm'}")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK):
        raise BadInputError(f"{what}: {folder} cannot be written; give a path in a folder you can write")
    needed = ["litert_torch"] + (["litert_lm"] if target.suffix == ".litertlm" else [])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise BadInputError(
            f"{what} needs {', '.join(missing)}, from rl-tpu's export extra: pip install -e "
            "'.[export]' (or drop --export and run litert export on the checkpoint later)"
        )
    if int(config.trainer.save_freq) <= 0:
        raise BadInputError(
            f"{what}: trainer.save_freq={config.trainer.save_freq} saves no checkpoint to export; "
            "set trainer.save_freq to a positive number (the last step is then always saved)"
        )
    contents = list(config.actor_rollout_ref.actor.checkpoint.get("save_contents") or [])
    if "hf_model" not in contents:
        raise BadInputError(
            f"{what}: actor_rollout_ref.actor.checkpoint.save_contents={contents} has no hf_model, "
            "so the checkpoint holds no Hugging Face model to export; add hf_model to it"
        )


def scorer_for(config) -> str:
    """The run's reward function as a ``litert export --scorer`` name: the user's ``file.py:function``, the
    project's ``verl_backend.data.rewards:compute_score``, or VeRL's ``default_compute_score``."""
    custom = config.get("reward", {}).get("custom_reward_function", {}) or {}
    kwargs = custom.get("reward_kwargs") or {}
    if kwargs.get("user_fn_path"):  # the user's function, routed through guarded_score by verl train
        return f"{kwargs['user_fn_path']}:{kwargs.get('user_fn_name') or 'compute_score'}"
    path = str(custom.get("path") or "")
    if path.startswith("pkg://verl_backend.data.rewards"):
        return "verl_backend.data.rewards:compute_score"
    if path:
        return (
            f"{path.removeprefix('pkg://').replace('/', '.') if path.startswith('pkg://') else path}:"
            f"{custom.get('name') or 'compute_score'}"
        )
    return "verl.utils.reward_score:default_compute_score"


def write_heldout_items(config, path: Path) -> int:
    """Write the run's held-out items (``data.val_files``, VeRL's parquet rows) as ``litert export --eval`` JSONL.

    Each line: ``prompt`` (the row's message list), ``answer`` (``reward_model.ground_truth``), ``data_source`` and
    ``extra_info`` (for the reward function). Returns the number of items written.
    """
    import pandas as pd

    files = config.data.val_files
    files = [files] if isinstance(files, str) else list(files)
    rows = []
    for f in files:
        for record in pd.read_parquet(f).to_dict("records"):
            rows.append(
                {
                    "prompt": [dict(m) for m in record["prompt"]],
                    "answer": str(dict(record["reward_model"])["ground_truth"]),
                    "data_source": record.get("data_source", ""),
                    "extra_info": record.get("extra_info"),
                }
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(row, default=_plain) + "\n" for row in rows)
    os.replace(tmp, path)
    return len(rows)


def _plain(value):
    """numpy scalars and arrays from parquet rows, as JSON values."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def export_command(checkpoint: Path, target: Path, settings, config, eval_file: Path | None, threads: int) -> list:
    """The ``litert export`` command line for the final checkpoint (run with this Python)."""
    prompt_len, response_len = int(config.data.max_prompt_length), int(config.data.max_response_length)
    cache = max(256, -(-(prompt_len + response_len + 64) // 64) * 64)  # chat template tokens on top
    cmd = [
        sys.executable,
        "-m",
        "edge_export.cli",
        "export",
        str(checkpoint),
        "-o",
        str(target),
        "--quantize",
        settings.export_quantize,
        "--threads",
        str(threads),
        "--cache-length",
        str(cache),
    ]
    if eval_file is not None:
        cmd += [
            "--eval",
            str(eval_file),
            "--scorer",
            scorer_for(config),
            "--eval-max-tokens",
            str(response_len),
            "--max-drop",
            str(settings.export_max_drop),
        ]
    return cmd


def export_final_checkpoint(config, out: Path, settings) -> dict:
    """Export the run's final Hugging Face checkpoint to ``rl_tpu.export`` with ``litert export``.

    Returns:
        the ``summary.json`` entry: ``output``, ``quantize``, ``checkpoint``, ``status`` ("written" or "failed"),
        ``exit_code``, ``error`` (litert export's one line, on failure), ``log``, and from the report the
        verification's top-1 agreement and the held-out accuracies (%, runtime and PyTorch) with the item count.
    """
    from verl_backend.driver.report import latest_hf_checkpoint

    target = target_path(settings)
    entry: dict = {"output": str(target), "quantize": settings.export_quantize, "status": "failed"}
    checkpoint = latest_hf_checkpoint(out)
    if checkpoint is None:
        entry.update(
            exit_code=EXPORT_FAILED,
            error=f"no checkpoint with a Hugging Face model under {out / 'checkpoints'} to export",
        )
        return entry
    entry["checkpoint"] = str(checkpoint)
    folder = out / "export"
    folder.mkdir(parents=True, exist_ok=True)
    eval_file = None
    if target.suffix == ".litertlm":
        eval_file = folder / "heldout.jsonl"
        entry["eval_items"] = write_heldout_items(config, eval_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cmd = export_command(checkpoint, target, settings, config, eval_file, threads)
    entry["command"] = " ".join(cmd[2:]).replace("edge_export.cli", "litert", 1)
    log = folder / "export.log"
    entry["log"] = str(log)
    print(
        f"[rl-tpu] exporting {checkpoint} to {target} ({settings.export_quantize}): litert export, verified "
        f"through the LiteRT runtime{' and scored on the held-out items' if eval_file else ''}; its log: {log}",
        flush=True,
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)  # the training's one thread per process; litert export sets its own
    with open(log, "w") as fh:
        code = subprocess.run(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    lines = log.read_text(errors="replace").splitlines()
    entry["exit_code"] = code
    if code == 0:
        entry["status"] = "written"
    else:
        errors = [line for line in lines if line.startswith("litert export: error:")]
        entry["error"] = (
            errors[-1].removeprefix("litert export: error: ")
            if errors
            else (lines[-1] if lines else f"litert export exited {code} with no output")
        )
    report = Path(f"{target}.report.json")
    if code == 0 and report.is_file():
        found = json.loads(report.read_text())
        entry["report"] = str(report)
        check = found.get("verification") or {}
        if "top1_agreement" in check:
            entry["top1_agreement"] = check["top1_agreement"]
        if found.get("eval"):
            entry.update(
                runtime_accuracy=found["eval"]["runtime_accuracy"],
                torch_accuracy=found["eval"]["torch_accuracy"],
                scorer=found["eval"]["scorer"],
            )
    return entry


def export_lines(entry: dict) -> list[str]:
    """What ``verl train`` prints about the export (the last line of a failed one goes to stderr)."""
    if entry["status"] == "written":
        text = f"[rl-tpu] exported {entry['output']} ({entry['quantize']})"
        if "runtime_accuracy" in entry:
            text += (
                f": held-out accuracy through LiteRT-LM {entry['runtime_accuracy']:.1f}%, PyTorch "
                f"{entry['torch_accuracy']:.1f}% on {entry['eval_items']} items"
            )
        return [text]
    return [
        (
            f"export of the final checkpoint failed: {entry['error']}; the checkpoint "
            f"{entry.get('checkpoint', '')} is as it was; details in {entry.get('log', 'the run folder')}; after a "
            f"fix run: {entry.get('command', 'litert export CHECKPOINT -o OUT')}"
        )
    ]
