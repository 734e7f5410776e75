"""After a run: the reward curve PNG and a summary (validation accuracy before/after, where things are)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from verl_backend.patches.verl import KEPT_GROUPS_KEY, REPLACED_GROUPS_KEY, REPLACED_SCORE_SUM_KEY


def read_metrics(path: Path) -> list[dict]:
    """Rows ``{"step": int, "data": {metric: value}}`` from VeRL's file logger (JSONL), one per step;
    missing → ``[]``."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill or a full disk: the rest of the file still counts
                print(
                    f"[rl-tpu] {path} line {number} is not complete JSON (cut by a kill?); left out of the report",
                    flush=True,
                )
                continue
            # A resumed run logs the steps after its checkpoint again: the later values win.
            by_step.setdefault(int(row["step"]), {}).update(row["data"])
    return [{"step": s, "data": d} for s, d in sorted(by_step.items())]


def _val_accuracy(data: dict) -> float | None:
    vals = [v for k, v in data.items() if k.startswith("val-core/") and ("/acc/" in k or k.endswith("reward/mean@1"))]
    vals = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _val_strict(data: dict) -> float | None:
    vals = [
        float(v)
        for k, v in data.items()
        if k.startswith(("val-core/", "val-aux/"))
        and "/acc_strict/mean@" in k
        and isinstance(v, (int, float))
        and math.isfinite(v)
    ]
    return sum(vals) / len(vals) if vals else None


# Steps in the train reward's running mean: 4 steps of the default job are its 16 prompts, 128 samples.
RUNNING_MEAN_STEPS = 4


#: VeRL 0.9.1's per-step count of the groups DAPO's dynamic sampling replaced for having no reward spread (a count
#: of groups despite its name; ``verl/trainer/ppo/v1/replay_buffer.py``)
GROUPS_REPLACED_KEY = "training/filter_groups/evicted_samples"


def running_mean(values: list[float], window: int = RUNNING_MEAN_STEPS) -> list[float]:
    """The mean of each value with the ``window - 1`` before it (fewer at the start): the reward curve a person
    reads, where one step's mean over a few prompts is mostly which prompts were drawn."""
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1])
        for i in range(len(values))
    ]


def graded_reward(data: dict) -> tuple[float, int] | None:
    """``(reward, groups)``: the mean score of every group a DAPO step graded, the groups trained on (VeRL's
    ``critic/score/mean`` over ``rl_tpu/filter_groups/kept_groups_total`` groups) and the groups replaced for having no
    reward spread (their scores summed in ``rl_tpu/filter_groups/replaced_score_sum``;
    :func:`verl_backend.patches.verl.graded_group_metrics`), each group weighted alike (every group has
    ``rollout.n`` samples). The learning curve under DAPO's dynamic sampling, where the kept groups' reward stays near
    the middle by construction. ``None`` for a step without those metrics (DAPO off, or filtering on another metric).
    """
    kept, replaced, total = (data.get(k) for k in (KEPT_GROUPS_KEY, REPLACED_GROUPS_KEY, REPLACED_SCORE_SUM_KEY))
    score = data.get("critic/score/mean")
    if not all(isinstance(v, (int, float)) for v in (kept, replaced, total, score)) or kept + replaced <= 0:
        return None
    return (float(score) * kept + float(total)) / (kept + replaced), int(kept + replaced)


def summarize(rows: list[dict]) -> dict:
    """Validation accuracy before (first validation) and after (last), lenient (VeRL's core ``acc``, else the reward's
    mean) and strict where the reward function reports ``acc_strict``; the reward curve with its running mean
    (:data:`RUNNING_MEAN_STEPS` steps); the step count; and, under DAPO's dynamic sampling
    (``algorithm.filter_groups.enable=true``), each step's count of groups VeRL replaced for having no reward spread
    (``training/filter_groups/evicted_samples``): the curve is then the reward of the groups trained on, which a
    rising share of all-right groups does not lift, so the reward of every group graded (:func:`graded_reward`) and
    its running mean are given beside it."""
    vals = [(r["step"], _val_accuracy(r["data"])) for r in rows if _val_accuracy(r["data"]) is not None]
    strict = [(r["step"], _val_strict(r["data"])) for r in rows if _val_strict(r["data"]) is not None]
    curve = [
        (r["step"], float(r["data"]["critic/score/mean"]))
        for r in rows
        if isinstance(r["data"].get("critic/score/mean"), (int, float))
    ]
    smooth = running_mean([v for _, v in curve])
    replaced = [
        (r["step"], int(r["data"][GROUPS_REPLACED_KEY]))
        for r in rows
        if isinstance(r["data"].get(GROUPS_REPLACED_KEY), (int, float))
    ]
    graded = [(r["step"], g[0]) for r in rows if (g := graded_reward(r["data"])) is not None]
    return {
        "val_accuracy_before": vals[0][1] if vals else None,
        "val_accuracy_after": vals[-1][1] if len(vals) > 1 else None,
        "val_points": vals,
        "val_strict_points": strict,
        "train_reward_curve": curve,
        "train_reward_running_mean": [(s, m) for (s, _), m in zip(curve, smooth)],
        "training_steps": max((s for s, _ in curve), default=0),
        "groups_replaced_no_spread": replaced,
        "graded_reward_curve": graded,
        "graded_reward_running_mean": [(s, m) for (s, _), m in zip(graded, running_mean([v for _, v in graded]))],
    }


