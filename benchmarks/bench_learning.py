"""Held-out accuracy per CPU-minute: ``verl train --backend cpu`` (the default job) against TRL's ``GRPOTrainer``.

The same work on both sides, the default job's recipe (``verl_backend/configs/grpo_cpu.yaml``), not the step bench's
pinned one:

- model SmolLM2-135M-Instruct (float32), task reasoning-gym ``basic_arithmetic`` with ``+`` only (the default's), the
  same 256 training items (the parquet ``verl train`` writes is what TRL reads), the same prompt;
- the same reward function, :func:`verl_backend.data.rewards.compute_score`'s ``score`` (the format reward);
- 12 steps of 4 prompts x 8 samples at temperature 0.7 (no top-k, no top-p), at most 64 completion tokens, lr 2e-5
  constant, AdamW weight decay 0.01, grad-norm clip 1.0, clip 0.2, KL loss 0.001 (k3 / ``low_var_kl``), token-mean
  loss (TRL's ``dapo``), one optimizer step a step;
- a checkpoint at steps 6 and 12, each judged alike: greedy on the report set of ``bench_recipe.py`` (200 items the
  runs never trained or validated on), strict and lenient apart (``bench_recipe.judge``), against the base model.

``verl train`` runs without its in-run validations (TRL has none); TRL runs in one process with ``--trl-threads``
torch threads (2: both cores, as ``verl train``'s default gives each of its processes), gradient checkpointing as
``--trl-gradient-checkpointing`` says (off by default: on this 2-core host it costs time and the model fits).

Per framework and seed the table gives: the gain on the report set at the last checkpoint with its paired 95%
interval (lenient; strict beside it), wall time, CPU-seconds (user + sys of every process of the run, Ray's
included, sampled every 0.5 s by ``bench_grpo_step.MemorySampler``), peak PSS, and held-out points per CPU-minute
(the lenient gain over the CPU-minutes to that checkpoint). ``learning_vs_trl.png`` plots report-set accuracy against
CPU-minutes, both frameworks, seeds as thin lines.

Usage::

    python benchmarks/bench_learning.py run --frameworks ours trl --seeds 1 2 3
    python benchmarks/bench_learning.py run --frameworks ours --seeds 1 2 3 4 5 \
        --variant rs43=actor_rollout_ref.rollout.seed=43      # the perturbed reruns (another sampling seed)
    python benchmarks/bench_learning.py table          # table and plot of everything judged so far

A ``--variant NAME=KEY=VALUE,...`` run is the project's job with those overrides, recorded as ``ours NAME`` (folder
``runs/learning/ours-NAME-s<seed>``); with ``rl_tpu.few_shot`` it is judged under its own prompt and its gains are
against the base model under that prompt (and, for strict accuracy, also under the default prompt).

Results accumulate in ``runs/learning/results.jsonl``; a run's folder is ``runs/learning/<framework>-s<seed>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_grpo_step as step_bench  # noqa: E402  (the memory/CPU sampler and the TRL data conventions)
import bench_recipe as recipe  # noqa: E402  (the judge and the report set)

from verl_backend.driver.report import GROUPS_REPLACED_KEY, read_metrics, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "learning"
RESULTS = OUT / "results.jsonl"
STEPS, SAVE_EVERY, PROMPTS, SAMPLES, TEMPERATURE, LR, KL_COEF, MAX_COMPLETION = 12, 6, 4, 8, 0.7, 2e-5, 0.001, 64


def _record(row: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _rows() -> list[dict]:
    return [json.loads(l) for l in RESULTS.read_text().splitlines() if l.strip()] if RESULTS.exists() else []


def _cpu_at_steps(memory: dict) -> dict[int, float]:
    """CPU-seconds of the whole run when each step's line appeared (step -> seconds)."""
    return {i + 1: float(c) for i, c in enumerate(memory.get("step_cpu_marks") or [])}


def run_dir(variant: str, seed: int) -> Path:
    """The folder of the project's run at ``seed`` (``ours-s<seed>``, or ``ours-<variant>-s<seed>``)."""
    return OUT / (f"ours-{variant}-s{seed}" if variant else f"ours-s{seed}")


