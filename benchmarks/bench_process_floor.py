"""The memory floor of ``verl train --backend cpu``'s process layout: what each process costs before it does any work.

VeRL 0.9.1's trainer runs as several Ray actors, each its own Python process. Every one imports VeRL, and through it
torch, transformers, tensordict and TransferQueue, before it holds a single tensor. This script measures that import
cost per role, each in a fresh interpreter, as PSS of anonymous pages (``Pss_Anon`` of ``/proc/self/smaps_rollup``:
private memory; shared library text is not in it). It adds the training state the trainer must hold whatever the
framework (fp32 actor weights, gradients, AdamW's two moments, the reference policy's weights: 5 x the weight bytes)
and prints the sum: no run of this layout can peak below it. A real step adds what any trainer adds on top
(activations, the backward's temporaries: 0.7-0.9 GiB above the gradients for SmolLM2-135M at 4 sequences per
micro batch, measured in a plain single-process PyTorch loop, with and without FSDP2), and each process's working data.

That is the floor of the layout with plain Ray workers (``RL_TPU_FORK_SERVER=0``). By default a local CPU job's
workers are forked from one process that has done most of these imports (``verl_backend/host_memory/fork_server.py``),
so most of the import rows are held once for the whole job, not once per process.

With ``--bench-json FILE`` (from ``bench_grpo_step.py --out FILE``) it also prints, per role, the PSS that role had
at that run's peak sample, and the single-process TRL peaks of that run for comparison.

    python benchmarks/bench_process_floor.py [--bench-json grpo_step.json]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

GIB = float(1 << 30)

# (role as the process is named at the peak sample, what the process imports to host its class)
ROLES = [
    ("python -m (driver: VeRL's TaskRunner)", "import verl.trainer.main_ppo, transfer_queue"),
    ("ray::WorkerDict (trainer)", "import verl.workers.engine_workers, verl_backend.workers.engine"),
    ("ray::NativeRolloutServer", "import verl_backend.rollout.server"),
    ("ray::AgentLoopWorkerTQ", "import verl.trainer.ppo.v1.agent_loop_tq"),
    ("ray::RewardLoopWorker", "import verl.experimental.reward_loop.reward_loop, reasoning_gym"),
    ("ray::GlobalRequestLoadBalancer", "import verl.workers.rollout.router"),
    ("ray::TransferQueueController", "import transfer_queue.controller"),
    ("ray::SimpleStorageUnit", "import transfer_queue.storage.simple_storage"),
    ("(a bare Ray worker, for scale)", "import ray"),
]

_PROBE = """
import warnings, logging
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
{imports}
fields = {{}}
for line in open("/proc/self/smaps_rollup"):
    parts = line.split()
    if parts[0] in ("Pss:", "Pss_Anon:"):
        fields[parts[0][:-1]] = int(parts[1]) * 1024
print("RL_TPU_FLOOR", fields["Pss"], fields["Pss_Anon"])
"""


def import_cost(imports: str) -> tuple[float, float]:
    """``(PSS, PSS anonymous)`` in bytes of a fresh ``python`` that ran ``imports``; raises RuntimeError on failure."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(imports=imports)], capture_output=True, text=True, timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RL_TPU_FLOOR")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"`{imports}` failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    _, pss, anon = line.split()
    return float(pss), float(anon)


def training_state_bytes() -> tuple[int, int]:
    """``(weight bytes, state bytes)`` of the default model: fp32 weights, and 5 x them (actor weights, gradients,
    AdamW ``exp_avg`` and ``exp_avg_sq``, reference weights)."""
    from safetensors import safe_open

    from verl_backend.models import ensure_default_model

    total = 0
    for f in sorted(ensure_default_model().glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            # trained in float32 whatever the file's dtype
            total += sum(math.prod(st.get_slice(name).get_shape()) * 4 for name in st.keys())
    return total, 5 * total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-json", help="bench_grpo_step.py --out file: add each role's PSS at that run's peak")
    args = ap.parse_args()
    peak_roles: dict[str, float] = {}
    trl: list[tuple[str, float]] = []
    ours_peak = None
    if args.bench_json is not None:
        try:
            for r in json.loads(Path(args.bench_json).read_text())["results"]:
                if r["framework"].startswith("ours"):
                    ours_peak = float(r["memory"]["peak_pss_total_gib"])
                    peak_roles = {k: float(v[1]) for k, v in r["memory"]["pss_at_peak_gib_by_role"].items()}
                else:
                    trl.append((r["framework"], float(r["memory"]["peak_pss_total_gib"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            why = f"no key {exc}" if isinstance(exc, KeyError) else str(exc) or type(exc).__name__
            print(
                f"bench_process_floor: error: --bench-json {args.bench_json}: {why}; give the file that "
                "`bench_grpo_step.py --out FILE` wrote",
                file=sys.stderr,
            )
            return 2

    rows, floor = [], 0.0
    for role, imports in ROLES:
        pss, anon = import_cost(imports)
        counted = not role.startswith("(")
        floor += anon if counted else 0.0
        key = role.split(" (")[0]
        at_peak = next((v for k, v in peak_roles.items() if k.startswith(key)), None)
        rows.append((role, imports.replace("import ", ""), anon / GIB, pss / GIB, at_peak))
    weights, state = training_state_bytes()
    floor += state

    print("Import cost of each process of `verl train --backend cpu` (fresh interpreter, nothing else done), GiB\n")
    head = "| process | imports | PSS anon | PSS | PSS at the bench's peak |"
    print(head + "\n|---|---|---|---|---|")
    for role, imports, anon, pss, at_peak in rows:
        print(f"| {role} | {imports} | {anon:.2f} | {pss:.2f} | {'n/a' if at_peak is None else f'{at_peak:.2f}'} |")
    print(
        f"| training state (actor weights, gradients, 2 AdamW moments, reference weights) | "
        f"5 x {weights / GIB:.2f} | {state / GIB:.2f} | {state / GIB:.2f} | |"
    )
    print(
        f"\nfloor (imports of the 8 processes + training state): {floor / GIB:.2f} GiB, of which imports "
        f"{(floor - state) / GIB:.2f} GiB"
    )
    if ours_peak is not None:
        print(f"ours, measured peak PSS total: {ours_peak:.2f} GiB")
    for name, peak in trl:
        print(f"{name}, measured peak PSS (one process): {peak:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
