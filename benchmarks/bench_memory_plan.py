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

``--tpu-dry-run``: the same for ``verl train --backend cpu --tpu-dry-run`` (the TPU profile on CPU: 4 gloo ranks on a
fake v6e-4 slice this script starts, and stops by pid, the sampler inside each trainer worker in bf16) against the
plan for v6e-4 with the dry run's profile: each of the 4 ``ray::WorkerDict`` ranks' ``peak - floor`` against the
plan's per-chip peak (which then counts the sampler's weights and KV cache too). By default it runs the e2e test's
small batch (2 prompts x 2 samples, one per rank, 16-token responses, micro batches of 1), so the resident terms
(parameters, gradients, AdamW, reference policy, sampler weights) dominate. Each rank is measured four ways, each as
``peak - floor`` against the plan:

- ``RSS``: as above (counts shared libraries loaded after the first sample, and freed heap glibc keeps);
- ``anon+shmem RSS``: resident anonymous and shared-memory pages only (``/proc/<pid>/status``), no file-backed ones;
- ``live heap``: glibc's bytes in use (``mallinfo2``: every live malloc'd or mmap'd block, tensors included; freed
  blocks glibc keeps are not counted), sampled every 50 ms inside each process by ``heap_probe/sitecustomize.py``,
  which this script puts on the cluster's ``PYTHONPATH``: what a device allocator calls "allocated". Its floor is
  the value when the rank was first seen as ``ray::WorkerDict`` (imports done, no model built), as RSS's is;
