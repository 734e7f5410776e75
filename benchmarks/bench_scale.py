"""Scale: seconds per GRPO step, throughput and peak memory of ``verl train --backend cpu`` as the model grows.

One row per model, each trained ``--steps`` GRPO steps (default 3) by ``verl train --backend cpu`` on the embedded
default job (``verl_backend/configs/grpo_cpu.yaml``: reasoning-gym's ``basic_arithmetic``, 4 prompts x 8 samples =
32 responses a step, prompts <= 128 and responses <= 64 tokens, KL loss against a reference policy), with no
validation and no checkpoint (``trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1``), one
after the other, each in its own process tree (``--max-restarts 0``: an actor that dies ends the row).

Models: real widths and depths, random weights, the default tokenizer's vocabulary (nothing is downloaded):

- ``smollm2-135m``: the default model's config (``verl_backend.models.ensure_default_model``), random weights;
- ``smollm2-360m``: ``LlamaConfig``, hidden 960, MLP 2560, 32 layers, 15 heads, 5 KV heads, tied embeddings (the
  default model's config otherwise: RoPE, norm epsilon, positions);
- ``qwen3-0.6b``: ``Qwen3Config``, hidden 1024, MLP 3072, 28 layers, 16 heads, 8 KV heads, head_dim 128, tied;
- ``qwen3-1.7b``: ``Qwen3Config``, hidden 2048, MLP 6144, 28 layers, 16 heads, 8 KV heads, head_dim 128, tied;
- ``qwen3-tiny`` (``--tiny``, a smoke test of this script): hidden 64, MLP 128, 2 layers, 4 heads, 2 KV heads.

The default tokenizer's 49152-token vocabulary (not Qwen3's 151936) makes the Qwen3-shaped models 0.49 B and 1.51 B
parameters, not 0.6 B and 1.7 B: the blocks are the real ones, the embedding is smaller.

The synthetic ones are built once (in a subprocess, ``torch.manual_seed(0)``, transformers' own initialisation) into
``runs/scale/models/<name>`` with ``save_pretrained(safe_serialization=True)`` in the default model's dtype, the
default config's ``vocab_size`` and BOS/EOS/PAD ids, and the default folder's tokenizer files, chat template and
generation config copied beside them; a folder with a matching ``.bench_scale`` mark is reused.

Mode: ``verl train --backend cpu --print-config`` first (same overrides) gives the memory plan
(``verl_backend/driver/memory_plan.py``; ``memory_fit.py`` compares the whole job with 90% of this host's memory). Full
fine-tuning where it fits; where it does not, the full fine-tuning job is still started, and its one-line refusal
(``verl: error: memory plan: ...``, before any process starts) is the row ("refused: <line>"), then a LoRA row
(``actor_rollout_ref.model.lora_rank=R lora_alpha=2R target_modules=all-linear``, VeRL 0.9.1's keys, as in
``examples/lora_cpu.yaml``) follows. ``--mode full`` / ``--mode lora`` skip the choice.

Columns (means over steps 2..N of ``<run folder>/metrics.jsonl``, VeRL's own metrics; step 1 is warm-up):

- ``parameters``: counted on a meta-device model of the folder's ``config.json``
  (``verl_backend.driver.model_shape.shape_of_path``; tied embeddings once);
- ``mode``: ``full``, ``LoRA r<R>`` (trainable parameters: R x the blocks' sum of linear in+out widths), ``refused:``
  or ``failed:`` (the last ``verl: error`` line, or ``timeout after N s``);
- ``s/step``: ``timing_s/step``; ``rollout s``: ``timing_s/gen`` (generation and reward); ``log-prob s``:
  ``timing_s/old_log_prob + timing_s/ref``; ``update s``: ``timing_s/update_actor``; ``sync s``:
  ``timing_s/update_weights`` (trainer -> rollout); seconds;
- ``tokens/s``: response tokens per step / ``s/step``, response tokens = ``response_length/mean`` x responses
  (``data.train_batch_size`` x ``actor_rollout_ref.rollout.n``);
- ``peak PSS GiB``: the largest summed proportional set size of every process of the job (the driver, Ray's, every
  ``ray::`` worker) over the whole run, sampled every 0.5 s (``bench_grpo_step.MemorySampler``: a marker environment
  variable inherited by the job's processes, its own ``RAY_TMPDIR``); GiB = 2**30 bytes;
- ``plan GiB``: the plan's host need (the ``this host:`` line of ``--print-config``: trainer workers x the ``peak
  estimate`` line, plus the rollout server's own copy and every process's measured runtime);
- ``sync MB``: ``weight_sync/bytes`` / 1e6 (what the weight sync reports per step).

Scaling, after the table: update FLOP/s = 6 x N x T / ``update s``, N all the model's parameters, T tokens the update
runs through per step (``perf/total_num_tokens`` x ``ppo_epochs``: prompt and response tokens, no padding), 6N FLOPs
per token for a forward and backward (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
arXiv:2001.08361, §2.1: C ~ 6N per training token; attention's context term left out). With LoRA the frozen weights
get no weight gradient (about 4N), so its figure is an upper bound and the fit leaves it out. The exponents are
least-squares slopes of log(peak PSS) and log(update FLOP/s) on log(N) over the full fine-tuning rows.

Random weights never emit EOS: every response runs to the length cap (``response_length/clip_ratio`` ~ 1), which makes
this a cost measurement, not a learning one.

    python benchmarks/bench_scale.py [--models smollm2-135m smollm2-360m qwen3-0.6b qwen3-1.7b] [--steps 3]
        [--lora-rank 16] [--timeout-s 3600] [--threads 1] [--mode auto|full|lora] [--extra KEY=VALUE ...]
    python benchmarks/bench_scale.py --table            # reprint the table from runs/scale/scale.json
    python benchmarks/bench_scale.py --tiny             # smoke test: qwen3-tiny only, into runs/scale/smoke.json

Everything is written under ``runs/scale/`` (git-ignored): ``models/<name>``, ``<name>/<mode>/`` (the run folder:
``train.log``, ``metrics.jsonl``, ``bench.log``) and the JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_grpo_step import GIB, BenchError, _mean_after_warmup, run_sampled

ROOT = Path(__file__).resolve().parents[1] / "runs" / "scale"
DEFAULT = "smollm2-135m"
# name -> (transformers config class, widths); None: the default model itself
MODELS: dict[str, tuple[str, dict] | None] = {
    DEFAULT: ("LlamaConfig", {}),  # the default model's own config, random weights like the others
    "smollm2-360m": (
        "LlamaConfig",
        dict(
            hidden_size=960,
            intermediate_size=2560,
            num_hidden_layers=32,
            num_attention_heads=15,
            num_key_value_heads=5,
            head_dim=64,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-1.7b": (
        "Qwen3Config",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-tiny": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
}
REAL = [DEFAULT, "smollm2-360m", "qwen3-0.6b", "qwen3-1.7b"]
# Qwen3's own RoPE base and context (Qwen3Config's defaults are 10000 / 32768); cost does not depend on them
QWEN3_EXTRA = dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960)
MARK = ".bench_scale"  # written last into a built model folder: the spec it was built from
BASE = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1"]
VERL = [sys.executable, "-m", "verl_backend.driver.cli", "train", "--backend", "cpu"]
PLAN_PEAK = re.compile(r"^#\s+peak estimate\s+([0-9.]+)", re.M)
PLAN_HOST = re.compile(
    r"this host: (\d+) trainer worker\(s\) x ([0-9.]+) GiB .*?= ([0-9.]+) GiB .*? against "
    r"(\d+)% of ([0-9.]+) GiB: (fits|DOES NOT FIT)"
)


# ------------------------------------------------------------------------------------------------ models
def _spec(name: str) -> dict:
    kind, widths = MODELS[name]
    return {"config_class": kind, **widths, **(QWEN3_EXTRA if kind == "Qwen3Config" else {})}


def build_model(name: str, folder: Path) -> None:
    """Runs in its own process (``--build-model``): the random-weight model ``name`` into ``folder``."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_backend.models import ensure_default_model

    default = ensure_default_model()
    base = AutoConfig.from_pretrained(default)
    dtype = getattr(base, "dtype", None) or getattr(base, "torch_dtype", None) or torch.float32
    spec = _spec(name)
    kind = spec.pop("config_class")
    keys = dict(
        vocab_size=base.vocab_size,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
    )
    if kind == type(base).__name__:  # the default model's family: its config with these widths (RoPE, eps, positions)
        inherited = {k: v for k, v in base.to_dict().items() if not k.startswith("_") and k != "architectures"}
        config = getattr(transformers, kind)(**{**inherited, **keys, **spec})
    else:
        config = getattr(transformers, kind)(**keys, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in default.iterdir():  # tokenizer, chat template, generation config (the same ids as the config)
            if f.is_file() and f.name != "config.json" and not f.name.startswith(".") and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        (tmp / MARK).write_text(json.dumps(_spec(name), sort_keys=True))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"[bench] {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {dtype}, "
        f"written to {folder}",
        flush=True,
    )


