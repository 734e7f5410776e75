"""Weight sync per transport, in real jobs: bytes and seconds per sync and what the sync's verification costs.

Each row is ``verl train --backend cpu`` on SmolLM2-135M-Instruct (the default model, float32) with
``benchmarks/bench_grpo_step.py``'s pinned config (4 prompts x 4 samples, temperature 1.0, 64-token responses, KL
loss; :func:`bench_grpo_step.run_ours`, one torch thread a process) and the overrides that put its weight sync on one
transport (``docs/weight-sync.md``):

- ``trainer_memory``: the default (one trainer rank, the rollout server on its host: in place);
- ``shared_memory``: two trainer ranks (``trainer.n_gpus_per_node=2``: FSDP shards the parameters, so the rollout
  needs whole tensors, written once into the server's shared-memory file);
- ``object_store``: ``rl_tpu.shared_weights=false`` (buckets through Ray's object store);
- ``object_store`` LoRA: rank 16 on all linear layers, adapter only (the server merges it);
- ``in_worker``: ``sampler_placement=worker`` (the sampler in the trainer worker, as on a TPU);
- ``pool_shared_memory`` / ``pool_broadcast``: ``trainer_mode=separate_async`` (a standalone rollout replica fed by the
  ``gloo`` engine in 64 MiB buckets; broadcast with ``rl_tpu.shared_weights=false``).

Columns, means over steps 2..S (step 1 warms up): the route taken (``weight_sync/route``), ``verified`` (the fraction
of steps with ``weight_sync/verified`` 1.0), ``MB/sync`` (``weight_sync/bytes``: what the sync covers; in place the
whole model though nothing is copied; LoRA the adapter), ``sync s`` (``weight_sync/seconds``, the transport's own
time), ``update_weights s`` (VeRL's ``timing_s/update_weights``, the trainer's whole call: export, send, the check),
``verify rollout s`` / ``verify trainer s`` (``weight_sync/verify_seconds``: the rollout's probe through its sampler
and its fingerprints; ``weight_sync/verify_trainer_seconds``: the trainer's probe forward), ``pack s``
(``weight_sync/verify_pack_seconds``: packing the new weights for the sampler, done just before the probe; the next
batch would have done it, so it is not the check's cost), ``s/step`` (``timing_s/step``), ``verify % step`` (the
two verify columns over s/step: the check's cost on the step's critical path) and ``peak PSS GiB`` (the whole job,
every process, :class:`bench_grpo_step.MemorySampler`).

``--ab-rounds R`` also runs the default job R times each with ``rl_tpu.verify_weight_sync`` on and off, alternating,
and prints the ratio of their mean s/step: the check's cost measured end to end.

``--lora-against TREE --lora-rounds R`` runs the LoRA row R times each with the code of another checkout ``TREE``
(e.g. a ``git worktree`` of the commit before adapter-only sync; ``PYTHONPATH`` points every process of that job at
it) and with this one, alternating, and prints both sides' s/step, sync seconds and peak PSS.

    python benchmarks/bench_sync_routes.py [--routes trainer_memory object_store ...] [--steps 3] [--ab-rounds 0]
        [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the pinned config and the run, shared with the TRL comparison
from bench_grpo_step import BenchError, run_ours  # noqa: E402

LORA = [
    "actor_rollout_ref.model.lora_rank=16",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.target_modules=all-linear",
]
POOL = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
    "trainer.v1.separate_async.parameter_sync_step=1",
]
ROUTES: dict[str, list[str]] = {
    "trainer_memory": [],
    "shared_memory": ["trainer.n_gpus_per_node=2"],
    "object_store": ["rl_tpu.shared_weights=false"],
    "object_store_lora": LORA,
    "in_worker": [
        "+actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement=worker",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=native",
    ],
    "pool_shared_memory": POOL,
    "pool_broadcast": [*POOL, "rl_tpu.shared_weights=false"],
}
ROUTE_NAMES = ("in_worker", "trainer_memory", "shared_memory", "object_store", "pool_broadcast", "pool_shared_memory")
KEYS = {
    "route": "weight_sync/route",
    "verified": "weight_sync/verified",
    "bytes": "weight_sync/bytes",
    "sync_s": "weight_sync/seconds",
    "update_weights_s": "timing_s/update_weights",
    "verify_s": "weight_sync/verify_seconds",
    "verify_trainer_s": "weight_sync/verify_trainer_seconds",
    "pack_s": "weight_sync/verify_pack_seconds",
    "step_s": "timing_s/step",
}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def measure(name: str, overrides: list[str], steps: int, timeout_s: float, tree: str | None = None) -> dict:
    """One job; the weight-sync columns from its ``metrics.jsonl``, means over steps 2..``steps``; ``tree``: run
    another checkout's code (``PYTHONPATH``, inherited by every process of the job)."""
    before, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    if tree is not None:  # the driver runs ``python -m``: its working folder comes first on its path
        os.environ["PYTHONPATH"] = str(Path(tree).resolve())
        os.chdir(tree)
    try:
        with tempfile.TemporaryDirectory(prefix=f"sync_{name.replace(' ', '_')}_") as work:
            ran = run_ours(Path(work), steps, 1, timeout_s, overrides)
            rows = [
                json.loads(line)["data"]
                for line in (Path(work) / "verl" / "metrics.jsonl").read_text().splitlines()
                if line.strip()
            ]
    finally:
        if tree is not None:
            os.chdir(cwd)
            os.environ.pop("PYTHONPATH") if before is None else os.environ.__setitem__("PYTHONPATH", before)
    rows = [r for r in rows if "timing_s/step" in r][1:]
    out = {
        "name": name,
        "overrides": overrides,
        "steps": len(rows),
        "peak_pss_gib": ran["memory"]["peak_pss_total_gib"],
    }
    for col, key in KEYS.items():
        out[col] = _mean([float(r[key]) for r in rows if key in r])
    verify = (out["verify_s"] or 0.0) + (out["verify_trainer_s"] or 0.0)
    out["verify_pct"] = 100 * verify / out["step_s"] if out["step_s"] and out["verify_s"] is not None else None
    return out


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = (
        "config",
        "route",
        "verified",
        "MB/sync",
        "sync s",
        "update_weights s",
        "verify rollout s",
        "verify trainer s",
        "pack s",
        "s/step",
        "verify % step",
        "peak PSS GiB",
    )
    lines = [head]
    for r in rows:
        route = ROUTE_NAMES[int(r["route"])] if r["route"] is not None else "n/a"
        lines.append(
            (
                r["name"],
                route,
                _fmt(r["verified"], ".2f"),
                _fmt(r["bytes"] and r["bytes"] / 1e6, ".1f"),
                _fmt(r["sync_s"], ".3f"),
                _fmt(r["update_weights_s"], ".3f"),
                _fmt(r["verify_s"], ".3f"),
                _fmt(r["verify_trainer_s"], ".3f"),
                _fmt(r["pack_s"], ".3f"),
                _fmt(r["step_s"], ".2f"),
                _fmt(r["verify_pct"], ".1f"),
                _fmt(r["peak_pss_gib"], ".2f"),
            )
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    text = [
        "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--routes",
        nargs="*",
        choices=list(ROUTES),
        default=list(ROUTES),
        help="the rows to run (none: only the A/B runs asked for)",
    )
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps a job (step 1 is warm-up; >= 2)")
    ap.add_argument("--ab-rounds", type=int, default=0, help="default job with the check on and off, alternating")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds allowed a job")
    ap.add_argument("--lora-against", metavar="TREE", help="another checkout: the LoRA row with its code and this one")
    ap.add_argument("--lora-rounds", type=int, default=2, help="alternating rounds of --lora-against")
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    rows = []
    for name in args.routes:
        try:
            rows.append(measure(name, ROUTES[name], args.steps, args.timeout))
        except BenchError as err:  # one route's failure leaves the others' rows
            print(f"{name}: failed: {err}", flush=True)
            continue
        print(table(rows[-1:]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    if rows:
        print(table(rows))
    ab: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.ab_rounds):
        for side in ("on", "off"):
            r = measure(
                f"default verify {side}",
                [f"rl_tpu.verify_weight_sync={'true' if side == 'on' else 'false'}"],
                args.steps,
                args.timeout,
            )
            ab[side].append(r["step_s"])
            print(f"round {i + 1} verify {side}: {r['step_s']:.2f} s/step", flush=True)
    if args.ab_rounds:
        on, off = statistics.fmean(ab["on"]), statistics.fmean(ab["off"])
        print(
            f"default job, verification on / off: {on:.2f} / {off:.2f} s/step = {on / off:.3f}x "
            f"({args.ab_rounds} rounds, alternating)"
        )
    lora: dict[str, list[dict]] = {"before": [], "now": []}
    if args.lora_against:
        for i in range(args.lora_rounds):
            for side, tree in (("before", args.lora_against), ("now", None)):
                r = measure(f"lora {side}", ROUTES["object_store_lora"], args.steps, args.timeout, tree)
                lora[side].append(r)
                print(
                    f"round {i + 1} LoRA {side}: {r['step_s']:.2f} s/step, update_weights "
                    f"{r['update_weights_s']:.3f} s, {(r['bytes'] or 0) / 1e6:.1f} MB/sync, peak PSS "
                    f"{r['peak_pss_gib']:.2f} GiB",
                    flush=True,
                )
        for key, label in (
            ("step_s", "s/step"),
            ("update_weights_s", "update_weights s"),
            ("peak_pss_gib", "peak PSS GiB"),
        ):
            b = statistics.fmean(r[key] for r in lora["before"])
            n = statistics.fmean(r[key] for r in lora["now"])
            print(f"LoRA {label}: before {b:.3f}, now {n:.3f} = {n / b:.3f}x ({args.lora_rounds} rounds, alternating)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "ab": ab, "lora": lora}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
