"""LoRA vs full fine-tuning: seconds per GRPO step, and what each weight sync moves and how long it takes.

Both runs are the default job (``verl train --backend cpu``: SmolLM2-135M-Instruct, float32, reasoning-gym's
``basic_arithmetic``, 4 prompts x 4 samples, responses <= 64 tokens), one after the other, each in its own process
tree with the memory sampler of ``bench_grpo_step.py``; the LoRA run adds VeRL's keys
``actor_rollout_ref.model.lora_rank=R lora_alpha=2R target_modules=all-linear``. ``--copy`` adds a third run:
full fine-tuning with ``rl_tpu.shared_weights=false`` (the trainer's weights copied to the rollout each step through
the Ray object store, as between hosts).

Columns (means over steps 2..N; step 1 is warm-up):

- ``s/step``: ``timing_s/step``; ``rollout``, ``update``: ``timing_s/gen``, ``timing_s/update_actor``;
- ``sync s``: ``timing_s/update_weights`` (trainer -> rollout, the whole call: with LoRA, merging each adapted
  matrix ``W + scaling * B @ A`` and writing it);
- ``sync MB``: megabytes the sync writes into the rollout's weights per step, from the sync's log line: full
  fine-tuning on one host moves none (the rollout computes on the trainer's parameters in shared memory); LoRA
  sends the merged model (the rollout has no adapter slots), every tensor of it;
- ``trainable M``: parameters the optimizer updates (millions);
- ``peak PSS GiB``: the whole run's largest summed proportional set size.

    python benchmarks/bench_lora.py [--steps 3] [--rank 16] [--threads 1] [--copy] [--keep DIR]

``--sync-only``: no job; one LoRA sync in this process on the default model (SmolLM2-135M-Instruct, fp32, an adapter
of ``--rank`` on all linear layers with a non-zero B), merged (``merged_lora_weights``, the merged model into the
rollout's weights) against adapter-only (``lora_adapter_payload`` through 4 MiB object-store buckets, merged on
receipt by ``AdapterMerger`` onto the base read from the model's safetensors; "+ refill": the rollout also rewrites
its unadapted weights from the files, as after giving its pages back while asleep). Bytes on the wire, seconds per
sync (median of ``--repeats``), and whether the rollout's weights are bitwise the merged ones.

    python benchmarks/bench_lora.py --sync-only [--rank 16] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_grpo_step import BenchError, _mean_after_warmup, run_ours

# "[rl-tpu] weight sync to rollout replica 0: shared memory, in place: ..., 0 MB copied, 538 MB in 0.01 s"
SYNC_LINE = re.compile(
    r"weight sync to rollout replica 0: (?P<transport>[a-z ]+)(?P<detail>, [^\n]*?)?, "
    r"(?P<mb>\d+) MB in (?P<s>[0-9.]+) s(?P<what> \([^\n]*\))?"
)


def sync_megabytes(log: str) -> tuple[float, str]:
    """``(megabytes written into the rollout per sync, transport)`` from a run's log (the first sync's line; every
    sync sends the same tensors). In place (shared memory the rollout computes on): the megabytes copied."""
    m = SYNC_LINE.search(log)
    if m is None:
        raise BenchError("no weight sync line in the run's log")
    copied = re.search(r"(\d+) MB copied", m.group("detail") or "")
    transport = m.group("transport") + (" in place" if copied else "")
    return float(copied.group(1) if copied else m.group("mb")), transport


def trainable_millions(rank: int | None) -> float:
    """Parameters the optimizer updates, in millions: the default model's all (``rank=None``), or those of a LoRA
    adapter of ``rank`` on all its linear layers (peft's ``all-linear``: the LM head left out), counted on a
    meta-device copy (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_backend.models import ensure_default_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ensure_default_model()))
        if rank is not None:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    return sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6