def plot_reward_curve(summary: dict, path: Path) -> Path | None:
    """Write the training reward (each step's mean score, and its running mean) and the validation accuracy, lenient
    and strict, to a PNG."""
    if not summary["train_reward_curve"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.2))
    steps, rewards = zip(*summary["train_reward_curve"])
    graded = summary.get("graded_reward_curve")
    trained_on = " of the groups trained on" if graded or summary.get("groups_replaced_no_spread") else ""
    ax.plot(steps, rewards, marker="o", linestyle="none", alpha=0.4, label=f"train reward{trained_on}, each step")
    if graded:  # under DAPO: the kept groups' reward sits near the middle; the learning shows in all groups graded
        gs, gv = zip(*graded)
        ax.plot(gs, gv, marker="x", linestyle="none", alpha=0.5, label="train reward of all groups graded, each step")
        ms, mv = zip(*summary["graded_reward_running_mean"])
        ax.plot(ms, mv, linewidth=2, label=f"train reward of all groups graded, mean of {RUNNING_MEAN_STEPS} steps")
    elif summary.get("train_reward_running_mean"):
        ms, mv = zip(*summary["train_reward_running_mean"])
        ax.plot(ms, mv, linewidth=2, label=f"train reward{trained_on}, mean of {RUNNING_MEAN_STEPS} steps")
    if summary["val_points"]:
        vs, va = zip(*summary["val_points"])
        ax.plot(vs, va, marker="s", linestyle="--", label="validation accuracy, lenient")
    if summary.get("val_strict_points"):
        vs, va = zip(*summary["val_strict_points"])
        ax.plot(vs, va, marker="^", linestyle=":", label="validation accuracy, strict (tagged)")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    # below the axes: inside them it covers the points of a curve that crosses the middle
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latest_hf_checkpoint(out: Path) -> Path | None:
    """``<out>/checkpoints/global_step_N/actor/huggingface`` of the highest N that holds weights."""
    best = None
    for d in (out / "checkpoints").glob("global_step_*/actor/huggingface"):
        if any(d.glob("*.safetensors")):
            n = int(d.parent.parent.name.rsplit("_", 1)[1])
            if best is None or n > best[0]:
                best = (n, d)
    return best[1] if best else None


def _validation_items(path: Path) -> list[dict]:
    """The items of one of VeRL's validation dumps (``trainer.validation_data_dir/<step>.jsonl``: ``input``,
    ``output``, ``score``, ...), in file order; unreadable lines left out."""
    items = []
    for line in path.read_text().splitlines():
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return items


def lenient_correct(item: dict) -> float:
    """1.0 when a dumped item (VeRL's validation or rollout dump line) is right, the answer in tags or not: its
    ``acc`` where the reward function gave one (the project's does, apart from the reward), else a full score."""
    if isinstance(item.get("acc"), (int, float)):
        return float(item["acc"] >= 1.0)
    return float(float(item.get("score") or 0.0) >= 1.0)


def strict_correct(item: dict) -> float:
    """1.0 when a dumped item is right with its answer inside ``<answer>`` tags: its ``acc_strict`` where the reward
    function gave one, else a full score with tags in the output (a reward that also takes a bare last number)."""
    if isinstance(item.get("acc_strict"), (int, float)):
        return float(item["acc_strict"] >= 1.0)
    output = str(item.get("output", ""))
    tagged = re.search(r"<answer>.*?</answer>", output, re.S) is not None
    return float(tagged and float(item.get("score") or 0.0) >= 1.0)


def _t975(df: int) -> float:
    """The 97.5% point of Student's t with ``df`` degrees of freedom."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, df))
    except ImportError:  # the normal's, a little narrow below 30 items
        return 1.96


def paired_difference(before: list[float], after: list[float]) -> dict:
    """Mean of ``after - before`` over the same items, with its 95% interval (Student's t on the per-item
    differences; for scores in {0, 1} these are -1, 0, 1)."""
    diffs = [a - b for a, b in zip(after, before)]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else float("nan")
    half = _t975(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    unchanged = n > 0 and all(d == 0 for d in diffs)
    if unchanged:  # the t interval has no width; |difference| <= the share of items that change, which with 0
        half = 1 - 0.05 ** (1 / n)  # of n seen is below this at 95% (about 3/n: the rule of three)
    return {
        "n": n,
        "before": sum(before) / n,
        "after": sum(after) / n,
        "diff": mean,
        "low": mean - half,
        "high": mean + half,
        "unchanged": unchanged,
    }


def validation_change(folder: Path | None) -> dict | None:
    """Accuracy before (the first validation dump) and after (the last) over the same items, paired by prompt:
    ``{"lenient": paired_difference(...), "strict": ..., "before_step", "after_step"}``; ``None`` without two dumps
    that share items. Accuracy is the share of right items (:func:`lenient_correct`, :func:`strict_correct`), not
    the reward's mean."""
    if folder is None or not Path(folder).is_dir():
        return None
    dumps = sorted((int(p.stem), p) for p in Path(folder).glob("*.jsonl") if p.stem.isdigit())
    if len(dumps) < 2:
        return None
    (first, first_path), (last, last_path) = dumps[0], dumps[-1]

    def by_input(items):
        keyed: dict[str, list[dict]] = {}
        for item in items:
            keyed.setdefault(str(item.get("input")), []).append(item)
        return keyed

    before, after = by_input(_validation_items(first_path)), by_input(_validation_items(last_path))
    pairs = [(b, a) for key in before if key in after for b, a in zip(before[key], after[key])]
    if not pairs:
        return None
    result = {"before_step": first, "after_step": last}
    for name, value in (("lenient", lenient_correct), ("strict", strict_correct)):
        result[name] = paired_difference([value(b) for b, _ in pairs], [value(a) for _, a in pairs])
    return result


