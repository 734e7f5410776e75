"""The GRPO recipe study of the default job: which VeRL keys make SmolLM2-135M learn ``basic_arithmetic``.

The default task is ``addition`` (``basic_arithmetic`` with ``+`` only, ``--task addition``) since the third screen;
``--task basic_arithmetic`` reruns the first two screens on ``+`` and ``-`` (every run gets its task's config).

Each candidate is a list of VeRL / ``rl_tpu.*`` overrides on top of the default job (``verl train --backend
cpu``). A candidate is trained once per seed (``data.seed``: the data order; the train items stay those of
``rl_tpu.seed``), then its last checkpoint and the base model answer, greedily, with the plain Hugging Face
``generate`` (not rl-tpu's sampler, so the judge is independent of the code under test):

- the **validation set**: the job's own held-out items (reasoning-gym seed ``rl_tpu.seed + 1000``) — candidates are
  chosen on it;
- the **report set**: 200 items of seed ``rl_tpu.seed + 2000``, after dropping any whose question is also a train or
  validation item (the count dropped is printed) — the figures reported are on it.

Two scores per item, reported apart so that a format gain is never sold as an accuracy gain:

- *strict*: the text inside the last ``<answer></answer>`` tags is right (reasoning-gym's ``score_answer``);
- *lenient*: the last number of the response is right.

A gain is the paired difference against the base model on the same items under the same prompt, with a 95%
normal interval over the items (mean ± 1.96·sd/√n of the per-item differences).

Usage::

    python benchmarks/bench_recipe.py base                      # the base model on both sets
    python benchmarks/bench_recipe.py study --candidates A B    # train + judge the named candidates, 1 seed
    python benchmarks/bench_recipe.py study --candidates A --seeds 1 2 3
    python benchmarks/bench_recipe.py table                     # the table of everything judged so far

Results accumulate in ``runs/recipe/results.jsonl`` (one line per judged model); a run's folder is
``runs/recipe/<candidate>-s<seed>``. Every run takes 5-10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from verl_backend.settings import BY_NAME

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "recipe"
RESULTS = OUT / "results.jsonl"

# The default job's data (verl_backend/configs/grpo_cpu.yaml) and the second task's (examples/chain_sum_cpu.yaml):
# the study holds these fixed. ``--task`` picks one.
TASKS = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    # basic_arithmetic with "+" only: no item needs the negative numbers the 135M model never samples (the default
    # job's task, declared once in verl_backend/settings.py)
    "addition": BY_NAME["task_config"].default,
}
# reasoning-gym's dataset name of each task (a task here is a dataset and its config)
DATASET = {"basic_arithmetic": "basic_arithmetic", "chain_sum": "chain_sum", "addition": "basic_arithmetic"}
TASK = "basic_arithmetic"
TASK_CONFIG = TASKS[TASK]
DATA_SEED = 1
TRAIN_SIZE = 256
SET_SIZE = 200

# Candidates: overrides on top of the job's defaults as they are in grpo_cpu.yaml when the study runs. Keys are
# VeRL 0.9.1's own. "old" is the default before the study (T=1.0, 4 samples, KL loss on).
OLD = [
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "trainer.total_training_steps=12",
]
CANDIDATES: dict[str, list[str]] = {
    "old": OLD,
    "t07_n8": OLD + ["actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.n=8"],
    "t07_n8_lr2e5": OLD
    + [
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.optim.lr=2e-5",
    ],
    "t06_n8_drgrpo": OLD
    + [
        "actor_rollout_ref.rollout.temperature=0.6",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
        "algorithm.norm_adv_by_std_in_grpo=false",
    ],
    "t07_n8_nokl_clip": OLD
    + [
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
    ],
    "t08_n16_b2": OLD
    + [
        "actor_rollout_ref.rollout.temperature=0.8",
        "actor_rollout_ref.rollout.n=16",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ],
    "t07_n8_lr2e5_b8s8": OLD
    + [
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.optim.lr=2e-5",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.total_training_steps=24",
    ],
    "t07_n8_lr3e5": OLD
    + [
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.optim.lr=3e-5",
    ],
    "t07_n8_lr3e5_mb2": OLD
    + [
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.optim.lr=3e-5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ],
    "new_default": [],
    # the format reward (#45): a right answer outside <answer> tags earns half (the default since); its control is
    # the same job with the reward before it (a bare right number earns all)
    "addition_format": ["rl_tpu.task_config=" + json.dumps(TASKS["addition"])],
    "addition_noformat": [
        "rl_tpu.task_config=" + json.dumps(TASKS["addition"]),
        "reward.custom_reward_function.reward_kwargs.bare_answer_credit=1.0",
    ],
    # the sixth screen (#45 item 2): one worked example before each question (its reply works the sum into the tags)
    # and a bare right number at half credit
    "addition_fs1": [
        "rl_tpu.task_config=" + json.dumps(TASKS["addition"]),
        "rl_tpu.few_shot=1",
        "reward.custom_reward_function.reward_kwargs.bare_answer_credit=0.5",
    ],
    "chain_sum": ["--config", "examples/chain_sum_cpu.yaml"],
    "addition": ["rl_tpu.task_config=" + json.dumps(TASKS["addition"])],
    "addition_lr2e5": ["rl_tpu.task_config=" + json.dumps(TASKS["addition"]), "actor_rollout_ref.actor.optim.lr=2e-5"],
    # the same 32 samples a step spread over 8 prompts x 4 samples (at ~50% sampled accuracy most groups of 4 vary)
    "addition_b8n4_lr2e5": [
        "rl_tpu.task_config=" + json.dumps(TASKS["addition"]),
        "actor_rollout_ref.actor.optim.lr=2e-5",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
    ],
    # the default without the KL loss (coefficient 0.001): no reference policy, so no reference forward each step
    "addition_lr2e5_nokl": [
        "rl_tpu.task_config=" + json.dumps(TASKS["addition"]),
        "actor_rollout_ref.actor.optim.lr=2e-5",
        "actor_rollout_ref.actor.use_kl_loss=false",
    ],
    # ... and the time the reference forward took spent on 4 more steps (16 prompts more), validated and saved at
    # the end
    "addition_lr2e5_nokl_s16": [
        "rl_tpu.task_config=" + json.dumps(TASKS["addition"]),
        "actor_rollout_ref.actor.optim.lr=2e-5",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "trainer.total_training_steps=16",
        "trainer.test_freq=16",
        "trainer.save_freq=8",
    ],
}

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _dataset(seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(DATASET[TASK], size=size, seed=seed, **TASK_CONFIG)


def eval_items(which: str) -> list[dict]:
    """The validation items (as the job makes them) or the report set (deduplicated against train and validation).

    Returns: entries of reasoning-gym (``question``, ``answer``, ``metadata``), ``SET_SIZE`` of them.
    """
    val = list(_dataset(DATA_SEED + 1000, SET_SIZE))
    if which == "val":
        return val
    seen = {e["question"] for e in _dataset(DATA_SEED, TRAIN_SIZE)} | {e["question"] for e in val}
    pool = list(_dataset(DATA_SEED + 2000, SET_SIZE * 2))
    items = [e for e in pool if e["question"] not in seen][:SET_SIZE]
    dropped = sum(e["question"] in seen for e in pool[: SET_SIZE + (SET_SIZE * 2 - len(items))])
    print(
        f"report set: {len(items)} items of seed {DATA_SEED + 2000}; {dropped} dropped as train/validation duplicates",
        file=sys.stderr,
    )
    return items


def _last_number(text: str) -> float | None:
    nums = _NUMBER.findall(text)
    if not nums:
        return None
    try:
        return float(nums[-1].rstrip(".").replace(",", ""))
    except ValueError:
        return None


def shots(k: int) -> list[tuple[str, str]]:
    """The job's ``rl_tpu.few_shot=k`` worked examples for the studied task (``data_prep.builtin_shots``, the same
    draw), checked to be none of the report set's questions (no example gives away a judged answer)."""
    from types import SimpleNamespace

    from verl_backend.driver.data_prep import builtin_shots

    ex = builtin_shots(
        SimpleNamespace(
            few_shot=k,
            task=DATASET[TASK],
            task_config=TASK_CONFIG,
            seed=DATA_SEED,
            train_size=TRAIN_SIZE,
            val_size=SET_SIZE,
        )
    )
    if ex:
        report = {e["question"] for e in eval_items("report")}
        assert not report & {q for q, _ in ex}, "a worked example is a report-set question"
    return ex