def run_ours(seed: int, timeout_s: float, variant: str = "", overrides: list[str] = ()) -> tuple[dict, dict[int, Path]]:
    """The default job at ``data.seed=seed`` under the sampler, with a variant's ``overrides`` (VeRL / ``rl_tpu.``
    keys) last. Returns (its measures, step -> HF checkpoint)."""
    out = run_dir(variant, seed)
    shutil.rmtree(out, ignore_errors=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))  # Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(ray_tmp))
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        f"data.seed={seed}",
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.save_freq={SAVE_EVERY}",
        f"trainer.total_training_steps={STEPS}",
        *overrides,
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        memory, wall = step_bench.run_sampled(
            "ours (verl train --backend cpu)",
            cmd,
            env,
            OUT / f"{out.name}.log",
            timeout_s,
            step_log=out / "metrics.jsonl",
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    rewards = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        data = json.loads(line).get("data", {})
        if "critic/score/mean" in data:
            rewards.append(float(data["critic/score/mean"]))
    return {"wall_s": wall, "memory": memory, "rewards": rewards}, hf_checkpoints(out)


def hf_checkpoints(out: Path) -> dict[int, Path]:
    """A project run's Hugging Face checkpoints: step -> ``checkpoints/global_step_<step>/actor/huggingface``."""
    return {int(p.parts[-3].rsplit("_", 1)[1]): p for p in out.glob("checkpoints/global_step_*/actor/huggingface")}


def run_trl(
    seed: int, train_file: str, threads: int, gradient_checkpointing: bool, timeout_s: float
) -> tuple[dict, dict[int, Path]]:
    """TRL's GRPOTrainer on the same parquet, in a process of its own under the sampler."""
    work = OUT / f"trl-s{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        }
    )
    cmd = [
        sys.executable,
        __file__,
        "trl-worker",
        "--train-file",
        train_file,
        "--seed",
        str(seed),
        "--threads",
        str(threads),
        "--work",
        str(work),
        "--trl-gradient-checkpointing",
        "on" if gradient_checkpointing else "off",
    ]
    memory, wall = step_bench.run_sampled(
        "TRL GRPOTrainer", cmd, env, OUT / f"trl-s{seed}.log", timeout_s, step_log=work / "steps.jsonl"
    )
    result = json.loads((work / "result.json").read_text())
    ckpts = {int(p.name.split("-")[1]): p for p in (work / "trl").glob("checkpoint-*")}
    return {"wall_s": wall, "memory": memory, "rewards": result["rewards"]}, ckpts


def trl_worker(args) -> None:
    """In its own process: TRL ``GRPOTrainer`` with the default job's recipe; a line a step in ``steps.jsonl``
    (the sampler's CPU mark), checkpoints every :data:`SAVE_EVERY` steps, the rewards in ``result.json``."""
    import pandas as pd
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_backend.data.rewards import compute_score
    from verl_backend.models import ensure_default_model

    model_dir = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.convert_tokens_to_ids("<|im_end|>") not in (None, tok.unk_token_id):
        tok.eos_token = "<|im_end|>"  # the chat turn's end, where our rollout stops too (bench_grpo_step)
    rows = []
    for r in pd.read_parquet(args.train_file).itertuples(index=False):
        prompt = [dict(m) for m in r.prompt]
        rows.append(
            {
                "prompt": prompt,
                "data_source": r.data_source,
                "ground_truth": r.reward_model["ground_truth"],
                "extra_info": dict(r.extra_info),
            }
        )

    def arithmetic_reward(completions, data_source, ground_truth, extra_info, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            float(compute_score(d, t, g, e)["score"])
            for d, t, g, e in zip(data_source, texts, ground_truth, extra_info)
        ]

    steps_log = Path(args.work) / "steps.jsonl"
    rewards: list[float] = []

    class Steps(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

        def on_step_end(self, a, state, control, **kwargs):
            with steps_log.open("a") as fh:
                fh.write(json.dumps({"step": state.global_step, "timing_s/step": None}) + "\n")

    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=SAMPLES,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=KL_COEF,
        epsilon=0.2,
        loss_type="dapo",
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        save_only_model=True,
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=args.trl_gradient_checkpointing == "on",
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[Steps()],
    )
    trainer.train()
    (Path(args.work) / "result.json").write_text(json.dumps({"rewards": rewards}))


