"""The CPU host-memory machinery, each part on and off: is its default the one the measurements support?

The default job (``verl train --backend cpu``: SmolLM2-135M-Instruct fp32, reasoning-gym ``basic_arithmetic``, 4
prompts x 4 samples, responses <= 64 tokens) runs with every default, then with one setting of the machinery flipped
at a time (VeRL-style keys on the command line, so the run's ``config.yaml`` records them):

- ``rl_tpu.fork_server`` (default on): Ray's workers forked from one process that imported torch and VeRL;
- ``rl_tpu.trim_backward`` (default off, as this benchmark found): the actor's backward hands freed activation pages
  back to the OS per block;
- ``rl_tpu.plain_module`` (default on): one CPU rank runs the model without FSDP2;
- ``rl_tpu.compact_malloc`` (default off): glibc settings that keep the backward from fragmenting the heap.

Runs are interleaved (round 1: every configuration, then round 2, ...) so a change in the machine's load hits them
alike; each figure is the median over the rounds. Per run: ``s/step`` the mean ``timing_s/step`` of steps 2..N
(step 1 is warm-up), ``update s`` the same for ``timing_s/update_actor``, ``wall s`` the whole command (start-up
included: the fork server's gain is there), ``peak PSS`` the largest summed proportional set size of every process
of the run (the sampler of ``bench_grpo_step.py``).

**The rule** (stated once, here and in the README): a part is on by default when, against the configuration without
it, it lowers the median peak PSS by >= 3% while the median s/step rises by <= 5%, or it lowers the median s/step or
wall time by >= 5% while the peak PSS rises by <= 3%. The last column says whether each default follows the rule.

    python benchmarks/bench_host_memory.py [--rounds 3] [--steps 3] [--threads 1] [--only NAME ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_grpo_step import BenchError, _mean_after_warmup, run_ours

from verl_backend.settings import BY_NAME

# (setting, its default in the settings table): each configuration flips one of them
PARTS = tuple(
    (name, BY_NAME[name].default) for name in ("fork_server", "trim_backward", "plain_module", "compact_malloc")
)
MEMORY_GAIN, TIME_COST = 0.03, 0.05  # the rule's thresholds (fractions)


def follows_rule(on: dict, off: dict) -> tuple[bool, str]:
    """Whether having the part on pays against having it off (the module docstring's rule), and why.

    Args:
        on, off: medians with keys ``step_s``, ``wall_s``, ``peak_pss`` (seconds, seconds, GiB).
    """
    mem = on["peak_pss"] / off["peak_pss"] - 1
    step = on["step_s"] / off["step_s"] - 1
    wall = on["wall_s"] / off["wall_s"] - 1
    why = f"on vs off: peak PSS {mem:+.1%}, s/step {step:+.1%}, wall {wall:+.1%}"
    pays = (mem <= -MEMORY_GAIN and step <= TIME_COST) or (min(step, wall) <= -TIME_COST and mem <= MEMORY_GAIN)
    return pays, why


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every configuration (median)")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per run (step 1 is warm-up; >= 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--only", nargs="+", choices=[p for p, _ in PARTS], help="flip only these parts")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    ap.add_argument("--keep", help="keep the run folders (logs, metrics) here instead of a temporary folder")
    args = ap.parse_args()
    if args.steps < 2 or args.rounds < 1:
        print("bench_host_memory: error: --steps must be >= 2 and --rounds >= 1", file=sys.stderr)
        return 2
    parts = [(p, d) for p, d in PARTS if not args.only or p in args.only]
    configs = [("defaults", [])] + [
        (f"{p}={str(not d).lower()}", [f"rl_tpu.{p}={str(not d).lower()}"]) for p, d in parts
    ]
    root = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="bench_host_memory_"))
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    try:
        for rnd in range(args.rounds):
            for i, (name, overrides) in enumerate(configs):
                work = root / f"r{rnd}_{i}"
                work.mkdir(parents=True, exist_ok=True)
                print(f"[bench] round {rnd + 1}/{args.rounds}: {name}, logs in {work}", flush=True)
                r = run_ours(work, args.steps, args.threads, args.timeout, overrides)
                runs[name].append(
                    {
                        "step_s": _mean_after_warmup(r["step_s"]),
                        "update_s": _mean_after_warmup(r["update_s"]),
                        "wall_s": r["wall_s"],
                        "peak_pss": r["memory"]["peak_pss_total_gib"],
                    }
                )
    except BenchError as exc:
        print(f"bench_host_memory: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    load = os.getloadavg()
    print(
        f"\nDefault job, {args.steps} steps, {args.threads} torch thread(s) per process; medians of {args.rounds} "
        f"interleaved rounds; {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n"
    )
    head = ["configuration", "s/step", "update s", "wall s", "peak PSS GiB", "default follows the rule?"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    base = med["defaults"]
    print(
        f"| defaults | {base['step_s']:.2f} | {base['update_s']:.2f} | {base['wall_s']:.0f} | "
        f"{base['peak_pss']:.2f} | |"
    )
    verdicts = []
    for (name, _), (part, default) in zip(configs[1:], parts):
        m = med[name]
        on, off = (base, m) if default else (m, base)
        pays, why = follows_rule(on, off)
        ok = pays == default
        verdicts.append(ok)
        print(
            f"| {name} | {m['step_s']:.2f} | {m['update_s']:.2f} | {m['wall_s']:.0f} | {m['peak_pss']:.2f} | "
            f"{'yes' if ok else 'NO'}: {part} {'pays' if pays else 'does not pay'} ({why}) |"
        )
    for name, rs in runs.items():
        print(
            f"\n{name}: s/step {[round(r['step_s'], 2) for r in rs]}, peak PSS "
            f"{[round(r['peak_pss'], 2) for r in rs]} GiB, wall {[round(r['wall_s']) for r in rs]} s"
        )
    return 0 if all(verdicts) else 3


if __name__ == "__main__":
    sys.exit(main())