def model_folder(name: str, timeout_s: float) -> Path:
    """The folder of model ``name``: the default model's, or a synthetic one (built now in a subprocess if absent)."""
    if MODELS[name] is None:
        from verl_backend.models import ensure_default_model

        return ensure_default_model()
    folder = ROOT / "models" / name
    mark = folder / MARK
    if mark.is_file() and json.loads(mark.read_text()) == json.loads(json.dumps(_spec(name), sort_keys=True)):
        return folder
    print(f"[bench] {name}: building the random-weight model in {folder}", flush=True)
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--build-model", name], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"building {name} timed out after {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise BenchError(f"building {name} exited {done.returncode}; last lines:\n{tail}")
    return folder


# ------------------------------------------------------------------------------------------------ one row
def _error_line(text: str) -> str | None:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("verl: error:")]
    return lines[-1] if lines else None


def plan(model_dir: Path, out: Path, overrides: list[str], threads: int) -> dict:
    """``verl train --backend cpu --print-config``: the job's responses per step and the memory plan's figures.

    Raises:
        BenchError: the command failed (its ``verl: error`` line) or printed no host memory plan.
    """
    cmd = [*VERL, "--print-config", "--num-threads", str(threads), "--output-dir", str(out), *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    if done.returncode != 0:
        raise BenchError(
            _error_line(done.stderr)
            or f"--print-config exited {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"
        )
    peak, host = PLAN_PEAK.search(done.stdout), PLAN_HOST.search(done.stdout)
    if peak is None or host is None:
        raise BenchError(
            f"`{' '.join(cmd)}` printed no '# memory plan' block with 'peak estimate' and 'this host:' "
            "lines (verl_backend/driver/memory_fit.py show_memory_plan)"
        )
    from omegaconf import OmegaConf

    config = OmegaConf.create(done.stdout)  # the YAML; the plan's lines are comments
    pick = lambda key: OmegaConf.select(config, key, throw_on_missing=False)  # noqa: E731
    return {
        "plan_peak_per_worker_gib": float(peak.group(1)),
        "plan_workers": int(host.group(1)),
        "plan_host_need_gib": float(host.group(3)),
        "plan_usable_gib": float(host.group(5)) * int(host.group(4)) / 100,
        "plan_fits": host.group(6) == "fits",
        "responses_per_step": int(pick("data.train_batch_size")) * int(pick("actor_rollout_ref.rollout.n")),
        "ppo_epochs": int(pick("actor_rollout_ref.actor.ppo_epochs") or 1),
        "max_response_length": int(pick("data.max_response_length")),
    }


def run_row(name: str, mode: str, model_dir: Path, shape, args) -> dict:
    """One ``verl train`` job (``mode``: ``full`` or ``lora``) under the memory sampler; the row's figures, or its
    outcome (``refused: ...``, ``failed: ...``) when the job did not finish."""
    rank = args.lora_rank
    label = "full" if mode == "full" else f"LoRA r{rank}"
    out = ROOT / name / ("full" if mode == "full" else f"lora{rank}")
    shutil.rmtree(out, ignore_errors=True)  # this script's own run folder: no metrics or data of an earlier run
    out.mkdir(parents=True)
    overrides = [f"trainer.total_training_steps={args.steps}", *BASE, f"actor_rollout_ref.model.path={model_dir}"]
    if mode == "lora":
        overrides += [
            f"actor_rollout_ref.model.lora_rank={rank}",
            f"actor_rollout_ref.model.lora_alpha={2 * rank}",
            "actor_rollout_ref.model.target_modules=all-linear",
        ]
    overrides += args.extra
    row = {
        "model": name,
        "mode": label,
        "params": shape.params,
        "trainable_params": shape.params if mode == "full" else rank * shape.lora_linear,
        "run_folder": str(out),
        "overrides": overrides,
        "steps": args.steps,
        "threads": args.threads,
        "ran_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_1min": os.getloadavg()[0],
    }
    try:
        row.update(plan(model_dir, out, overrides, args.threads))
    except BenchError as exc:
        return {**row, "outcome": f"failed: {exc}"}
    print(
        f"[bench] {name} {label}: plan {row['plan_host_need_gib']:.2f} GiB of {row['plan_usable_gib']:.1f} usable "
        + (
            f"(fits); training {args.steps} steps"
            if row["plan_fits"]
            else "(does not fit); starting it for its refusal"
        )
        + f", log {out / 'bench.log'}",
        flush=True,
    )
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's unix socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY_TMPDIR=str(ray_tmp),
        OMP_NUM_THREADS=str(args.threads),
        MKL_NUM_THREADS=str(args.threads),
    )
    cmd = [*VERL, "--num-threads", str(args.threads), "--max-restarts", "0", "--output-dir", str(out), *overrides]
    log = out / "bench.log"
    try:
        memory, wall = run_sampled(f"{name} {label}", cmd, env, log, args.timeout_s, step_log=out / "metrics.jsonl")
    except BenchError as exc:
        text = log.read_text(errors="replace") if log.is_file() else ""
        line = _error_line(text)
        if "timed out after" in str(exc):
            return {**row, "outcome": f"failed: timeout after {args.timeout_s:.0f} s"}
        if line and row["plan_fits"] is False and "memory plan:" in line:
            return {**row, "outcome": f"refused: {line}"}
        last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
        return {**row, "outcome": f"failed: {line or last or str(exc).splitlines()[0]}"}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    row.update(wall_s=wall, memory=memory, peak_pss_gib=memory["peak_pss_total_gib"])
    try:
        row.update(metrics(out / "metrics.jsonl", args.steps, row))
    except BenchError as exc:
        row["outcome"] = f"failed: {exc}"
    return row


