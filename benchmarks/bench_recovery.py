"""Recovery time after a killed actor in ``verl train --backend cpu`` (prints a table).

Runs a short job (tiny random Llama unless --model is given) with a checkpoint every step, SIGKILLs the rollout
server right after step 1 is logged, and measures: time from the kill to the restart notice, from the kill to the
next completed step, and the job's normal step time, side by side in one run.

    python benchmarks/bench_recovery.py [--model HF_DIR] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def _steps(metrics: Path) -> dict[int, dict]:
    out = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "actor/pg_loss" in row["data"]:
                    out[int(row["step"])] = row["data"]
    return out


def _actor_pid(temp_dir: str, name: str) -> int | None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "raylet" in cmd and temp_dir in cmd:
            for c in p.children(recursive=True):
                try:
                    if " ".join(c.cmdline()).startswith(f"ray::{name}"):
                        return c.pid
                except psutil.NoSuchProcess:
                    pass
    return None


def _tiny_model(dest: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from verl_backend.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model folder (default: a tiny random Llama with SmolLM2's tokenizer)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rl_tpu_recovery_"))
    model = Path(args.model) if args.model else _tiny_model(work / "tiny")
    temp_dir = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    out = work / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        "--max-restarts",
        "1",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "rl_tpu.train_size=32",
        "rl_tpu.val_size=4",
        f"+ray_kwargs.ray_init._temp_dir={temp_dir}",
    ]
    log_path = work / "log.txt"
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while 1 not in _steps(out / "metrics.jsonl") or _actor_pid(temp_dir, "NativeRolloutServer") is None:
            if proc.poll() is not None:
                raise SystemExit(f"run ended before step 1 (rc {proc.returncode}); see {log_path}")
            time.sleep(0.2)
        os.kill(_actor_pid(temp_dir, "NativeRolloutServer"), signal.SIGKILL)
        killed = time.time()
        notice = None
        while 2 not in _steps(out / "metrics.jsonl"):
            if notice is None and "[rl-tpu] a Ray actor failed" in log_path.read_text():
                notice = time.time()
            if proc.poll() is not None:
                raise SystemExit(f"run ended (rc {proc.returncode}) before step 2; see {log_path}")
            time.sleep(0.2)
        resumed = time.time()
        rc = proc.wait()
    steps = _steps(out / "metrics.jsonl")
    step_s = [d["timing_s/step"] for s, d in steps.items() if s != 2]
    normal = sum(step_s) / len(step_s)
    rows = [
        ("kill -> restart notice (failure detected)", (notice or resumed) - killed),
        ("kill -> next step completed (recovery incl. re-init + step 2)", resumed - killed),
        ("normal step time (timing_s/step, mean of other steps)", normal),
        ("recovery / normal step", (resumed - killed) / normal),
    ]
    print(
        f"\nrecovery after SIGKILL of the rollout server (rc={rc}, total {time.time() - start:.0f} s, load "
        f"{os.getloadavg()[0]:.1f})\n"
    )
    print("| measure | seconds (or ratio) |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |")


if __name__ == "__main__":
    main()