def judge_checkpoints(
    framework: str, seed: int, measures: dict, ckpts: dict[int, Path], options: dict, variant: str = ""
) -> None:
    """Judge every checkpoint on the report set, under the prompt the run trained with (its ``rl_tpu.few_shot``),
    and record it with the CPU-seconds spent up to its step."""
    cpu_at = _cpu_at_steps(measures["memory"])
    few_shot = recipe.few_shot_of(options.get("overrides", []))
    for step in sorted(ckpts):
        res = recipe.judge(str(ckpts[step]), "report", few_shot=few_shot)
        _record(
            {
                "framework": framework,
                "variant": variant,
                "few_shot": few_shot,
                "seed": seed,
                "step": step,
                "cpu_s": cpu_at.get(step),
                "cpu_s_run": measures["memory"]["cpu_s"],
                "wall_s": measures["wall_s"],
                "peak_pss_gib": measures["memory"]["peak_pss_total_gib"],
                "rewards": measures["rewards"],
                "options": options,
                "strict": res["strict"],
                "lenient": res["lenient"],
            }
        )


def _base(rows: list[dict], few_shot: int) -> dict | None:
    """The base model's row judged under ``few_shot`` worked examples (rows before the key existed had none)."""
    return next((r for r in rows if r["framework"] == "base" and r.get("few_shot", 0) == few_shot), None)


def cmd_run(args) -> None:
    variant, overrides = "", []
    if args.variant and "trl" in args.frameworks:
        sys.exit("--variant changes the project's job only: run it with --frameworks ours")
    if args.variant:
        variant, _, rest = args.variant.partition("=")
        overrides = [o for o in rest.split(",") if o]
    for k in sorted({0, recipe.few_shot_of(overrides)}):
        if _base(_rows(), k) is not None:
            continue
        res = recipe.judge(recipe.base_model_dir(), "report", few_shot=k)
        _record(
            {
                "framework": "base",
                "few_shot": k,
                "seed": 0,
                "step": 0,
                "cpu_s": 0.0,
                "strict": res["strict"],
                "lenient": res["lenient"],
            }
        )
    train_file = None
    for seed in args.seeds:
        for framework in args.frameworks:
            t0 = time.monotonic()
            if framework == "ours":
                measures, ckpts = run_ours(seed, args.timeout, variant, overrides)
                options = {"threads": "verl train's default", "overrides": overrides}
                train_file = train_file or str(next((run_dir(variant, seed) / "data").glob("*_train.parquet")))
            else:
                if train_file is None:
                    train_file = step_bench._prepare_train_file(OUT / "data")
                measures, ckpts = run_trl(
                    seed, train_file, args.trl_threads, args.trl_gradient_checkpointing == "on", args.timeout
                )
                options = {"threads": args.trl_threads, "gradient_checkpointing": args.trl_gradient_checkpointing}
            judge_checkpoints(framework, seed, measures, ckpts, options, variant if framework == "ours" else "")
            if framework == "ours":  # judged: the trainer's resume state (1.6 GB a checkpoint) filled the disk
                for state in run_dir(variant, seed).glob("checkpoints/global_step_*/actor/*.pt"):
                    state.unlink()
            print(f"{framework} seed {seed}: {time.monotonic() - t0:.0f} s with judging", flush=True)
            cmd_table(args)


def cmd_judge(args) -> None:
    """Judge the checkpoints of a finished project run that have no row yet (a run whose judging was stopped), with
    the run's measures from its recorded row. The CPU-seconds of a step so judged are the whole run's (the sampler's
    per-step figures were not kept): an upper bound, exact for the last step."""
    rows = [
        r
        for r in _rows()
        if r["framework"] == "ours" and r.get("variant", "") == args.variant and r["seed"] == args.seed
    ]
    if not rows:
        sys.exit(f"no recorded row of ours {args.variant or '(default)'} seed {args.seed}: use 'run' instead")
    known = {r["step"] for r in rows}
    out = run_dir(args.variant, args.seed)
    ckpts = {step: path for step, path in hf_checkpoints(out).items() if step not in known}
    if not ckpts:
        sys.exit(f"every checkpoint in {out}/checkpoints has a row already")
    last = rows[-1]
    cpu_s = last["cpu_s_run"]
    measures = {
        "wall_s": last["wall_s"],
        "rewards": last["rewards"],
        "memory": {"cpu_s": cpu_s, "peak_pss_total_gib": last["peak_pss_gib"], "step_cpu_marks": [cpu_s] * max(ckpts)},
    }
    judge_checkpoints("ours", args.seed, measures, ckpts, last["options"], args.variant)
    cmd_table(args)