def metrics(path: Path, steps: int, row: dict) -> dict:
    """The row's figures from VeRL's ``metrics.jsonl`` (means over steps 2..N).

    Raises:
        BenchError: fewer training steps in the file than asked for, or a metric missing.
    """
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    rows = sorted((r for r in rows if "timing_s/step" in r["data"]), key=lambda r: r["step"])
    if len(rows) < steps:
        raise BenchError(f"{path} has {len(rows)} training steps, expected {steps}")

    def col(*keys: str) -> list[float]:
        missing = [k for k in keys if k not in rows[0]["data"]]
        if missing:
            raise BenchError(f"{path}: no {', '.join(missing)} in step {rows[0]['step']}'s metrics")
        return [sum(float(r["data"][k]) for k in keys) for r in rows]

    per_step = {
        "step_s": col("timing_s/step"),
        "rollout_s": col("timing_s/gen"),
        "logprob_s": col("timing_s/old_log_prob", "timing_s/ref"),
        "update_s": col("timing_s/update_actor"),
        "sync_s": col("timing_s/update_weights"),
        "response_length_mean": col("response_length/mean"),
        "response_clip_ratio": col("response_length/clip_ratio"),
        "sync_bytes": col("weight_sync/bytes"),
        "total_tokens": col("perf/total_num_tokens"),
    }
    # the route each sync took (verl train --print-config lists the numbers: 1 trainer_memory, 3 object_store, ...)
    per_step["sync_route"] = [r["data"].get("weight_sync/route") for r in rows]
    mean = {k: _mean_after_warmup(v) for k, v in per_step.items() if k != "sync_route"}
    response_tokens = mean["response_length_mean"] * row["responses_per_step"]
    updated = mean["total_tokens"] * row["ppo_epochs"]
    return {
        "outcome": "ok",
        "per_step": per_step,
        "mean": mean,
        "response_tokens_per_step": response_tokens,
        "tokens_per_s": response_tokens / mean["step_s"],
        "update_tokens_per_step": updated,
        # Kaplan et al. 2020 (arXiv:2001.08361) §2.1: ~6N FLOPs per token of a forward and backward, N all params
        "update_flops_per_s": 6 * row["params"] * updated / mean["update_s"],
    }


