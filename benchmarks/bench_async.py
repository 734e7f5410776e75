"""Synchronous against asynchronous RL on ``verl train --backend cpu``: seconds per step, trained tokens per second,
and how much the rollout's and the update's busy intervals overlap.

Modes, run in interleaved rounds (round r runs every mode once, in order) and reported as the median over rounds:

- ``sync-1t``: VeRL's ``trainer.v1.trainer_mode=sync``, 1 torch thread per process (today's default);
- ``sync-2t``: the same with 2 threads, so an async mode does not win merely by using an idle core;
- ``colocate_async``: ``trainer.v1.trainer_mode=colocate_async`` (one warm-up batch, VeRL's staleness bound), 1 thread;
- ``separate_async``: ``trainer.v1.trainer_mode=separate_async`` with a one-worker rollout pool and rl-tpu's ``gloo``
  checkpoint engine between the pools. A mode refused before Ray (one ``verl: error:`` line,
  ``verl_backend.driver.preflight_async``) or failing is not retried in later rounds: the table says ``refused`` or
  ``failed`` with the line, and the other modes go on;
- ``separate_async-2t``: the same with 2 threads per process (not in the default ``--modes``);
- ``sync-2t-passive`` and ``separate_async-2t1r-passive``: sync with 2 threads, and separate_async with 2 threads for
  the trainer and 1 for the rollout (``rl_tpu.rollout_num_threads=1``), both with OpenMP's passive wait
  (``rl_tpu.omp_wait_policy=passive``: a waiting thread sleeps, so a 2-thread process does not spin against the other
  processes for the two cores). Not in the default ``--modes``.

Every run is the default job of :func:`bench_grpo_step.run_ours` (SmolLM2-135M-Instruct fp32, basic_arithmetic, 4
prompts x 4 samples, completions <= 64 tokens), pinned with the CPU affinity this script has (``--cpus``, default
all of them; every process of the run inherits it).

Columns (steps 2..N; step 1 is warm-up):

- ``s/step``: VeRL's ``timing_s/step``, mean over the run, median over rounds.
- ``trained tok/s``: response tokens trained per step (``response_length/mean`` x ``data.train_batch_size`` x
  ``rollout.n`` from the run's config.yaml) / ``timing_s/step``.
- ``rollout busy s`` / ``update busy s`` / ``trainer busy s``, and ``overlap``: VeRL 0.9.1 logs per-step durations,
  no timestamps, so busy intervals are measured from outside: every 0.2 s this script reads the CPU time of every
  process of the run (found by an environment marker that Ray's workers inherit). The rollout is busy while
  ``ray::NativeRolloutServer`` used >= ``--busy`` (default 0.25) of a core since the last sample; the trainer while
  any ``ray::WorkerDict`` process did; the update while it did with ``update_actor`` in its Ray process title.
  ``overlap`` = time rollout and update were busy together / the shorter of the two; ``overlap (trainer)`` the same
  against all trainer work (old/ref log-probs, update). 0 = strictly one after the other, 1 = the shorter is hidden.
  Measured over the window from the first step's metrics line to the last one (so over steps 2..N), to 0.2 s.
  The threshold is in cores: on a machine loaded past its cores a busy process gets less than ``--busy`` of one and
  reads idle, so the table also gives each side's CPU seconds in the window (``rollout CPU s``, ``trainer CPU s``),
  which do not depend on it; a run whose load average (printed) is well above its CPUs has no usable overlap.

    python benchmarks/bench_async.py [--rounds 3] [--steps 4] [--modes sync-1t,sync-2t,colocate_async,separate_async]
        [--cpus 0,1] [--set KEY=VALUE ...] [--out async.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from itertools import pairwise
from pathlib import Path

import psutil
import yaml
from bench_grpo_step import BenchError, MemorySampler, _mean_after_warmup, run_ours

BUSY_ENV = "RL_TPU_BENCH_BUSY"  # set in this process around each run: run_ours passes os.environ to the run
MODES = {  # name -> (torch threads per process, VeRL overrides)
    "sync-1t": (1, ["trainer.v1.trainer_mode=sync"]),
    "sync-2t": (2, ["trainer.v1.trainer_mode=sync"]),
    "colocate_async": (1, ["trainer.v1.trainer_mode=colocate_async"]),
    "separate_async": (
        1,
        [
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.separate_async.parameter_sync_step=1",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
        ],
    ),
}
# separate_async with 2 torch threads per process: the trainer's update uses both cores while the rollout, which
# needs a fraction of one, runs beside it (oversubscribed while both compute)
MODES["separate_async-2t"] = (2, MODES["separate_async"][1])
# OpenMP's passive wait (rl_tpu.omp_wait_policy): a waiting thread sleeps instead of spinning, so a 2-thread process
# loses little when another process (the rollout, this script's sampler, Ray's own) takes a core for a while
PASSIVE = ["rl_tpu.omp_wait_policy=passive"]
MODES["sync-2t-passive"] = (2, MODES["sync-2t"][1] + PASSIVE)
# the trainer on 2 threads, the rollout on 1 (rl_tpu.rollout_num_threads): the update has both cores while the
# rollout waits for new weights, and one of them while it samples
MODES["separate_async-2t1r-passive"] = (2, MODES["separate_async"][1] + PASSIVE + ["rl_tpu.rollout_num_threads=1"])


class BusySampler(threading.Thread):
    """Every ``interval`` s: CPU seconds of each process of the run whose environment has ``BUSY_ENV=run_id``,
    classified as rollout (``ray::NativeRolloutServer``), update (``ray::WorkerDict...update_actor``) or other
    trainer work (``ray::WorkerDict``); ``step_times``: when each step's line appeared in ``step_log``.
    ``samples``: (time, rollout cores, trainer cores, update cores)."""

    def __init__(self, run_id: str, step_log: Path, interval: float = 0.2):
        super().__init__(daemon=True)
        self.run_id, self.step_log, self.interval = run_id, step_log, interval
        self.step_times: list[float] = []  # when each training step's metrics line was first seen
        self._ours: dict[tuple[int, float], bool] = {}
        self._last: dict[tuple[int, float], float] = {}
        self._stop_event = threading.Event()
        self.samples: list[tuple[float, float, float, float]] = []

    def _is_ours(self, p: psutil.Process, key) -> bool:
        if key not in self._ours:
            try:
                self._ours[key] = p.environ().get(BUSY_ENV) == self.run_id
            except psutil.Error:
                return False
        return self._ours[key]

    def run(self) -> None:
        last_t = time.time()
        while not self._stop_event.wait(self.interval):
            now, cores = time.time(), {"rollout": 0.0, "trainer": 0.0, "update": 0.0}
            for p in psutil.process_iter(["pid", "create_time"]):
                key = (p.pid, p.info["create_time"])
                if not self._is_ours(p, key):
                    continue
                try:
                    cpu, title = p.cpu_times(), (p.cmdline() or [""])[0]
                except psutil.Error:
                    continue
                used = cpu.user + cpu.system
                delta, self._last[key] = used - self._last.get(key, used), used
                role = MemorySampler._role([title], "")
                if role == "ray::NativeRolloutServer":
                    cores["rollout"] += delta
                elif role == "ray::WorkerDict":
                    cores["trainer"] += delta
                    if "update_actor" in title:
                        cores["update"] += delta
            if self.step_log.is_file():
                done = self.step_log.read_text(errors="replace").count('"timing_s/step"')
                self.step_times.extend([now] * (done - len(self.step_times)))
            dt = max(now - last_t, 1e-6)
            self.samples.append((now, cores["rollout"] / dt, cores["trainer"] / dt, cores["update"] / dt))
            last_t = now

    def stop(self) -> list[tuple[float, float, float, float]]:
        self._stop_event.set()
        self.join()
        return self.samples


def overlap(samples: list[tuple[float, float, float, float]], start: float, end: float, busy: float) -> dict:
    """Busy seconds of rollout, trainer and update within [start, end], and their overlap fractions."""
    tot = {
        "rollout": 0.0,
        "trainer": 0.0,
        "update": 0.0,
        "rollout&update": 0.0,
        "rollout&trainer": 0.0,
        "rollout_cpu": 0.0,
        "trainer_cpu": 0.0,
    }
    for (t0, *_), (t1, r, tr, up) in pairwise(samples):
        if t0 < start or t1 > end:
            continue
        dt = t1 - t0
        r_b, t_b, u_b = r >= busy, tr >= busy, up >= busy
        tot["rollout"] += dt * r_b
        tot["trainer"] += dt * t_b
        tot["update"] += dt * u_b
        tot["rollout&update"] += dt * (r_b and u_b)
        tot["rollout&trainer"] += dt * (r_b and t_b)
        tot["rollout_cpu"] += dt * r
        tot["trainer_cpu"] += dt * tr
    short_u, short_t = min(tot["rollout"], tot["update"]), min(tot["rollout"], tot["trainer"])
    return {
        "rollout_busy_s": tot["rollout"],
        "trainer_busy_s": tot["trainer"],
        "update_busy_s": tot["update"],
        "overlap": tot["rollout&update"] / short_u if short_u else None,
        "overlap_trainer": tot["rollout&trainer"] / short_t if short_t else None,
        "window_s": end - start,
        "rollout_cpu_s": tot["rollout_cpu"],
        "trainer_cpu_s": tot["trainer_cpu"],
    }


def run_mode(work: Path, name: str, steps: int, timeout_s: float, busy: float, extra: list[str]) -> dict:
    threads, overrides = MODES[name]
    overrides = overrides + extra
    run_id = uuid.uuid4().hex
    os.environ[BUSY_ENV] = run_id
    work.mkdir(parents=True, exist_ok=True)
    out = work / "verl"
    sampler = BusySampler(run_id, out / "metrics.jsonl")
    sampler.start()
    try:
        result = run_ours(work, steps, threads, timeout_s, overrides)
    finally:
        samples = sampler.stop()
        os.environ.pop(BUSY_ENV, None)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    seqs = int(cfg["data"]["train_batch_size"]) * int(cfg["actor_rollout_ref"]["rollout"]["n"])
    start, end = sampler.step_times[0], sampler.step_times[-1]
    tokens = [c * seqs / s for c, s in zip(result["completion_tokens_mean"], result["step_s"])]
    return {
        "mode": name,
        "threads": threads,
        "step_s": _mean_after_warmup(result["step_s"]),
        "tokens_per_s": _mean_after_warmup(tokens),
        "per_step_s": result["step_s"],
        **overlap(samples, start, end, busy),
        "wall_s": result["wall_s"],
    }


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(results: dict[str, list[dict]], refused: dict[str, str]) -> str:
    cols = [
        ("s/step", "step_s"),
        ("trained tok/s", "tokens_per_s"),
        ("rollout busy s", "rollout_busy_s"),
        ("update busy s", "update_busy_s"),
        ("trainer busy s", "trainer_busy_s"),
        ("overlap", "overlap"),
        ("overlap (trainer)", "overlap_trainer"),
        ("rollout CPU s", "rollout_cpu_s"),
        ("trainer CPU s", "trainer_cpu_s"),
    ]
    lines = ["| mode | rounds | " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for name, runs in results.items():
        med = {k: _median([r[k] for r in runs]) for _, k in cols}
        lines.append(
            f"| {name} | {len(runs)} | "
            + " | ".join("n/a" if med[k] is None else f"{med[k]:.2f}" for _, k in cols)
            + " |"
        )
    for name, why in refused.items():
        lines.append(f"| {name} | 0 | {why} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table gives the median")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (step 1 is warm-up; >= 2)")
    ap.add_argument(
        "--modes",
        default="sync-1t,sync-2t,colocate_async,separate_async",
        help=f"comma-separated, of {', '.join(MODES)}",
    )
    ap.add_argument("--cpus", help="CPU ids to pin every run to (e.g. 0,1); default: this process's affinity")
    ap.add_argument("--busy", type=float, default=0.25, help="cores used, at or above which a process is busy")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra VeRL override for every mode (e.g. a small model for a quick check); printed",
    )
    ap.add_argument("--out", help="also write the results as JSON to this file")
    ap.add_argument("--keep", help="keep the run folders here instead of a temp folder")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or args.steps < 2 or args.rounds < 1:
        print(
            f"bench_async: error: --modes {','.join(bad) or 'ok'} (give {', '.join(MODES)}), --steps >= 2, "
            "--rounds >= 1",
            file=sys.stderr,
        )
        return 2
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    cpus = sorted(os.sched_getaffinity(0))
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="bench_async_"))
    results: dict[str, list[dict]] = {m: [] for m in modes}
    refused: dict[str, str] = {}
    try:
        for rnd in range(args.rounds):
            for name in modes:
                if name in refused:
                    continue
                folder = work / f"r{rnd}_{name}"
                print(f"[bench] round {rnd + 1}/{args.rounds}: {name}, {args.steps} steps, cpus {cpus}", flush=True)
                try:
                    results[name].append(run_mode(folder, name, args.steps, args.timeout, args.busy, args.set))
                except BenchError as exc:
                    lines = str(exc).splitlines()
                    line = next((ln for ln in lines if ln.startswith("verl: error:")), None)
                    refused[name] = (
                        f"refused: {line.removeprefix('verl: error:').strip()}"
                        if line
                        else f"failed: {lines[0]} / {lines[-1].strip()[:200]}"
                    )
                    results.pop(name)
                    print(f"[bench] {name} {refused[name]}", flush=True)
    except BenchError as exc:
        print(f"bench_async: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"results": results, "refused": refused, "cpus": cpus, "rounds": args.rounds, "steps": args.steps},
                indent=1,
            )
        )
    load = os.getloadavg()
    print(
        f"\nverl train --backend cpu default job (SmolLM2-135M fp32, 4 prompts x 4 samples, unless --set), "
        f"{args.steps} steps (mean of 2..N), median of {args.rounds} interleaved round(s); cpus {cpus}; "
        f"load average {load[0]:.1f}" + (f"; overrides {' '.join(args.set)}" if args.set else "") + "\n"
    )
    print(table(results, refused))
    for name, runs in results.items():
        for r in runs:
            print(
                f"  {name}: step s {[round(s, 1) for s in r['per_step_s']]}, window {r['window_s']:.0f} s, "
                f"wall {r['wall_s']:.0f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
