"""The default job's step time, two checkouts side by side: is a change (a refactor, a patch) any slower?

Runs ``verl train --backend cpu`` (the embedded default, or ``--steps`` of it) from each checkout in turn, A B A B
... for ``--rounds`` rounds, on this machine with the same venv (each checkout's code first on ``PYTHONPATH``), and
prints one table: each run's mean ``timing_s/step`` (VeRL's, over the steps after the first, which also compiles and
warms caches), each checkout's median over its rounds, and the ratio after / before. Rounds alternate so that load
drifting on a shared machine falls on both.

    python benchmarks/bench_step_time.py --before /tmp/before --after . --steps 5 --rounds 2

A run's validation is skipped (``trainer.test_freq=-1``, ``trainer.val_before_train=false``): the step is what is
timed. Numbers are seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(checkout: Path, steps: int, out: Path, timeout_s: float) -> dict:
    """One default run from ``checkout``: ``{"step_s": [...], "wall_s": float, "rc": int}`` (``step_s``: VeRL's
    ``timing_s/step`` of every step, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    argv = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
    ]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    steps_s = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            data = row.get("data", row)
            if isinstance(data.get("timing_s/step"), (int, float)):
                steps_s.append(float(data["timing_s/step"]))
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-2000:])
    return {"step_s": steps_s, "wall_s": wall, "rc": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--after", type=Path, default=Path("."), help="the checkout after it (default: this one)")
    parser.add_argument("--steps", type=int, default=5, help="training steps a run (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each checkout, alternating (default 2)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="seconds a run may take")
    parser.add_argument("--json", type=Path, help="also write the runs here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="bench_step_time_") as tmp:
        for r in range(args.rounds):
            for name in ("before", "after"):
                out = Path(tmp) / f"{name}{r}"
                result = run_once(getattr(args, name), args.steps, out, args.timeout_s)
                runs[name].append(result)
                timed = result["step_s"][1:] or result["step_s"]
                mean = statistics.mean(timed) if timed else float("nan")
                print(
                    f"round {r + 1} {name:<6} rc {result['rc']} steps {len(result['step_s'])} "
                    f"mean s/step (after the first) {mean:.2f}  wall {result['wall_s']:.0f} s",
                    flush=True,
                )
    medians = {}
    for name, results in runs.items():
        means = [statistics.mean(r["step_s"][1:] or r["step_s"]) for r in results if r["step_s"]]
        medians[name] = statistics.median(means) if means else float("nan")
    print(f"{'checkout':<8} {'median s/step':>14}")
    for name in ("before", "after"):
        print(f"{name:<8} {medians[name]:>14.2f}")
    print(f"ratio after / before: {medians['after'] / medians['before']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=1))
    return 0 if all(r["rc"] == 0 for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