- ``live heap, loop``: the same after the first weight sync (the training loop; the mark is the driver's receipt of
  the line the first sync prints when done, so the first sync's own peak falls outside). Set-up's transients (a full
  fp32 checkpoint read before its shards and its bf16 sampler copy are placed) are host memory on a TPU, not HBM.

    python benchmarks/bench_memory_plan.py [--steps 2] [--keep DIR] [--out memory_plan.json] [extra VeRL keys ...]
    python benchmarks/bench_memory_plan.py --tpu-dry-run [--steps 1] [extra VeRL keys ...]
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


def _anon_bytes(pid: int) -> int | None:
    """``RssAnon + RssShmem`` of ``pid`` in bytes (``/proc/<pid>/status``): the resident pages that hold data the
    process made (malloc'd and mmap'd tensors, the shared-memory weight files), without ``RssFile`` (shared libraries'
    code, a checkpoint read through mmap), which a process loads from disk and an accelerator's HBM never holds.
    ``None`` when the process is gone."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        return sum(int(fields[k].split()[0]) << 10 for k in ("RssAnon", "RssShmem"))
    except (OSError, KeyError, ValueError):
        return None


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
        self.rank_first: dict[tuple[str, int], int] = {}  # (role, pid) -> RSS at its first sample
        self.rank_peak: dict[tuple[str, int], int] = {}
        self.rank_first_time: dict[tuple[str, int], float] = {}  # when it was first seen with its role's title
        # the same for anonymous + shared-memory pages only (:func:`_anon_bytes`)
        self.rank_first_anon: dict[tuple[str, int], int] = {}
        self.rank_peak_anon: dict[tuple[str, int], int] = {}
        self.samples = 0
        self.marks: dict[str, float] = {}  # filled by _copy_log

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
                self.rank_first.setdefault((role, p.pid), mem.rss)
                self.rank_first_time.setdefault((role, p.pid), time.time())
                self.rank_peak[(role, p.pid)] = max(self.rank_peak.get((role, p.pid), 0), mem.rss)
                anon = _anon_bytes(p.pid)
                if anon is not None:
                    self.rank_first_anon.setdefault((role, p.pid), anon)
                    self.rank_peak_anon[(role, p.pid)] = max(self.rank_peak_anon.get((role, p.pid), 0), anon)
            self.samples += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


#: the e2e test's small dry-run batch (tests/verl_backend/driver/test_tpu_dry_run.py): one sequence per rank
DRY_RUN_KEYS = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    "data.max_response_length=16",
    "rl_tpu.train_size=8",
    "rl_tpu.val_size=4",
    "rl_tpu.slice_timeout_s=600",
]


def heap_probe_env(folder: Path) -> dict[str, str]:
    """Environment that starts the heap probe (``heap_probe/sitecustomize.py``) in every python process, each writing
    its live heap bytes to ``folder``."""
    probe = str(Path(__file__).resolve().parent / "heap_probe")
    path = os.pathsep.join(p for p in (probe, os.environ.get("PYTHONPATH", "")) if p)
    return {"RL_TPU_BENCH_HEAP_DIR": str(folder), "PYTHONPATH": path}


def heap_figures(folder: Path, floor_at: dict[int, float], since: float = 0.0) -> dict[int, tuple[int, int]]:
    """``{pid: (peak live bytes from ``since`` on, live bytes at ``floor_at[pid]``)}`` from the heap probe's files
    (times in seconds since the epoch). The floor is taken when the process was first seen with its actor's title:
    its imports are done (a worker's python heap, ~0.3 GiB, which the plan does not count), no model is built yet."""
    figures = {}
    for pid, at in floor_at.items():
        f = folder / f"{pid}.json"
        if f.is_file():
            series = json.loads(f.read_text())["series"]
            later = [v for t, v in series if t >= since]
            before = [v for t, v in series if t <= at] or [v for _, v in series[:1]]
            if series and later:
                figures[pid] = (max(later), before[-1])
    return figures


#: log lines whose first appearance the dry run marks (seconds since the epoch): the first weight sync is the end of
#: the workers' set-up (models built and loaded, shards placed) and the start of the training loop
MARKS = {"first_sync": "weight sync to rollout replica"}


def _copy_log(stream, fh, marks: dict[str, float]) -> None:
    """Copy the job's output to ``fh`` line by line, noting when each of :data:`MARKS` first appears."""
    for line in stream:
        fh.write(line)
        for name, text in MARKS.items():
            if name not in marks and text in line:
                marks[name] = time.time()
    fh.flush()


def run_job(
    work: Path,
    steps: int,
    interval: float,
    extra: list[str],
    timeout_s: float,
    run_id: str | None = None,
    ray_address: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[WorkerSampler, Path]:
    """``verl train --backend cpu`` for ``steps`` steps (no validation, no checkpoint) under the sampler; with
    ``ray_address``, on that cluster (whose processes must carry ``MARKER=run_id``)."""
    out = work / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # Ray's unix socket paths must fit 107 bytes
    run_id = run_id or uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({MARKER: run_id, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(ray_tmp), **(extra_env or {})})
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        *extra,
    ]
    sampler = WorkerSampler(run_id, interval)
    sampler.start()
    log = work / "train.log"
    try:
        with log.open("w") as fh:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                errors="replace",
            )
            copier = threading.Thread(target=_copy_log, args=(proc.stdout, fh, sampler.marks), daemon=True)
            copier.start()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = None
            copier.join(timeout=10)
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
    ap.add_argument("--tpu-dry-run", action="store_true", help="the TPU profile's dry run on a fake v6e-4 (see above)")
    ap.add_argument("overrides", nargs="*", help="extra VeRL keys for the job")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_memory_plan_"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if args.tpu_dry_run:
        dry_run(work, args)
        return
    sampler, out = run_job(work, args.steps, args.interval, args.overrides, args.timeout)
    wall = time.time() - start

    from omegaconf import OmegaConf

    from verl_backend.driver.memory_plan import plan_memory
    from verl_backend.driver.profiles import PROFILES

    plan = plan_memory(OmegaConf.load(out / "config.yaml"), None, PROFILES["cpu"])
    if TRAINER_ROLE not in sampler.peak_rss:
        raise SystemExit(
            f"no {TRAINER_ROLE} process was sampled ({sampler.samples} samples): roles seen {sorted(sampler.peak_rss)}"
        )
    peak, floor = sampler.peak_rss[TRAINER_ROLE], sampler.first[TRAINER_ROLE]
    est = plan.peak
    figures = {
        "steps": args.steps,
        "wall_s": wall,
        "samples": sampler.samples,
        "estimate_gib": est / GIB,
        "trainer_peak_rss_gib": peak / GIB,
        "trainer_floor_rss_gib": floor / GIB,
        "trainer_peak_pss_gib": sampler.peak_pss[TRAINER_ROLE] / GIB,
        "estimate_over_peak_minus_floor": est / max(1, peak - floor),
        "estimate_plus_floor_over_peak": (est + floor) / peak,
        "terms_gib": {t.name: t.bytes / GIB for t in plan.terms},
        "other_roles_peak_rss_gib": {k: v / GIB for k, v in sorted(sampler.peak_rss.items()) if k != TRAINER_ROLE},
    }
    print(plan.format())
    print(f"\ntrainer worker ({TRAINER_ROLE}), {args.steps} steps, {sampler.samples} samples every {args.interval} s:")
    print(
        f"  peak RSS {peak / GIB:.3f} GiB, floor (first sample) {floor / GIB:.3f} GiB, "
        f"peak - floor {(peak - floor) / GIB:.3f} GiB, peak PSS {figures['trainer_peak_pss_gib']:.3f} GiB"
    )
    print(
        f"  estimate {est / GIB:.3f} GiB / (peak - floor) = {figures['estimate_over_peak_minus_floor']:.3f}; "
        f"(estimate + floor) / peak = {figures['estimate_plus_floor_over_peak']:.3f}"
    )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def dry_run(work: Path, args) -> None:
    """The TPU-profile dry run on a fake v6e-4 started here: each rank's ``peak - floor`` against the plan."""
    from omegaconf import OmegaConf

    from ray_cluster import fake_slice
    from verl_backend.driver.memory_plan import plan_memory
    from verl_backend.driver.profiles import PROFILES, tpu_dry_run

    run_id, state, saved = uuid.uuid4().hex, work / "cluster.json", dict(os.environ)
    heap_dir = work / "heap"
    heap_dir.mkdir(exist_ok=True)
    os.environ.update(
        {
            MARKER: run_id,
            "RAY_AUTH_MODE": "disabled",  # the cluster's workers carry the marker
            **heap_probe_env(heap_dir),
        }
    )  # ... and the heap probe (heap_probe/sitecustomize.py)
    try:
        cluster = fake_slice.start(["v6e-4"], head_cpus=4, object_store_mb=256, state_file=state, timeout_s=240)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    start = time.time()
    try:
        sampler, out = run_job(
            work,
            args.steps,
            args.interval,
            ["--tpu-dry-run", *DRY_RUN_KEYS, *args.overrides],
            args.timeout,
            run_id=run_id,
            ray_address=cluster.address,
            extra_env=heap_probe_env(heap_dir),
        )
    finally:
        fake_slice.stop(state_file=state)
    wall = time.time() - start
    ranks = {
        pid: (sampler.rank_peak[(role, pid)], sampler.rank_first[(role, pid)])
        for role, pid in sampler.rank_peak
        if role == TRAINER_ROLE
    }
    anon = {
        pid: (sampler.rank_peak_anon[(role, pid)], sampler.rank_first_anon[(role, pid)])
        for role, pid in sampler.rank_peak_anon
        if role == TRAINER_ROLE
    }
    seen = {pid: sampler.rank_first_time[(role, pid)] for role, pid in sampler.rank_first_time if role == TRAINER_ROLE}
    heap = heap_figures(heap_dir, seen)
    # the training loop only: from the first weight sync on (set-up's transients, such as a full fp32 checkpoint read
    # on the host before its shards or its bf16 copy are placed, happen in host memory on a TPU, not in HBM)
    loop = heap_figures(heap_dir, seen, since=sampler.marks.get("first_sync", float("inf")))
    (work / "ranks_rss.json").write_text(
        json.dumps(
            {
                "wall_s": wall,
                "ranks": ranks,
                "anon": anon,
                "heap": heap,
                "loop": loop,
                "marks": sampler.marks,
                "seen": seen,
            }
        )
    )
    plan = plan_memory(OmegaConf.load(out / "config.yaml"), "v6e-4", tpu_dry_run(PROFILES["cpu"]))
    if not ranks:
        raise SystemExit(f"no {TRAINER_ROLE} process was sampled ({sampler.samples} samples)")
    print(plan.format())
    print(
        f"\nTPU dry run, {args.steps} step(s), {wall:.0f} s, {sampler.samples} samples every {args.interval} s; "
        f"plan per chip {plan.peak / GIB:.3f} GiB:"
    )
    measures = {"RSS": ranks, "anon+shmem RSS": anon, "live heap": heap, "live heap, loop": loop}
    print(f"{'rank pid':>9} {'measure':>15} {'peak GiB':>9} {'floor':>7} {'peak-floor':>10} {'plan/(peak-floor)':>17}")
    figures = {
        "steps": args.steps,
        "wall_s": wall,
        "plan_gib": plan.peak / GIB,
        "terms_gib": {t.name: t.bytes / GIB for t in plan.terms},
        "ranks": {},
    }
    for pid in sorted(ranks):
        for name, values in measures.items():
            if pid not in values:
                continue
            peak, floor = values[pid]
            ratio = plan.peak / max(1, peak - floor)
            figures["ranks"].setdefault(pid, {})[name] = {
                "peak_gib": peak / GIB,
                "floor_gib": floor / GIB,
                "plan_over_peak_minus_floor": ratio,
            }
            print(
                f"{pid:>9} {name:>15} {peak / GIB:>9.3f} {floor / GIB:>7.3f} {(peak - floor) / GIB:>10.3f} "
                f"{ratio:>17.3f}"
            )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
