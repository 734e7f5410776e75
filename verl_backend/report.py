"""After a run: the reward curve PNG and a summary (validation accuracy before/after, where things are)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """Rows ``{"step": int, "data": {metric: value}}`` from VeRL's file logger (JSONL), one per step; missing → ``[]``."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill or a full disk: the rest of the file still counts
                print(f"[rl-tpu] {path} line {number} is not complete JSON (cut by a kill?); left out of the report",
                      flush=True)
                continue
            # A resumed run logs the steps after its checkpoint again: the later values win.
            by_step.setdefault(int(row["step"]), {}).update(row["data"])
    return [{"step": s, "data": d} for s, d in sorted(by_step.items())]


def _val_accuracy(data: dict) -> float | None:
    vals = [v for k, v in data.items() if k.startswith("val-core/") and "/acc/" in k or k.startswith("val-core/") and k.endswith("reward/mean@1")]
    vals = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def summarize(rows: list[dict]) -> dict:
    """Validation accuracy before (first validation) and after (last), the reward curve, and step count."""
    vals = [(r["step"], _val_accuracy(r["data"])) for r in rows if _val_accuracy(r["data"]) is not None]
    curve = [
        (r["step"], float(r["data"]["critic/score/mean"]))
        for r in rows
        if isinstance(r["data"].get("critic/score/mean"), (int, float))
    ]
    return {
        "val_accuracy_before": vals[0][1] if vals else None,
        "val_accuracy_after": vals[-1][1] if len(vals) > 1 else None,
        "val_points": vals,
        "train_reward_curve": curve,
        "training_steps": max((s for s, _ in curve), default=0),
    }


def plot_reward_curve(summary: dict, path: Path) -> Path | None:
    """Write the training reward (mean score per step) and validation accuracy to a PNG."""
    if not summary["train_reward_curve"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps, rewards = zip(*summary["train_reward_curve"])
    ax.plot(steps, rewards, marker="o", label="train reward (critic/score/mean)")
    if summary["val_points"]:
        vs, va = zip(*summary["val_points"])
        ax.plot(vs, va, marker="s", linestyle="--", label="validation accuracy")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
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


def write_report(out: Path, wall_s: float) -> str:
    """Write ``summary.json`` and ``reward_curve.png`` into ``out``; return the text printed to the user."""
    summary = summarize(read_metrics(out / "metrics.jsonl"))
    png = plot_reward_curve(summary, out / "reward_curve.png")
    ckpt = latest_hf_checkpoint(out)
    summary.update({"wall_s": wall_s, "checkpoint": str(ckpt) if ckpt else None, "output_dir": str(out)})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = [
        f"[rl-tpu] run finished in {wall_s / 60:.1f} min: {summary['training_steps']} "
        f"step{'' if summary['training_steps'] == 1 else 's'}",
        f"[rl-tpu] validation accuracy: before {pct(summary['val_accuracy_before'])} -> after {pct(summary['val_accuracy_after'])}",
        f"[rl-tpu] output folder: {out}",
        f"[rl-tpu]   metrics:     {out / 'metrics.jsonl'}  (TensorBoard: {out / 'tensorboard'})",
        f"[rl-tpu]   reward curve: {png if png else 'n/a (no training steps logged)'}",
        f"[rl-tpu]   checkpoint:  {ckpt if ckpt else 'n/a (no checkpoint saved)'}",
    ]
    return "\n".join(lines)
