"""The memory plan against a measured peak: ``verl train --backend cpu`` (the default job, SmolLM2-135M, fp32, one
trainer rank) for a few steps, with the trainer worker's memory sampled, against
:func:`verl_backend.driver.memory_plan.plan_memory` for the run's own composed ``config.yaml``.

Measured: every ``--interval`` s, the RSS and PSS of the trainer worker process (``ray::WorkerDict``: actor, reference
policy and optimizer; on CPU the sampler is in the rollout server, another process, so the plan's sampler terms are
0 here). RSS counts the pages this process maps, shared ones (torch's libraries, pages inherited from the fork server,
the shared-memory file holding the parameters) in full; it is what the process would need alone. The floor is the
worker's RSS at its first sample, before it builds a model (the python runtime and imports, which the plan does not
count); ``peak - floor`` is what the job's tensors and their allocator overhead added.

Printed: the plan's table, then estimate vs ``peak - floor`` and ``estimate + floor`` vs peak, as ratios.

    python benchmarks/bench_memory_plan.py [--steps 2] [--keep DIR] [--out memory_plan.json] [extra VeRL keys ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

MARKER = "RL_TPU_BENCH_RUN"
GIB = float(1 << 30)
TRAINER_ROLE = "ray::WorkerDict"


class WorkerSampler(threading.Thread):
    """Every ``interval`` s: RSS and PSS of each process named ``ray::<Role>`` that carries ``MARKER=<run id>``."""

    def __init__(self, run_id: str, interval: float):
        super().__init__(daemon=True)
        self.run_id, self.interval = run_id, interval
        self._stop_event = threading.Event()
        self._ours: dict[tuple[int, float], bool] = {}
        self.first: dict[str, int] = {}  # role -> RSS at the first sample of its first process
        self.peak_rss: dict[str, int] = {}
        self.peak_pss: dict[str, int] = {}
        self.samples = 0

    def _mine(self):
        for p in psutil.process_iter(["pid", "create_time"]):
            key = (p.pid, p.info["create_time"])
            if key not in self._ours:
                try:
                    self._ours[key] = p.environ().get(MARKER) == self.run_id
                except psutil.Error:
                    continue
            if self._ours[key]:
                yield p

    def run(self) -> None:
        while not self._stop_event.is_set():
            for p in self._mine():
                try:
                    head = (p.cmdline() or [""])[0]
                    if not head.startswith("ray::"):
                        continue
                    role = head.split(".")[0].split(" ")[0]
                    mem = p.memory_full_info()
                except psutil.Error:
                    continue
                self.first.setdefault(role, mem.rss)
                self.peak_rss[role] = max(self.peak_rss.get(role, 0), mem.rss)
                self.peak_pss[role] = max(self.peak_pss.get(role, 0), getattr(mem, "pss", mem.rss))
            self.samples += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def run_job(work: Path, steps: int, interval: float, extra: list[str], timeout_s: float) -> tuple[WorkerSampler, Path]:
    """``verl train --backend cpu`` for ``steps`` steps (no validation, no checkpoint) under the sampler."""
    out = work / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # Ray's unix socket paths must fit 107 bytes
    run_id = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({MARKER: run_id, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp)})
    cmd = [sys.executable, "-m", "verl_backend.cli", "train", "--backend", "cpu", "--output-dir", str(out),
           f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.save_freq=-1", *extra]
    sampler = WorkerSampler(run_id, interval)
    sampler.start()
    log = work / "train.log"
    try:
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = None
        deadline = time.time() + 30
        while time.time() < deadline and any(True for _ in sampler._mine()):
            time.sleep(1.0)
        for p in list(sampler._mine()):  # left over after 30 s: ours (the marker), killed by pid
            try:
                p.kill()
            except psutil.Error:
                pass
    finally:
        sampler.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"verl train {'timed out' if rc is None else f'exited {rc}'}; log {log}:\n{tail}")
    return sampler, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between memory samples")
    ap.add_argument("--keep", type=Path, help="run folder to keep (default: a temporary one, removed)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("overrides", nargs="*", help="extra VeRL keys for the job")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_memory_plan_"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    sampler, out = run_job(work, args.steps, args.interval, args.overrides, args.timeout)
    wall = time.time() - start

    from omegaconf import OmegaConf

    from verl_backend.driver.memory_plan import plan_memory
    from verl_backend.driver.profiles import PROFILES

    plan = plan_memory(OmegaConf.load(out / "config.yaml"), None, PROFILES["cpu"])
    if TRAINER_ROLE not in sampler.peak_rss:
        raise SystemExit(f"no {TRAINER_ROLE} process was sampled ({sampler.samples} samples): "
                         f"roles seen {sorted(sampler.peak_rss)}")
    peak, floor = sampler.peak_rss[TRAINER_ROLE], sampler.first[TRAINER_ROLE]
    est = plan.peak
    figures = {
        "steps": args.steps, "wall_s": wall, "samples": sampler.samples,
        "estimate_gib": est / GIB, "trainer_peak_rss_gib": peak / GIB, "trainer_floor_rss_gib": floor / GIB,
        "trainer_peak_pss_gib": sampler.peak_pss[TRAINER_ROLE] / GIB,
        "estimate_over_peak_minus_floor": est / max(1, peak - floor),
        "estimate_plus_floor_over_peak": (est + floor) / peak,
        "terms_gib": {t.name: t.bytes / GIB for t in plan.terms},
        "other_roles_peak_rss_gib": {k: v / GIB for k, v in sorted(sampler.peak_rss.items()) if k != TRAINER_ROLE},
    }
    print(plan.format())
    print(f"\ntrainer worker ({TRAINER_ROLE}), {args.steps} steps, {sampler.samples} samples every {args.interval} s:")
    print(f"  peak RSS {peak / GIB:.3f} GiB, floor (first sample) {floor / GIB:.3f} GiB, "
          f"peak - floor {(peak - floor) / GIB:.3f} GiB, peak PSS {figures['trainer_peak_pss_gib']:.3f} GiB")
    print(f"  estimate {est / GIB:.3f} GiB / (peak - floor) = {figures['estimate_over_peak_minus_floor']:.3f}; "
          f"(estimate + floor) / peak = {figures['estimate_plus_floor_over_peak']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