def sync_table(rank: int, threads: int, repeats: int) -> list[dict]:
    """Merged vs adapter-only LoRA sync on the default model, in this process (see ``--sync-only``)."""
    import statistics
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rl_tpu.collectives import iter_buckets, pack_bucket, unpack_bucket
    from verl_backend.models import ensure_default_model
    from verl_backend.weight_sync.lora import AdapterMerger, SafetensorsBase, lora_adapter_payload, merged_lora_weights

    torch.set_num_threads(threads)
    path = str(ensure_default_model())
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer = get_peft_model(load(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    rollout = load()
    own = rollout.state_dict()

    def into_rollout(stream) -> int:
        n = 0
        with torch.no_grad():
            for name, t in stream:
                own[name].copy_(t)
                n += t.numel() * t.element_size()
        return n

    def merged() -> int:
        return into_rollout(merged_lora_weights(trainer))

    base = SafetensorsBase(path)

    def adapter(refill: bool):
        def run() -> int:
            merger, wire = AdapterMerger(base), 0
            for bucket in iter_buckets(lora_adapter_payload(trainer), 4 << 20):
                flat, meta = pack_bucket(bucket)
                wire += flat.numel()
                into_rollout(merger(unpack_bucket(flat.numpy(), meta)))
            if refill:
                into_rollout(merger.unadapted())
            merger.finish()
            return wire

        return run

    want = {n: t.clone() for n, t in merged_lora_weights(trainer)}
    rows = []
    for name, fn in (
        ("merged model", merged),
        ("adapter only", adapter(False)),
        ("adapter only + refill", adapter(True)),
    ):
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            nbytes = fn()
            seconds.append(time.perf_counter() - start)
        exact = all(torch.equal(own[n], t) for n, t in want.items())
        rows.append({"name": name, "mb": nbytes / 1e6, "s": statistics.median(seconds), "exact": exact})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per run (step 1 is warm-up; >= 2)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank, all linear layers)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument(
        "--copy",
        action="store_true",
        help="add full fine-tuning with its weights copied each sync (rl_tpu.shared_weights=false, Ray object store)",
    )
    ap.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    ap.add_argument("--keep", help="keep the run folders (logs, metrics) here instead of a temporary folder")
    ap.add_argument("--sync-only", action="store_true", help="no job: merged vs adapter-only sync in this process")
    ap.add_argument("--repeats", type=int, default=5, help="--sync-only: syncs timed per row (median)")
    args = ap.parse_args()
    if args.sync_only:
        rows = sync_table(args.rank, args.threads, args.repeats)
        load = os.getloadavg()
        print(
            f"\nLoRA sync, SmolLM2-135M-Instruct fp32, rank {args.rank} all-linear, {args.threads} torch thread(s), "
            f"median of {args.repeats}; load average {load[0]:.1f}\n"
        )
        print("| sync | MB on the wire | s per sync | rollout weights bitwise the merged model |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['mb']:.1f} | {r['s']:.3f} | {'yes' if r['exact'] else 'NO'} |")
        return 0
    if args.steps < 2:
        print("bench_lora: error: --steps must be >= 2 (step 1 is warm-up)", file=sys.stderr)
        return 2
    lora = [
        f"actor_rollout_ref.model.lora_rank={args.rank}",
        f"actor_rollout_ref.model.lora_alpha={2 * args.rank}",
        "actor_rollout_ref.model.target_modules=all-linear",
    ]
    runs = [("full fine-tuning", [], None), (f"LoRA rank {args.rank}, all-linear", lora, args.rank)]
    if args.copy:
        runs.insert(1, ("full fine-tuning, copied (shared_weights=false)", ["rl_tpu.shared_weights=false"], None))
    root = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="bench_lora_"))
    rows = []
    try:
        for i, (name, overrides, rank) in enumerate(runs):
            work = root / f"run{i}"
            work.mkdir(parents=True, exist_ok=True)
            print(f"[bench] {name}: verl train --backend cpu, {args.steps} steps, logs in {work}", flush=True)
            r = run_ours(work, args.steps, args.threads, args.timeout, overrides)
            log = (work / "verl.log").read_text(errors="replace")
            mb, transport = sync_megabytes(log)
            rows.append(
                {
                    "name": name,
                    "transport": transport,
                    "sync_mb": mb,
                    "trainable_m": trainable_millions(rank),
                    **{k: _mean_after_warmup(r[k]) for k in ("step_s", "rollout_s", "update_s", "weight_sync_s")},
                    "step_list": r["step_s"],
                    "peak_pss": r["memory"]["peak_pss_total_gib"],
                    "wall": r["wall_s"],
                }
            )
    except BenchError as exc:
        print(f"bench_lora: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    print(
        f"\nGRPO step, SmolLM2-135M-Instruct fp32, default job (4 prompts x 4 samples), {args.threads} torch "
        f"thread(s) per process; mean of steps 2..{args.steps}; {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n"
    )
    head = [
        "run",
        "trainable M",
        "s/step",
        "rollout s",
        "update s",
        "sync s",
        "sync MB",
        "sync transport",
        "peak PSS GiB",
    ]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    fmt = lambda v, spec=".2f": "n/a" if v is None else format(v, spec)
    for r in rows:
        print(
            f"| {r['name']} | {fmt(r['trainable_m'], '.1f')} | {fmt(r['step_s'])} | {fmt(r['rollout_s'])} | "
            f"{fmt(r['update_s'])} | {fmt(r['weight_sync_s'], '.3f')} | {r['sync_mb']:.0f} | {r['transport']} | "
            f"{r['peak_pss']:.2f} |"
        )
    for r in rows:
        print(f"\n{r['name']}: step s {[round(s, 1) for s in r['step_list']]}, wall {r['wall']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
