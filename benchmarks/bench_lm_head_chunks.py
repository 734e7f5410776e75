"""Peak host memory and time of the trainer's LM head over a micro batch's response tokens: all the logits at once
(``packed_response_log_probs``) against the chunked head (``chunked_response_log_probs``, ``rl_tpu.logits_chunk_mib``).

Each case runs in a fresh process: the LM head's forward, log-probs and entropy, then the backward of a loss over the
log-probs, on random hidden states and a random head weight of the model's shape (fp32). The figure is the process's
peak RSS (``ru_maxrss``) over its RSS just before the forward, so it counts the logits, their softmax copies and the
gradients the head leaves (``dhidden``, ``dweight``), not the model. Hidden sizes and vocabularies are the real
models': Gemma 3 270M (640, 262,144) and SmolLM2-135M (576, 49,152).

Usage::

    python benchmarks/bench_lm_head_chunks.py                       # the table
    python benchmarks/bench_lm_head_chunks.py --tokens 256 1024     # response tokens per micro batch
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"gemma-3-270m": (640, 262_144), "SmolLM2-135M": (576, 49_152)}


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def case(model: str, tokens: int, chunk_mib: int) -> dict:
    """One measurement, in this process: ``chunk_mib`` 0 is all the logits at once."""
    import torch

    sys.path.insert(0, str(ROOT))
    from verl_backend.workers.response_logits import (
        chunked_response_log_probs,
        logits_chunk_tokens,
        packed_response_log_probs,
    )

    torch.set_num_threads(2)
    hidden_size, vocab = MODELS[model]
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden_size, generator=g) * 0.02)
    hidden = (torch.randn(1, tokens, hidden_size, generator=g)).requires_grad_(True)
    total = tokens + 8  # a packed row: 8 prompt positions, then the response positions
    labels = torch.randint(0, vocab, (total,), generator=g)
    keep = torch.arange(8, total)
    offsets = torch.tensor([0, total])
    base = _rss_kib()
    t0 = time.perf_counter()
    if chunk_mib:
        out = chunked_response_log_probs(
            hidden, weight, labels, 0.7, keep, offsets, logits_chunk_tokens(vocab, chunk_mib), entropy=True
        )
    else:
        logits = torch.nn.functional.linear(hidden, weight)
        out = packed_response_log_probs(logits, labels, torch.full((total,), 0.7), keep, offsets, entropy=True)
    loss = (out["log_probs"].values()[keep] * torch.linspace(0.5, 1.5, tokens)).sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "model": model,
        "tokens": tokens,
        "chunk_mib": chunk_mib,
        "peak_over_base_mib": (peak - base) / 1024,
        "logits_mib": tokens * vocab * 4 / 2**20,
        "seconds": seconds,
        "log_prob_sum": float(out["log_probs"].values().sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--chunk-mib", nargs="+", type=int, default=[0, 128, 32])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--case", nargs=3, metavar=("MODEL", "TOKENS", "CHUNK_MIB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case(args.case[0], int(args.case[1]), int(args.case[2]))))
        return
    print(
        f"{'model':<14} {'tokens':>6} {'fp32 logits MiB':>15} {'chunk MiB':>9} {'peak over base MiB':>18} "
        f"{'x whole':>7} {'seconds':>8} {'Σ log-prob':>12}"
    )
    for model in args.models:
        for tokens in args.tokens:
            whole = None
            for chunk in args.chunk_mib:
                got = subprocess.run(
                    [sys.executable, __file__, "--case", model, str(tokens), str(chunk)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                r = json.loads(got.stdout.strip().splitlines()[-1])
                whole = whole or (r if chunk == 0 else None)
                ratio = r["peak_over_base_mib"] / whole["peak_over_base_mib"] if whole else float("nan")
                print(
                    f"{model:<14} {tokens:>6} {r['logits_mib']:>15.0f} {chunk or 'whole':>9} "
                    f"{r['peak_over_base_mib']:>18.0f} {ratio:>7.2f} {r['seconds']:>8.2f} {r['log_prob_sum']:>12.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
