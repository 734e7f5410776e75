"""The TPU dry run on the ``tpu-on-cpu`` backend against the eager dry run, the same job and seed (issue #43 items 3, 5).

Starts a fake v6e-4 slice (``ray_cluster.fake_slice``), then runs ``verl train --backend cpu --tpu-dry-run`` twice:

- ``tpu-on-cpu``: the TPU profile's compile flags on, ``rl_tpu.compile_backend=tpu-on-cpu`` (the compiled regions as
  TorchTPU's StableHLO on XLA:CPU; the dry run's default where .venv-aot exists);
- ``eager``: ``rl_tpu.compile_trainer=false rl_tpu.compile_sampler=false`` (the dry run before #43).

Both use the TPU profile's dtypes (bf16 rollout; bf16 compute over fp32 master weights, fp32 reduce). Prints one table:
wall seconds, mean s/step, and per step the reward, the response length, the rollout's log-probs against the trainer's
on the same tokens (VeRL's rollout-correction diagnostics, when ``--diagnostics`` asks for them), the entropy and the
grad norm; the validation accuracy before and after; for tpu-on-cpu its graph counts, lowering, XLA:CPU compile,
execution and DLPack seconds, and the step estimate on the slice's chip; and, from the validation dumps at step 0
(greedy), the share of items whose response is identical in both runs.

Bounds, written before the runs: step 1's greedy validation responses identical for >= 95% of items (bf16 rounding
decides near-ties only); each later figure agrees statistically, not exactly (the sampled runs diverge by design once
one token differs): the rollout-vs-trainer log-prob root mean square <= 0.1 nats (the dry run test's bound) in both.

Usage::

    python benchmarks/bench_tpu_on_cpu.py --model PATH --steps 2 --out /tmp/bench_tpu_on_cpu [VeRL overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {
    "tpu-on-cpu": ["rl_tpu.compile_trainer=true", "rl_tpu.compile_sampler=true", "rl_tpu.compile_backend=tpu-on-cpu"],
    "eager": ["rl_tpu.compile_trainer=false", "rl_tpu.compile_sampler=false", "rl_tpu.compile_backend=device"],
}
METRICS = (
    ("reward", "critic/score/mean"),
    ("response tokens", "response_length/mean"),
    ("log-prob RMS |Δ|", None),
    ("entropy", "actor/entropy"),
    ("grad norm", "actor/grad_norm"),
    ("s/step", "timing_s/step"),
)


def run(mode: str, out: Path, args, address: str) -> float:
    cmd = [
        sys.executable, "-m", "verl_backend.driver.cli", "train", "--backend", "cpu", "--tpu-dry-run",
        "--output-dir", str(out), "--max-restarts", "0",
        f"actor_rollout_ref.model.path={args.model}", f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=true", f"trainer.test_freq={args.steps}", "trainer.save_freq=-1",
        f"trainer.validation_data_dir={out / 'validation'}",
        *MODES[mode], *args.overrides,
    ]  # fmt: skip
    if args.diagnostics:
        cmd += [
            "algorithm.rollout_correction.rollout_rs='token_k1,token_k2'",
            "algorithm.rollout_correction.rollout_rs_threshold='1e-9_1e9,1e9'",
        ]
    env = dict(os.environ, RAY_ADDRESS=address, RAY_AUTH_MODE="disabled")
    start = time.time()
    with open(out.parent / f"{mode}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, timeout=args.timeout)
    return time.time() - start


def step_rows(out: Path) -> list[dict]:
    from verl_backend.driver.report import read_metrics

    return [r["data"] for r in read_metrics(out / "metrics.jsonl") if "timing_s/step" in r["data"]]


def value(row: dict, key: str | None):
    if key is None:  # sqrt(2 E[k2]) >= mean |log pi_trainer - log pi_rollout| (tests/.../test_tpu_dry_run.py)
        k2 = row.get("rollout_corr/rollout_rs_token_k2_mean")
        return None if k2 is None else (2 * k2) ** 0.5
    return row.get(key)


def first_dump(folder: Path) -> dict[str, str]:
    """The first validation dump (step 0, greedy) of a run's ``validation/`` folder: ``{prompt text: response text}``,
    keyed by prompt (the dumps' order is the agent loop's, not the dataset's)."""
    files = sorted(folder.glob("*.jsonl"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
    if not files:
        return {}
    rows = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    return {row.get("input", ""): row.get("output", "") for row in rows}


def greedy_agreement(a: Path, b: Path) -> tuple[int, int, list[tuple[str, str, str]]]:
    """Items of the first validation dump (step 0, greedy) whose response is the same text in both runs:
    ``(same, items, [(prompt, one, other)] of the differing items)``."""
    x, y = first_dump(a / "validation"), first_dump(b / "validation")
    common = [k for k in x if k in y]
    differ = [(k, x[k], y[k]) for k in common if x[k] != y[k]]
    return len(common) - len(differ), len(common), differ


def divergence_gaps(model: str, data_dir: Path, differ: list[tuple[str, str, str]]) -> list[dict]:
    """For each differing greedy response, the first token where the two runs part and the base model's logit gap
    there: ``logit(one's token) - logit(other's token)`` and the top-1 margin, from the plain Hugging Face forward in
    fp32 on the prompt (the validation parquet's chat, rendered by the tokenizer's template) plus the common tokens.

    Step 0's validation runs the base model, so this is the forward both runs approximate in bf16. A gap within bf16's
    rounding of the logits (about 2**-8 of their magnitude: ~0.06-0.125 nats at logits of 16-32) is a near-tie, where
    either run may pick either token. The responses are re-tokenized from the dump's text (special tokens skipped), so
    a response whose text re-tokenizes differently can place the divergence a token late.
    """
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompts = {}
    for parquet in sorted(data_dir.glob("*_val.parquet")):
        for chat in pd.read_parquet(parquet)["prompt"]:
            ids = tokenizer.apply_chat_template(
                [dict(m) for m in chat], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            prompts[tokenizer.decode(ids, skip_special_tokens=True)] = list(ids)
    rows = []
    for prompt, one, other in differ:
        if prompt not in prompts:
            rows.append({"prompt": prompt, "error": "prompt not found in the validation parquet"})
            continue
        a = tokenizer(one, add_special_tokens=False)["input_ids"]
        b = tokenizer(other, add_special_tokens=False)["input_ids"]
        at = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
        if at >= min(len(a), len(b)):  # one response is a prefix of the other: it stopped (eos) where the other went on
            rows.append({"prompt": prompt, "token": at, "one": one[-20:], "other": other[-20:], "gap": None})
            continue
        with torch.no_grad():
            logits = lm(torch.tensor([prompts[prompt] + a[:at]])).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        rows.append({
            "prompt": prompt, "token": at,
            "one": tokenizer.decode(a[at]), "other": tokenizer.decode(b[at]),
            "gap": float(logits[a[at]] - logits[b[at]]), "margin": float(top[0] - top[1]),
            "scale": float(logits.abs().max()),
        })  # fmt: skip
    return rows


def graph_costs(cache_dir: Path) -> list[dict]:
    """Per distinct graph of a tpu-on-cpu run (its stats files, :mod:`verl_backend.driver.aot.executed`): its name
    and shapes, the processes that traced it, and summed over them the lowering, XLA:CPU compile, execution and DLPack
    seconds and the executions; largest compile first."""
    from verl_backend.driver.aot.executed import graph_request, read_stats

    out: dict[str, dict] = {}
    for row in read_stats(cache_dir):
        request = graph_request(row)
        name = f"{row['region']}.{row['part']} " + (request.name if request else str(row.get("inputs")))
        entry = out.setdefault(row["key"], {"graph": name, "traced": 0, "runs": 0, "lower_s": 0.0, "compile_s": 0.0,
                                            "run_s": 0.0, "copy_s": 0.0})  # fmt: skip
        entry["traced"] += 1
        for k in ("runs", "lower_s", "compile_s", "run_s", "copy_s"):
            entry[k] += row[k]
    return sorted(out.values(), key=lambda e: -e["compile_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_tpu_on_cpu"))
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--diagnostics", action="store_true", help="VeRL's rollout-correction log-ratio metrics")
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the runs to make (the report reads both)"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="print the table from the runs already in --out (no new runs)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    if not args.report_only:
        from ray_cluster import fake_slice

        args.out.mkdir(parents=True, exist_ok=True)
        state = args.out / "cluster.json"
        cluster = fake_slice.start(["v6e-4"], head_cpus=4, object_store_mb=256, state_file=state, timeout_s=240)
        walls_file = args.out / "walls.json"
        walls = json.loads(walls_file.read_text()) if walls_file.exists() else {}
        try:
            for mode in args.modes:
                walls[mode] = run(mode, args.out / mode, args, cluster.address)
                walls_file.write_text(json.dumps(walls))
        finally:
            fake_slice.stop(state_file=state)
    walls_file = args.out / "walls.json"
    walls = json.loads(walls_file.read_text()) if walls_file.exists() else {}
    rows = {mode: step_rows(args.out / mode) for mode in MODES}
    summaries = {mode: json.loads((args.out / mode / "summary.json").read_text()) for mode in MODES}
    for mode in MODES:  # the driver's own wall time where the bench's is not on record (a --report-only of older runs)
        walls.setdefault(mode, summaries[mode]["wall_s"])
    print(f"| figure | {' | '.join(MODES)} |\n|---|{'---|' * len(MODES)}")
    print(f"| wall s | {' | '.join(f'{walls[m]:.0f}' for m in MODES)} |")
    for step in range(args.steps):
        for label, key in METRICS:
            cells = []
            for m in MODES:
                v = value(rows[m][step], key) if step < len(rows[m]) else None
                cells.append("n/a" if v is None else f"{v:.4g}")
            print(f"| step {step + 1} {label} | {' | '.join(cells)} |")
    for k in ("val_accuracy_before", "val_accuracy_after"):
        print(f"| {k} | {' | '.join(str(summaries[m].get(k)) for m in MODES)} |")
    same, items, differ = greedy_agreement(args.out / "tpu-on-cpu", args.out / "eager")
    print(f"\nstep 0 greedy validation responses identical: {same} of {items}")
    if differ:
        print(
            "| item | first differing token | tpu-on-cpu | eager | fp32 logit gap | fp32 top-1 margin | max abs logit |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in divergence_gaps(args.model, args.out / "tpu-on-cpu" / "data", differ):
            item = row["prompt"].split("Calculate ")[-1].split(".")[0] if "Calculate " in row["prompt"] else "?"
            if "error" in row:
                print(f"| {item} | {row['error']} | | | | | |")
            elif row["gap"] is None:
                print(f"| {item} | {row['token']} (one stopped) | {row['one']!r} | {row['other']!r} | | | |")
            else:
                print(
                    f"| {item} | {row['token']} | {row['one']!r} | {row['other']!r} | {row['gap']:+.3f} "
                    f"| {row['margin']:.3f} | {row['scale']:.1f} |"
                )
    print("\n| graph | traced (processes) | lowering s | XLA:CPU compile s | executions | execution s | DLPack s |")
    print("|---|---|---|---|---|---|---|")
    for g in graph_costs(args.out / "tpu-on-cpu" / "tpu-on-cpu"):
        print(
            f"| {g['graph']} | {g['traced']} | {g['lower_s']:.1f} | {g['compile_s']:.1f} | {g['runs']} "
            f"| {g['run_s']:.1f} | {g['copy_s']:.1f} |"
        )
    entry = summaries["tpu-on-cpu"].get("tpu_on_cpu", {})
    print(f"tpu-on-cpu graphs: {entry.get('line')}")
    print(f"step estimate: {entry.get('step_estimate', {}).get('line')}")
    ratio = walls["tpu-on-cpu"] / walls["eager"]
    print(f"wall: tpu-on-cpu / eager = {ratio:.2f}x")


if __name__ == "__main__":
    main()
