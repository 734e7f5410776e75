"""Timings of the local fake-slice Ray cluster: up -> ready, slice placement, job submit -> RUNNING -> SUCCEEDED.

    python benchmarks/bench_ray_cluster.py [--slice v6e-16] [--repeats 5] [--verl-step]

One run starts its own fake cluster (free ports, temp dir) and stops it by pid at the end. Placement of the
4-host slice through ``ray_cluster.placement.reserve_slice`` (Ray's ``SlicePlacementGroup``: head reservation,
then one bundle per host pinned to the slice) is timed side by side with a plain Ray placement group of the same
bundles (``STRICT_SPREAD``, no slice pinning), so the cost of slice-aware placement shows as a ratio.
``--verl-step`` also submits a 1-step ``verl train --backend cpu`` job (minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slice", default="v6e-16", help="fake slice to start (default v6e-16: 4 hosts x 4 chips)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--verl-step", action="store_true", help="also time a 1-step verl train --backend cpu job")
    a = ap.parse_args()

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from ray_cluster import fake_slice
    from ray_cluster.jobs import Jobs
    from ray_cluster.placement import reserve_slice
    from rl_tpu.topology import parse_slice

    spec = parse_slice(a.slice)
    state = Path(tempfile.mkdtemp(prefix="rlt-bench-")) / "state.json"
    rows: list[tuple[str, str, str]] = []
    t = time.monotonic()
    cluster = fake_slice.start([a.slice], cpus_per_host=2, head_cpus=4, state_file=state, timeout_s=400)
    rows.append(
        (
            f"cluster up -> ready ({spec.accelerator_type}: head + {spec.hosts} host nodes)",
            f"{cluster.ready_s:.1f} s",
            f"wall incl. port/tempdir setup {time.monotonic() - t:.1f} s",
        )
    )
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        ours, plain = [], []
        total_tpu = ray.cluster_resources()["TPU"]

        def settle():  # time each placement from a free cluster: wait until the last one's chips are back
            while ray.available_resources().get("TPU", 0) < total_tpu:
                time.sleep(0.05)

        for i in range(a.repeats):
            for kind in ("ours", "plain") if i % 2 == 0 else ("plain", "ours"):
                settle()
                t = time.monotonic()
                if kind == "ours":
                    p = reserve_slice(spec.accelerator_type, cpus_per_host=1, timeout_s=120)
                    ours.append(time.monotonic() - t)
                    p.shutdown()
                else:
                    pg = placement_group(
                        [{"TPU": spec.chips_per_host, "CPU": 1}] * spec.hosts, strategy="STRICT_SPREAD"
                    )
                    ray.get(pg.ready(), timeout=120)
                    plain.append(time.monotonic() - t)
                    remove_placement_group(pg)
        rows.append(
            (
                f"placement {spec.hosts}-host slice, reserve_slice (median of {a.repeats})",
                f"{_median(ours) * 1e3:.0f} ms",
                f"min {min(ours) * 1e3:.0f} ms",
            )
        )
        rows.append(
            (
                f"placement {spec.hosts} bundles, plain Ray placement_group (median)",
                f"{_median(plain) * 1e3:.0f} ms",
                f"slice-aware / plain = {_median(ours) / _median(plain):.1f}x",
            )
        )
        ray.shutdown()

        jobs = Jobs(cluster.dashboard_url)
        run, end = [], []
        for _ in range(max(1, a.repeats // 2)):
            t = time.monotonic()
            job_id = jobs.submit(["python", "-c", "print('ok')"])
            r = jobs.wait(job_id, timeout_s=300, poll_s=0.05)
            assert r.ok, r.message
            run.append(r.submit_to_running_s + 0.0)
            end.append(time.monotonic() - t)
        rows.append((f"trivial job: submit -> RUNNING (median of {len(run)})", f"{_median(run):.2f} s", ""))
        rows.append((f"trivial job: submit -> SUCCEEDED (median of {len(end)})", f"{_median(end):.2f} s", ""))
        if a.verl_step:
            t = time.monotonic()
            out = Path(cluster.temp_dir) / "verl-out"
            job_id = jobs.submit(
                [
                    "verl",
                    "train",
                    "--backend",
                    "cpu",
                    "--output-dir",
                    str(out),
                    "trainer.total_training_steps=1",
                    "trainer.val_before_train=false",
                    "trainer.test_freq=-1",
                    "trainer.save_freq=-1",
                ]
            )
            r = jobs.wait(job_id, timeout_s=1800, poll_s=0.5)
            rows.append(("verl train --backend cpu, 1 step: submit -> RUNNING", f"{r.submit_to_running_s:.1f} s", ""))
            rows.append(("verl train --backend cpu, 1 step: submit -> end", f"{time.monotonic() - t:.1f} s", r.status))
    finally:
        t = time.monotonic()
        pids = fake_slice.stop(state)
        state.parent.rmdir()
        rows.append(
            (
                "cluster down (SIGTERM, then SIGKILL after 10 s)",
                f"{time.monotonic() - t:.1f} s",
                f"{len(pids)} processes",
            )
        )

    w = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{w}}  {'value':>10}  note")
    print("-" * (w + 40))
    for name, val, note in rows:
        print(f"{name:<{w}}  {val:>10}  {note}")
    print(
        f"\n(machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; Ray {ray.__version__})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
