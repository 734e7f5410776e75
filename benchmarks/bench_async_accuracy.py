"""Held-out accuracy at equal wall time: does an asynchronous mode learn less per minute than sync?

Every run is the default job of ``verl train --backend cpu`` (SmolLM2-135M-Instruct fp32, reasoning-gym's
basic_arithmetic, 4 prompts x 4 samples) in one of :data:`bench_async.MODES`, with ``--val-size`` held-out problems
(``rl_tpu.val_size``; the same items in every run: ``rl_tpu.seed`` is fixed, and the seeds vary VeRL's
``data.seed``, the order of the training prompts, and the sampling). Each mode trains for the same wall time: its
step count is ``round(--minutes x 60 / s_step)``, with ``s_step`` the mode's median seconds per step from a
``bench_async.py --out`` file (``--calibration``) or given (``--s-step MODE=S``). Greedy validation
(``val_kwargs``: temperature 0) runs after the last step; the accuracy before training is the same for every run
(same weights, same items, greedy), so it is measured once, in the first run (``trainer.val_before_train``).

Columns: steps, training seconds (sum of VeRL's ``timing_s/step``: the wall time the budget is about), accuracy after,
its gain over before, and the gain per training minute; the median and every seed's value.

    python benchmarks/bench_async_accuracy.py --calibration async.json [--modes sync-2t,separate_async]
        [--seeds 1,2,3] [--minutes 4] [--val-size 200] [--cpus 0,1] [--out acc.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench_async import MODES
from bench_grpo_step import BenchError, run_ours


def accuracy(run: Path) -> dict:
    """Validation accuracy before (if measured) and after, and training seconds, from ``run/verl``."""
    from verl_backend.driver.report import _val_accuracy

    rows = [json.loads(line) for line in (run / "verl" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [(r["step"], _val_accuracy(r["data"])) for r in rows if _val_accuracy(r["data"]) is not None]
    train = [float(r["data"]["timing_s/step"]) for r in rows if "timing_s/step" in r["data"]]
    if not vals:
        raise BenchError(f"{run / 'verl' / 'metrics.jsonl'} has no validation accuracy (val-core/...)")
    return {
        "before": vals[0][1] if len(vals) > 1 else None,
        "after": vals[-1][1],
        "train_s": sum(train),
        "steps": len(train),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="sync-2t,separate_async", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--seeds", default="1,2,3", help="VeRL data.seed of each run, comma-separated")
    ap.add_argument("--minutes", type=float, default=4.0, help="training wall time per run, minutes")
    ap.add_argument("--val-size", type=int, default=200, help="held-out problems (rl_tpu.val_size)")
    ap.add_argument("--calibration", help="bench_async.py --out JSON: each mode's median s/step")
    ap.add_argument("--s-step", action="append", default=[], metavar="MODE=S", help="a mode's s/step, given")
    ap.add_argument("--cpus", help="CPU ids to pin every run to (e.g. 0,1)")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds allowed per run")
    ap.add_argument("--out", help="also write the results as JSON to this file")
    ap.add_argument("--keep", help="keep the run folders here instead of a temp folder")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    s_step: dict[str, float] = {}
    if args.calibration:
        cal = json.loads(Path(args.calibration).read_text())["results"]
        s_step.update({m: statistics.median(r["step_s"] for r in runs) for m, runs in cal.items() if runs})
    s_step.update({k: float(v) for k, v in (item.split("=", 1) for item in args.s_step)})
    missing = [m for m in modes if m not in MODES or m not in s_step]
    if missing or args.minutes <= 0 or args.val_size < 1:
        print(
            f"bench_async_accuracy: error: modes {missing} unknown or without s/step (--calibration or --s-step "
            f"MODE=S); --minutes > 0, --val-size >= 1",
            file=sys.stderr,
        )
        return 2
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="bench_acc_"))
    results: dict[str, list[dict]] = {m: [] for m in modes}
    before = None
    try:
        for seed in seeds:  # interleaved: every mode once per seed
            for mode in modes:
                steps = max(2, round(args.minutes * 60 / s_step[mode]))
                threads, overrides = MODES[mode]
                first = before is None
                print(f"[bench] seed {seed}: {mode}, {steps} steps ({s_step[mode]:.1f} s/step)", flush=True)
                folder = work / f"s{seed}_{mode}"
                folder.mkdir(parents=True, exist_ok=True)
                run_ours(
                    folder,
                    steps,
                    threads,
                    args.timeout,
                    overrides
                    + [
                        f"data.seed={seed}",
                        f"rl_tpu.val_size={args.val_size}",
                        f"trainer.test_freq={steps}",
                        f"trainer.val_before_train={str(first).lower()}",
                    ],
                )
                r = accuracy(folder)
                if first:
                    before = r["before"]
                results[mode].append({"seed": seed, **r})
    except BenchError as exc:
        print(f"bench_async_accuracy: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "results": results,
                    "before": before,
                    "minutes": args.minutes,
                    "val_size": args.val_size,
                    "s_step": s_step,
                },
                indent=1,
            )
        )
    print(
        f"\nheld-out accuracy on {args.val_size} basic_arithmetic items after ~{args.minutes:g} min of training, "
        f"seeds {seeds}; before training: {before:.3f} (greedy)\n"
    )
    print("| mode | steps | train s | accuracy after | gain | gain per train minute | per seed (after) |")
    print("|---|---|---|---|---|---|---|")
    for mode, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("steps", "train_s", "after")}
        rate = statistics.median((r["after"] - before) / (r["train_s"] / 60) for r in runs)
        per_seed = ", ".join(f"{r['after']:.3f}" for r in runs)
        print(
            f"| {mode} | {med['steps']:.0f} | {med['train_s']:.0f} | {med['after']:.3f} | "
            f"{med['after'] - before:+.3f} | {rate:+.4f} | {per_seed} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