def cmd_table(_args) -> None:
    rows = _rows()
    base = _base(rows, 0)
    if base is None:
        print("no base row yet: `bench_learning.py run` judges the base model first")
        return
    n = len(base["lenient"])
    print(
        f"base model: report set lenient {100 * sum(base['lenient']) / n:.1f}%, strict "
        f"{100 * sum(base['strict']) / n:.1f}% ({n} items)"
    )
    for b in rows:
        if b["framework"] == "base" and b.get("few_shot", 0):
            print(
                f"base model, {b['few_shot']} worked example(s) in the prompt: lenient "
                f"{100 * sum(b['lenient']) / n:.1f}%, strict {100 * sum(b['strict']) / n:.1f}%"
            )
    print(
        "Δ: against the base model under the run's own prompt; 'Δ strict, 0-shot base': against the base model under "
        "the default prompt (no worked examples)"
    )
    print(
        f"{'run':<14} {'seed':>4} {'step':>4} {'Δ lenient [95% CI]':>24} {'Δ strict [95% CI]':>24} "
        f"{'Δ strict, 0-shot base':>21} {'wall min':>8} {'CPU min':>8} {'peak PSS GiB':>12} {'points/CPU-min':>14}"
    )
    for r in sorted(
        (r for r in rows if r["framework"] != "base"),
        key=lambda r: (r["framework"], r.get("variant", ""), r["seed"], r["step"]),
    ):
        own = _base(rows, r.get("few_shot", 0)) or base
        dl, lo, hi = recipe.paired(r["lenient"], own["lenient"])
        ds, slo, shi = recipe.paired(r["strict"], own["strict"])
        ds0, _, _ = recipe.paired(r["strict"], base["strict"])
        cpu_min = (r.get("cpu_s") or float("nan")) / 60
        rate = dl / cpu_min if cpu_min and math.isfinite(cpu_min) else float("nan")
        label = f"{r['framework']} {r['variant']}" if r.get("variant") else r["framework"]
        print(
            f"{label:<14} {r['seed']:>4} {r['step']:>4} {dl:+7.1f} [{lo:+6.1f}, {hi:+6.1f}] "
            f"{ds:+7.1f} [{slo:+6.1f}, {shi:+6.1f}] {ds0:+21.1f} "
            f"{r['wall_s'] / 60:8.1f} {cpu_min:8.1f} {r['peak_pss_gib']:12.2f} {rate:14.3f}"
        )
    print(
        "\nthe signal a run trained on: the share of its groups (a prompt's 8 samples) whose rewards differ, the only "
        "ones GRPO learns from, and the train reward's least-squares slope over its steps (under DAPO's dynamic "
        "sampling: of the groups trained on, and of all groups graded, kept or replaced)"
    )
    print(
        f"{'run':<14} {'seed':>4} {'Δ lenient, last':>15} {'groups with spread':>18} {'reward slope /step':>18} "
        f"{'all graded, slope':>17}"
    )
    for r in sorted(
        (r for r in rows if r["framework"] == "ours" and r["step"] == STEPS),
        key=lambda r: (r.get("variant", ""), r["seed"]),
    ):
        own = _base(rows, r.get("few_shot", 0)) or base
        dl, _, _ = recipe.paired(r["lenient"], own["lenient"])
        variant = r.get("variant", "")
        share = groups_with_spread(run_dir(variant, r["seed"]))
        slope = recipe.reward_slope([r])[0]
        graded = summarize(read_metrics(run_dir(variant, r["seed"]) / "metrics.jsonl"))["graded_reward_curve"]
        graded_slope = recipe.reward_slope([{"rewards": [v for _, v in graded]}])[0]
        label = f"ours {variant}" if variant else "ours"
        all_graded = f"{graded_slope:+17.4f}" if math.isfinite(graded_slope) else f"{'n/a':>17}"
        print(f"{label:<14} {r['seed']:>4} {dl:+15.1f} {100 * share:17.1f}% {slope:+18.4f} {all_graded}")
    plot([r for r in rows if not r.get("variant")], base)