def run_model(name: str, args) -> list[dict]:
    """The rows of one model: full fine-tuning where the plan fits (else its refusal and a LoRA row), or ``--mode``."""
    from verl_backend.driver.model_shape import shape_of_path

    try:
        folder = model_folder(name, args.timeout_s)
    except BenchError as exc:
        return [{"model": name, "mode": "-", "params": None, "outcome": f"failed: {exc}"}]
    shape = shape_of_path(str(folder), False)
    print(f"[bench] {name}: {shape.name}, {shape.params / 1e6:.1f} M parameters, {folder}", flush=True)
    if args.mode == "lora":
        return [run_row(name, "lora", folder, shape, args)]
    rows = [run_row(name, "full", folder, shape, args)]
    if args.mode == "auto" and rows[0].get("plan_fits") is False:
        rows.append(run_row(name, "lora", folder, shape, args))
    return rows


# ------------------------------------------------------------------------------------------------ report
def _params(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x); ``None`` under two distinct points."""
    if len(set(xs)) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fits(rows: list[dict]) -> dict:
    full = [r for r in rows if r.get("outcome") == "ok" and r["mode"] == "full"]
    xs = [float(r["params"]) for r in full]
    return {
        "rows": [r["model"] for r in full],
        "peak_pss_exponent": slope(xs, [r["peak_pss_gib"] for r in full]),
        "update_flops_exponent": slope(xs, [r["update_flops_per_s"] for r in full]),
    }


def report(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    head = [
        "model",
        "parameters",
        "mode",
        "s/step",
        "rollout s",
        "log-prob s",
        "update s",
        "sync s",
        "tokens/s",
        "peak PSS GiB",
        "plan GiB",
        "plan / peak",
        "sync MB",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        plan_gib = _f(r.get("plan_host_need_gib"))
        if r.get("outcome") != "ok":
            cells = (
                [r["model"], _params(r.get("params")), _cell(f"{r['mode']}, {r['outcome']}")]
                + ["n/a"] * 7
                + [plan_gib, "n/a", "n/a"]
            )
        else:
            m = r["mean"]
            mode = r["mode"] + (f" ({_params(r['trainable_params'])} trainable)" if r["mode"] != "full" else "")
            cells = [
                r["model"],
                _params(r["params"]),
                mode,
                _f(m["step_s"], ".1f"),
                _f(m["rollout_s"], ".1f"),
                _f(m["logprob_s"], ".1f"),
                _f(m["update_s"], ".1f"),
                _f(m["sync_s"], ".2f"),
                _f(r["tokens_per_s"], ".1f"),
                _f(r["peak_pss_gib"]),
                plan_gib,
                _f(r["plan_host_need_gib"] / r["peak_pss_gib"], ".3f"),
                _f(m["sync_bytes"] / 1e6, ".0f" if m["sync_bytes"] >= 1e7 else ".2f"),
            ]
        out.append("| " + " | ".join(cells) + " |")
    ok = [r for r in rows if r.get("outcome") == "ok"]
    clip = [r["mean"]["response_clip_ratio"] for r in ok if MODELS.get(r["model"]) is not None]
    trained = [f"{r['model']} ({r['mean']['response_clip_ratio']:.2f})" for r in ok if MODELS.get(r["model"]) is None]
    out += [
        "",
        f"`verl train --backend cpu`, the default job (basic_arithmetic, {meta['responses']} responses a step, "
        f"responses <= {meta['max_response_length']} tokens), {meta['steps']} steps, means of steps "
        f"2..{meta['steps']}; {meta['threads']} torch thread(s) per process; {meta['cpus']} CPUs, "
        f"{meta['host_gib']:.1f} GiB; load average {meta['load_average_1min']:.1f} at the start. Random weights "
        "never emit EOS: every response runs to the length cap (response clip ratio "
        + (f"{min(clip):.2f}-{max(clip):.2f}" if clip else "n/a")
        + "), so this is a cost measurement, not a "
        "learning one"
        + (
            f"; {', '.join(trained)} is the default model's trained weights: its responses stop at "
            "EOS (that fraction at the cap), so it makes fewer tokens a step"
            if trained
            else ""
        )
        + ". plan GiB: the memory plan's host need (the whole job); peak PSS: every process of the job.",
    ]
    out += [
        "",
        "| model | mode | parameters N | tokens updated/step T | update s | update GFLOP/s (6NT/s) | peak PSS GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    if not ok:
        out.append("| (no row finished) | | | | | | |")
    for r in ok:
        out.append(
            f"| {r['model']} | {r['mode']} | {_params(r['params'])} | {r['update_tokens_per_step']:.0f} | "
            f"{r['mean']['update_s']:.1f} | {r['update_flops_per_s'] / 1e9:.2f}"
            f"{' (upper bound)' if r['mode'] != 'full' else ''} | {r['peak_pss_gib']:.2f} |"
        )
    fit = result["fit"]
    out += [
        "",
        "update FLOP/s = 6 x N x T / update s: N all the model's parameters, T = perf/total_num_tokens x "
        "ppo_epochs (prompt + response tokens of the update, no padding); 6N FLOPs per training token from "
        "Kaplan et al. 2020 (arXiv:2001.08361, §2.1). LoRA rows: the frozen weights get no weight gradient "
        "(~4N), so theirs is an upper bound and the fit leaves them out.",
        f"Least squares over the full fine-tuning rows ({', '.join(fit['rows']) or 'none'}): peak PSS ~ N^"
        f"{_f(fit['peak_pss_exponent'])}, update FLOP/s ~ N^{_f(fit['update_flops_exponent'])}"
        + ("" if len(fit["rows"]) >= 2 else " (n/a: needs two full fine-tuning rows)")
        + ".",
    ]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models", nargs="+", choices=list(MODELS), help=f"rows to run, in order (default: {' '.join(REAL)})"
    )
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per row (step 1 is warm-up; >= 2)")
    ap.add_argument("--lora-rank", type=int, default=16, help="LoRA rank where full fine-tuning does not fit")
    ap.add_argument("--timeout-s", type=float, default=3600, help="seconds allowed per row (and per model build)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (verl train --num-threads)")
    ap.add_argument(
        "--mode",
        choices=["auto", "full", "lora"],
        default="auto",
        help="auto: full fine-tuning where the memory plan fits, else its refusal and LoRA (default)",
    )
    ap.add_argument("--extra", nargs="+", default=[], metavar="KEY=VALUE", help="VeRL overrides added to every row")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="smoke test: add qwen3-tiny (the only row unless --models is given); JSON runs/scale/smoke.json",
    )
    ap.add_argument("--table", action="store_true", help="reprint the table from the JSON; run nothing")
    ap.add_argument("--out", help="the JSON (default runs/scale/scale.json, runs/scale/smoke.json with --tiny)")
    ap.add_argument("--build-model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_model:
        build_model(args.build_model, ROOT / "models" / args.build_model)
        return 0
    out = Path(args.out) if args.out else ROOT / ("smoke.json" if args.tiny else "scale.json")
    if args.table:
        if not out.is_file():
            print(f"bench_scale: error: {out} does not exist: run the benchmark first", file=sys.stderr)
            return 2
        print(report(json.loads(out.read_text())))
        return 0
    if args.steps < 2 or args.threads < 1 or args.lora_rank < 1:
        print(
            "bench_scale: error: --steps must be >= 2 (step 1 is warm-up), --threads and --lora-rank >= 1",
            file=sys.stderr,
        )
        return 2
    bad = [e for e in args.extra if "=" not in e]
    if bad:
        print(f"bench_scale: error: --extra takes KEY=VALUE VeRL overrides, not {' '.join(bad)}", file=sys.stderr)
        return 2
    models = list(args.models or ([] if args.tiny else REAL)) + (["qwen3-tiny"] if args.tiny else [])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from verl_backend.driver.memory_fit import host_memory_bytes

    load = os.getloadavg()[0]
    rows: list[dict] = []
    for name in dict.fromkeys(models):
        rows += run_model(name, args)
        print(
            f"[bench] {name}: " + "; ".join(f"{r['mode']} {r['outcome'][:200]}" for r in rows if r["model"] == name),
            flush=True,
        )
    ok = next((r for r in rows if "responses_per_step" in r), {})
    result = {
        "rows": rows,
        "fit": fits(rows),
        "meta": {
            "steps": args.steps,
            "threads": args.threads,
            "lora_rank": args.lora_rank,
            "mode": args.mode,
            "extra": args.extra,
            "cpus": os.cpu_count(),
            "host_gib": host_memory_bytes() / GIB,
            "load_average_1min": load,
            "responses": ok.get("responses_per_step"),
            "max_response_length": ok.get("max_response_length"),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n" + report(result))
    print(f"\n[bench] every figure in {out}")
    return 0 if all(r["outcome"] == "ok" or r["outcome"].startswith("refused") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