def accuracy_lines(summary: dict) -> list[str]:
    """The summary's validation lines: before -> after with the paired 95% interval, then strict and lenient."""
    change = summary.get("val_change")

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    points_seen = summary.get("val_points") or []
    if not change and len(points_seen) == 1:  # one validation (e.g. trainer.val_before_train=false): no before
        step, acc = points_seen[0]
        return [
            f"[rl-tpu] validation accuracy at step {step}: {pct(acc)} (the run's only validation: nothing to "
            f"compare it with)"
        ]
    if not change:
        return [
            f"[rl-tpu] validation accuracy: before {pct(summary['val_accuracy_before'])} -> after "
            f"{pct(summary['val_accuracy_after'])} (no per-item validation dumps to pair, so no interval)"
        ]
    lenient, strict = change["lenient"], change["strict"]

    def points(d):
        if not math.isfinite(d["low"]):
            return f"{100 * d['diff']:+.1f} points"
        how = ", no item changed (rule of three)" if d.get("unchanged") else ""
        return f"{100 * d['diff']:+.1f} points, 95% CI {100 * d['low']:+.1f} to {100 * d['high']:+.1f}{how}"

    return [
        f"[rl-tpu] validation accuracy: before {pct(lenient['before'])} -> after {pct(lenient['after'])} "
        f"({points(lenient)}; paired over the same {lenient['n']} items)",
        f"[rl-tpu]   strict (answer in <answer> tags): {pct(strict['before'])} -> {pct(strict['after'])} "
        f"({points(strict)}); lenient (last number also counts): the line above",
    ]


def graded_reward_line(summary: dict) -> list[str]:
    """Under DAPO's dynamic sampling on the reward, one line: the reward of every group graded (:func:`graded_reward`)
    over the first :data:`RUNNING_MEAN_STEPS` steps against the last as many; none for a shorter run or without it."""
    graded = [v for _, v in summary.get("graded_reward_curve") or []]
    if len(graded) < 2 * RUNNING_MEAN_STEPS:
        return []
    first, last = graded[:RUNNING_MEAN_STEPS], graded[-RUNNING_MEAN_STEPS:]
    return [
        f"[rl-tpu] train reward of all groups graded (trained on or replaced): first {RUNNING_MEAN_STEPS} steps "
        f"{sum(first) / len(first):.3f} -> last {RUNNING_MEAN_STEPS} steps {sum(last) / len(last):.3f}"
    ]


def write_report(out: Path, wall_s: float, validation_dir: Path | None = None) -> str:
    """Write ``summary.json`` and ``reward_curve.png`` into ``out``; return the text printed to the user.
    ``validation_dir``: VeRL's per-item validation dumps (``trainer.validation_data_dir``) for the paired
    interval; default ``out/validation``."""
    summary = summarize(read_metrics(out / "metrics.jsonl"))
    summary["val_change"] = validation_change(validation_dir or out / "validation")
    png = plot_reward_curve(summary, out / "reward_curve.png")
    ckpt = latest_hf_checkpoint(out)
    summary.update({"wall_s": wall_s, "checkpoint": str(ckpt) if ckpt else None, "output_dir": str(out)})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = [
        f"[rl-tpu] run finished in {wall_s / 60:.1f} min: {summary['training_steps']} "
        f"step{'' if summary['training_steps'] == 1 else 's'}"
        + (
            f" ({replaced} groups without a reward spread replaced by DAPO's dynamic sampling)"
            if (replaced := sum(n for _, n in summary["groups_replaced_no_spread"]))
            else ""
        ),
        *graded_reward_line(summary),
        *accuracy_lines(summary),
        f"[rl-tpu] output folder: {out}",
        f"[rl-tpu]   metrics:     {out / 'metrics.jsonl'}  (TensorBoard: {out / 'tensorboard'})",
        f"[rl-tpu]   reward curve: {png if png else 'n/a (no training steps logged)'}",
        f"[rl-tpu]   checkpoint:  {ckpt if ckpt else 'n/a (no checkpoint saved)'}",
    ]
    return "\n".join(lines)