def groups_with_spread(run: Path) -> float:
    """The share of a run's groups (one prompt's samples, from its ``rollouts/<step>.jsonl`` dumps) whose rewards are
    not all equal: under GRPO's group-normalised advantage the others add nothing to the gradient. NaN without
    dumps. With DAPO's dynamic sampling the dumps hold only the groups trained on; the groups VeRL replaced for having
    no spread (``training/filter_groups/evicted_samples``) and the surplus it discarded after a step had enough
    (``.../discarded_surplus_samples``, all with a spread) are read from ``metrics.jsonl`` and counted too, so the
    share is of every group sampled."""
    from collections import defaultdict

    spread = total = 0
    metrics = run / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        data = json.loads(line).get("data", {})
        evicted = int(data.get(GROUPS_REPLACED_KEY, 0))
        surplus = int(data.get("training/filter_groups/discarded_surplus_samples", 0))
        spread += surplus
        total += evicted + surplus
    for dump in sorted(run.glob("rollouts/*.jsonl")):
        groups: dict[str, list[float]] = defaultdict(list)
        for line in dump.read_text().splitlines():
            row = json.loads(line)
            groups[row["input"]].append(float(row["score"]))
        spread += sum(max(v) > min(v) for v in groups.values())
        total += len(groups)
    return spread / total if total else float("nan")


def plot(rows: list[dict], base: dict) -> Path | None:
    """Report-set accuracy (lenient) against CPU-minutes, per framework, seeds as thin lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colours = {"ours": "tab:blue", "trl": "tab:orange"}
    base_acc = 100 * sum(base["lenient"]) / len(base["lenient"])
    for framework in sorted({r["framework"] for r in rows} - {"base"}):
        for seed in sorted({r["seed"] for r in rows if r["framework"] == framework}):
            pts = sorted(
                (r["cpu_s"] / 60, 100 * sum(r["lenient"]) / len(r["lenient"]))
                for r in rows
                if r["framework"] == framework and r["seed"] == seed and r.get("cpu_s")
            )
            xs, ys = zip(*([(0.0, base_acc)] + pts))
            ax.plot(
                xs,
                ys,
                marker="o",
                linewidth=0.8,
                color=colours.get(framework),
                label=f"{framework}" if seed == min(r["seed"] for r in rows if r["framework"] == framework) else None,
            )
    ax.set_xlabel("CPU-minutes (user + sys, all processes)")
    ax.set_ylabel("report-set accuracy, lenient (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = OUT / "learning_vs_trl.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="train and judge")
    run.add_argument("--frameworks", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    run.add_argument("--seeds", nargs="+", type=int, default=[1])
    run.add_argument("--trl-threads", type=int, default=2)
    run.add_argument("--trl-gradient-checkpointing", choices=["on", "off"], default="off")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    run.add_argument(
        "--variant",
        default="",
        help="NAME=KEY=VALUE,KEY=VALUE: the project's job with these overrides, recorded as 'ours NAME' (e.g. "
        "rs43=actor_rollout_ref.rollout.seed=43, a perturbed rerun; fs1=rl_tpu.few_shot=1)",
    )
    sub.add_parser("table", help="the table and plot of everything judged so far")
    judge = sub.add_parser("judge", help="judge a finished run's checkpoints that have no row yet")
    judge.add_argument("--seed", type=int, required=True)
    judge.add_argument("--variant", default="", help="the run's variant NAME, as given to 'run'")
    worker = sub.add_parser("trl-worker", help=argparse.SUPPRESS)
    worker.add_argument("--train-file", required=True)
    worker.add_argument("--seed", type=int, required=True)
    worker.add_argument("--threads", type=int, default=2)
    worker.add_argument("--work", required=True)
    worker.add_argument("--steps", type=int, default=STEPS, help="fewer for a smoke test")
    worker.add_argument("--trl-gradient-checkpointing", choices=["on", "off"], default="off")
    args = parser.parse_args()
    recipe.TASK, recipe.TASK_CONFIG = "addition", recipe.TASKS["addition"]  # the default job's task
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    {"run": cmd_run, "judge": cmd_judge, "table": cmd_table, "trl-worker": trl_worker}[args.cmd](args)


if __name__ == "__main__":
    main()