def few_shot_of(overrides) -> int:
    """The ``rl_tpu.few_shot`` a run's overrides set (0 when none)."""
    return next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("rl_tpu.few_shot=")), 0)


def judge(model_dir: str, which: str, max_new_tokens: int = 64, few_shot: int = 0, sampled: int = 0) -> dict:
    """Greedy answers of ``model_dir`` on a set, scored strict and lenient per item.

    Generated by rl-tpu's native sampler at temperature 0 (its greedy tokens are the plain Hugging Face forward's:
    ``tests/rl_tpu/test_sampler*.py``; about 10x faster than ``transformers``' ``generate`` here).

    Args:
        few_shot: worked examples before each question, as the job's ``rl_tpu.few_shot`` puts them (:func:`shots`).
        sampled: also draw this many answers an item at the default job's temperature (0.7), as the rollout samples
            (what a format reward can reinforce is what is sampled), and count them under ``"sampled"``.

    Returns: ``{"strict": [0/1 per item], "lenient": [...], "ends_42": count, "tagged": count, "samples": [3 texts],
    "prompt_suffix", "few_shot"}``, and ``"sampled": {"n", "tagged", "strict", "lenient"}`` (counts of samples) when
    ``sampled`` > 0.
    """
    import torch
    from reasoning_gym.utils import extract_answer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_tpu.sampler import Sampler, SamplingParams
    from verl_backend.data.converters import PROMPT_SUFFIX, prompt_messages

    items = eval_items(which)
    examples = shots(few_shot)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sampler = Sampler(
        model,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        eos_token_ids=[tok.eos_token_id],
        max_batch_size=64,
    )
    prompts = [
        tok.apply_chat_template(
            prompt_messages(e["question"], examples),
            tokenize=True,
            add_generation_prompt=True,
        )
        for e in items
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    with torch.no_grad():
        outs = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, logprobs=False))
    ds = _dataset(DATA_SEED, 1)
    strict, lenient, ends_42, tagged, texts = [], [], 0, 0, []

    def score(e: dict, text: str) -> tuple[bool, int, int, float | None]:
        """(tagged, strict, lenient, last number) of one answer."""
        tag = extract_answer(text)
        last = _last_number(text)
        right_tag = int(tag is not None and float(ds.score_answer(tag, e)) == 1.0)
        return tag is not None, right_tag, int(last is not None and math.isclose(last, float(e["answer"]))), last

    for e, out in zip(items, outs):
        text = tok.decode(out.token_ids, skip_special_tokens=True)
        texts.append(text)
        is_tagged, right_tag, right, last = score(e, text)
        tagged += is_tagged
        strict.append(right_tag)
        lenient.append(right)
        ends_42 += last == 42.0
    counts = {}
    if sampled:
        with torch.no_grad():
            drawn = sampler.generate(
                [p for p in prompts for _ in range(sampled)],
                SamplingParams(temperature=0.7, max_new_tokens=max_new_tokens, logprobs=False, seed=7),
            )
        counts = {"n": len(drawn), "tagged": 0, "strict": 0, "lenient": 0}
        for i, out in enumerate(drawn):
            is_tagged, right_tag, right, _ = score(
                items[i // sampled], tok.decode(out.token_ids, skip_special_tokens=True)
            )
            counts["tagged"] += is_tagged
            counts["strict"] += right_tag
            counts["lenient"] += right
    return {
        "strict": strict,
        "lenient": lenient,
        "ends_42": ends_42,
        "tagged": tagged,
        "samples": texts[:3],
        "prompt_suffix": PROMPT_SUFFIX,
        "few_shot": few_shot,
        **({"sampled": counts} if counts else {}),
    }


def paired(a: list[int], b: list[int]) -> tuple[float, float, float]:
    """Mean of ``a - b`` in points with its 95% normal interval (lo, hi)."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    h = 1.96 * sd / math.sqrt(n)
    return 100 * m, 100 * (m - h), 100 * (m + h)


def _record(row: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _rows() -> list[dict]:
    if not RESULTS.exists():
        return []
    return [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def base_model_dir() -> str:
    from verl_backend.models import ensure_default_model

    return str(ensure_default_model())


def cmd_base(args) -> None:
    if args.prompt_suffix is not None:  # screening another prompt: the base model only
        import verl_backend.data.converters as converters

        converters.PROMPT_SUFFIX = args.prompt_suffix
    model = base_model_dir()
    for which in args.sets:
        res = judge(model, which, few_shot=args.few_shot, sampled=args.sampled)
        _record({"candidate": "base", "seed": 0, "set": which, **res})
        print(
            f"base {which} ({args.few_shot} worked example(s)): strict {100 * sum(res['strict']) / len(res['strict']):.1f}% "
            f"lenient {100 * sum(res['lenient']) / len(res['lenient']):.1f}% tagged {res['tagged']} "
            f"ends-42 {res['ends_42']}"
        )
        if args.sampled:
            c = res["sampled"]
            print(
                f"  sampled at T=0.7, {c['n']} answers: tagged {c['tagged']}, strict {c['strict']}, lenient "
                f"{c['lenient']}"
            )


def _last_checkpoint(run: Path) -> Path | None:
    steps = sorted(
        run.glob("checkpoints/global_step_*/actor/huggingface"), key=lambda p: int(p.parts[-3].rsplit("_", 1)[1])
    )
    return steps[-1] if steps else None


def cmd_study(args) -> None:
    verl = str(Path(sys.executable).with_name("verl"))
    for name in args.candidates:
        for seed in args.seeds:
            run = OUT / f"{name}-s{seed}"
            # the task judged is the task trained: its config on the command line (the default job's may differ)
            task = [] if "--config" in CANDIDATES[name] else ["rl_tpu.task_config=" + json.dumps(TASK_CONFIG)]
            cmd = [
                verl,
                "train",
                "--backend",
                "cpu",
                "--output-dir",
                str(run),
                f"data.seed={seed}",
                "trainer.resume_mode=disable",
                "trainer.val_before_train=false",
                *task,
                *CANDIDATES[name],
                *args.extra,
            ]
            print("$", " ".join(cmd), flush=True)
            t0 = time.monotonic()
            with open(OUT / f"{name}-s{seed}.log", "w") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            wall = time.monotonic() - t0
            if rc != 0:
                print(f"{name} seed {seed}: exit {rc}; see {OUT / f'{name}-s{seed}.log'}")
                continue
            judge_run(name, seed, run, args.sets, wall, args.extra)
            cmd_table(args)


def judge_run(name: str, seed: int, run: Path, sets, wall: float | None = None, extra: list[str] = ()) -> None:
    """Judge the last checkpoint of the run folder ``run`` on ``sets`` and record it as ``name`` at ``seed``."""
    ckpt = _last_checkpoint(run)
    if ckpt is None:
        print(f"{name} seed {seed}: no checkpoint under {run}")
        return
    rewards = []
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            data = json.loads(line).get("data", {})
            if "critic/score/mean" in data:
                rewards.append(data["critic/score/mean"])
    for which in sets:
        res = judge(str(ckpt), which, few_shot=few_shot_of(CANDIDATES[name] + list(extra)))
        _record(
            {
                "candidate": name,
                "seed": seed,
                "set": which,
                "wall_s": wall,
                "rewards": rewards,
                "overrides": CANDIDATES[name] + list(extra),
                **res,
            }
        )


def cmd_judge(args) -> None:
    judge_run(args.candidate, args.seed, Path(args.run), args.sets)
    cmd_table(args)


def cmd_table(args) -> None:
    rows = _rows()
    from verl_backend.data.converters import PROMPT_SUFFIX

    rows = [r for r in rows if r.get("prompt_suffix") == PROMPT_SUFFIX]  # gains are under one prompt
    rows = [r for r in rows if r.get("few_shot", 0) == args.few_shot]
    base = {r["set"]: r for r in rows if r["candidate"] == "base"}
    if not base:
        print("no base model rows: run `bench_recipe.py base` first")
        return
    print(
        f"{'candidate':<22} {'seed':>4} {'set':<6} {'strict':>7} {'lenient':>8} {'Δ lenient [95% CI]':>24} "
        f"{'Δ strict':>9} {'ends42':>6} {'wall':>6}"
    )
    for which in [w for w in ("val", "report") if w in base]:
        b = base[which]
        n = len(b["lenient"])
        print(
            f"{'base':<22} {'':>4} {which:<6} {100 * sum(b['strict']) / n:6.1f}% {100 * sum(b['lenient']) / n:7.1f}% "
            f"{'':>24} {'':>9} {b['ends_42']:>6}"
        )
        for r in rows:
            if r["candidate"] == "base" or r["set"] != which:
                continue
            dl, lo, hi = paired(r["lenient"], b["lenient"])
            ds, _, _ = paired(r["strict"], b["strict"])
            print(
                f"{r['candidate']:<22} {r['seed']:>4} {which:<6} {100 * sum(r['strict']) / n:6.1f}% "
                f"{100 * sum(r['lenient']) / n:7.1f}% {dl:+7.1f} [{lo:+6.1f}, {hi:+6.1f}] {ds:+8.1f} "
                f"{r['ends_42']:>6} {(r.get('wall_s') or 0) / 60:5.1f}m"
            )


def reward_slope(rows: list[dict]) -> tuple[float, float, float, int]:
    """Least-squares slope of the train reward over steps, pooled over runs, with its 95% interval.

    Args:
        rows: result rows, each with ``rewards`` (mean train reward per step, step 1 first).

    Returns: ``(slope, lo, hi, points)``, slope in reward per step (normal interval from the slope's standard error).
    """
    pts = [(i + 1, r) for row in rows for i, r in enumerate(row.get("rewards") or [])]
    n = len(pts)
    if n < 3:
        return float("nan"), float("nan"), float("nan"), n
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in pts)
    se = math.sqrt(resid / (n - 2) / sxx)
    return b, b - 1.96 * se, b + 1.96 * se, n


def cmd_slope(_args) -> None:
    from verl_backend.data.converters import PROMPT_SUFFIX

    rows = [
        r
        for r in _rows()
        if r["set"] == "report" and r["candidate"] != "base" and r.get("prompt_suffix") == PROMPT_SUFFIX
    ]
    for name in sorted({r["candidate"] for r in rows}):
        mine = [r for r in rows if r["candidate"] == name]
        b, lo, hi, n = reward_slope(mine)
        print(
            f"{name}: train reward slope {b:+.4f}/step [95% CI {lo:+.4f}, {hi:+.4f}] over {n} steps of "
            f"{len(mine)} run(s) (seeds {sorted(r['seed'] for r in mine)})"
        )


# The default job before the study, as a user ran it (its task had + and -, its validation 32 items, 1 torch thread
# a process): what #30's wall-time bound compares with.
OLD_DEFAULT = [
    *OLD,
    "rl_tpu.task_config=" + json.dumps(TASKS["basic_arithmetic"]),
    "rl_tpu.val_size=32",
    "rl_tpu.num_threads=1",
]


def cmd_walltime(args) -> None:
    """``verl train --backend cpu`` as a user runs it (validations, checkpoints), the default job against the old
    default (:data:`OLD_DEFAULT`), alternating for ``--rounds`` rounds; prints each wall time and the ratio of the
    medians. Each extra ``--variant NAME=KEY=VALUE,...`` is a third command timed in the same rounds."""
    verl = str(Path(sys.executable).with_name("verl"))
    commands = {"default": [], "old default": OLD_DEFAULT}
    for spec in args.variant:
        name, _, keys = spec.partition("=")
        commands[name] = [k for k in keys.split(",") if k]
    walls: dict[str, list[float]] = {name: [] for name in commands}
    (OUT / "walltime").mkdir(parents=True, exist_ok=True)
    for rnd in range(args.rounds):
        for name, overrides in commands.items():
            run = OUT / "walltime" / name.replace(" ", "_")
            cmd = [
                verl,
                "train",
                "--backend",
                "cpu",
                "--output-dir",
                str(run),
                "trainer.resume_mode=disable",
                *overrides,
            ]
            t0 = time.monotonic()
            with open(OUT / "walltime" / f"{name.replace(' ', '_')}-r{rnd}.log", "w") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            wall = time.monotonic() - t0
            print(
                f"round {rnd + 1}: {name}: {wall:.0f} s (exit {rc}; load average {os.getloadavg()[0]:.1f})", flush=True
            )
            if rc == 0:
                walls[name].append(wall)
    med = {k: sorted(v)[len(v) // 2] for k, v in walls.items() if v}
    for name, m in med.items():
        ratio = m / med["old default"] if "old default" in med else float("nan")
        print(f"{name}: median {m:.0f} s over {len(walls[name])} run(s), {ratio:.2f}x the old default")


def main() -> None:
    global TASK, TASK_CONFIG, OUT, RESULTS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    base = sub.add_parser("base", help="judge the base model on the validation and report sets")
    base.add_argument("--prompt-suffix", default=None, help="screen another prompt suffix (base model only)")
    base.add_argument("--sets", nargs="+", default=["val", "report"], choices=["val", "report"])
    base.add_argument("--sampled", type=int, default=0, help="also sample N answers an item at T=0.7 and count tags")
    study = sub.add_parser("study", help="train and judge candidates")
    study.add_argument("--candidates", nargs="+", required=True, choices=sorted(CANDIDATES))
    study.add_argument("--seeds", nargs="+", type=int, default=[2])
    study.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    study.add_argument("--sets", nargs="+", default=["val", "report"], choices=["val", "report"])
    sub.add_parser("table", help="print the table of everything judged so far")
    jd = sub.add_parser("judge", help="judge a finished run folder as a candidate at a seed")
    jd.add_argument("--candidate", required=True, choices=sorted(CANDIDATES))
    jd.add_argument("--seed", type=int, required=True)
    jd.add_argument("--run", required=True, help="the run's output folder")
    jd.add_argument("--sets", nargs="+", default=["val", "report"], choices=["val", "report"])
    sub.add_parser("slope", help="the train reward's slope over steps per candidate, pooled over its seeds")
    wt = sub.add_parser("walltime", help="time the default job against the old default, back to back")
    wt.add_argument("--rounds", type=int, default=1)
    wt.add_argument(
        "--variant",
        nargs="*",
        default=[],
        metavar="NAME=KEY=VALUE,...",
        help="more commands timed in the same rounds, e.g. 1thread=rl_tpu.num_threads=1",
    )
    parser.add_argument("--task", default=TASK, choices=sorted(TASKS), help="the task (and its config) studied")
    parser.add_argument(
        "--few-shot",
        type=int,
        default=0,
        help="the prompt studied: worked examples before each question (rl_tpu.few_shot); base judges under it, "
        "table shows the rows under it",
    )
    args = parser.parse_args()
    TASK, TASK_CONFIG = args.task, TASKS[args.task]
    if TASK != "basic_arithmetic":
        OUT = OUT / TASK
        RESULTS = OUT / "results.jsonl"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    {
        "base": cmd_base,
        "study": cmd_study,
        "table": cmd_table,
        "slope": cmd_slope,
        "judge": cmd_judge,
        "walltime": cmd_walltime,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
