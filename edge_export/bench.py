"""Latency of an exported file under the LiteRT runtime against PyTorch eager, same machine, same thread count.

Figures are wall-clock medians (``time.perf_counter``) after one warm-up call, in milliseconds:
- plain modules: one call on the sample inputs;
- causal LMs: ``prefill_ms`` for one prefill call of the prompt, ``decode_ms_per_token`` for single-token decode
  steps with the KV cache (LiteRT: the ``decode`` signature; PyTorch: ``model(input_ids, past_key_values)`` with
  HF's DynamicCache), batch 1.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from edge_export.errors import BAD_FILE, ExportError
from edge_export.runtime import LiteRTCausalLM, TFLiteModule


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_module(
    path: str, sample_args: tuple, module: torch.nn.Module | None = None, num_threads: int = 1, repeats: int = 20
) -> dict:
    """Median ms per call for the file (and ``module`` in eager PyTorch when given) on ``sample_args``."""
    torch.set_num_threads(num_threads)
    lite = TFLiteModule(path, num_threads)
    arrays = [a.numpy() for a in sample_args]
    report = {
        "file_bytes": os.path.getsize(path),
        "threads": num_threads,
        "litert_ms": _median_ms(lambda: lite(*arrays), repeats),
    }
    if module is not None:
        module = module.eval()
        with torch.no_grad():
            report["torch_ms"] = _median_ms(lambda: module(*sample_args), repeats)
        report["litert_over_torch"] = report["litert_ms"] / report["torch_ms"]
    return report


def bench_causal_lm(
    path: str,
    prompt_ids: list[int],
    model: torch.nn.Module | None = None,
    steps: int = 32,
    num_threads: int = 1,
    repeats: int = 3,
) -> dict:
    """Prefill ms and decode ms/token for the file, and for ``model`` in eager PyTorch when given."""
    torch.set_num_threads(num_threads)
    lm = LiteRTCausalLM(path, num_threads)
    steps = min(steps, lm.cache_length - len(prompt_ids))
    report = {
        "file_bytes": os.path.getsize(path),
        "threads": num_threads,
        "prompt_tokens": len(prompt_ids),
        "decode_steps": steps,
    }
    cache = lm.prefill(prompt_ids, lm.empty_cache())
    report["litert_prefill_ms"] = _median_ms(lambda: lm.prefill(prompt_ids, lm.empty_cache()), repeats)

    def lite_decode():
        c, token = cache, prompt_ids[-1]
        for i in range(steps):
            logits, c = lm.decode(token, len(prompt_ids) + i, c)
            token = int(np.argmax(logits))

    report["litert_decode_ms_per_token"] = _median_ms(lite_decode, repeats) / steps
    if model is None:
        return report
    from transformers import DynamicCache

    model = model.eval()
    ids = torch.tensor([prompt_ids])

    def torch_prefill():
        return model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)

    with torch.no_grad():
        report["torch_prefill_ms"] = _median_ms(torch_prefill, repeats)

        def torch_decode():
            out = torch_prefill()  # a fresh cache each run; only the decode steps are timed
            start = time.perf_counter()
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                out = model(input_ids=token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - start) * 1e3

        torch_decode()  # warm-up
        report["torch_decode_ms_per_token"] = statistics.median(torch_decode() for _ in range(repeats)) / steps
    report["decode_litert_over_torch"] = report["litert_decode_ms_per_token"] / report["torch_decode_ms_per_token"]
    report["prefill_litert_over_torch"] = report["litert_prefill_ms"] / report["torch_prefill_ms"]
    return report


_RUNTIME_BENCHMARK = """
import dataclasses, json, sys, tempfile
import litert_lm
with tempfile.TemporaryDirectory(prefix="litertlm-xnnpack-") as cache:  # not beside the bundle
    info = litert_lm.Benchmark(model_path=sys.argv[1], backend=litert_lm.Backend.CPU(thread_count=int(sys.argv[2])),
                               prefill_tokens=int(sys.argv[3]), decode_tokens=int(sys.argv[4]), cache_dir=cache).run()
peak = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print("BENCHMARK " + json.dumps({**dataclasses.asdict(info), "peak_kib": peak[0] if peak else None}), flush=True)
"""


def bench_litertlm(path: str, num_threads: int = 1, prefill_tokens: int = 128, decode_tokens: int = 64) -> dict:
    """A ``.litertlm`` through the LiteRT-LM runtime's own ``Benchmark`` API (CPU backend), in a child process.

    Returns:
        dict with ``litert_prefill_tokens_per_s``, ``litert_decode_tokens_per_s``, ``init_s``,
        ``time_to_first_token_s`` and ``litert_peak_rss_gib`` (the child's own peak resident memory after it
        started, ``VmHWM``: interpreter, engine, weights, KV cache; rusage's maxrss would include the parent's
        size at fork), plus ``file_bytes`` and ``threads``.
    Raises:
        ExportError(BAD_FILE): the runtime cannot load or run the bundle (its last log line in the message).
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUNTIME_BENCHMARK, path, str(num_threads), str(prefill_tokens), str(decode_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate()
    found = [line for line in out.splitlines() if line.startswith("BENCHMARK ")]
    if proc.returncode != 0 or not found:
        last = ([line for line in err.splitlines() if line.strip()] or ["no output"])[-1]
        raise ExportError(BAD_FILE, f"the LiteRT-LM runtime could not benchmark {path}: {last}")
    info = json.loads(found[-1].removeprefix("BENCHMARK "))
    return {
        "file_bytes": os.path.getsize(path),
        "threads": num_threads,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": decode_tokens,
        "litert_prefill_tokens_per_s": info["last_prefill_tokens_per_second"],
        "litert_decode_tokens_per_s": info["last_decode_tokens_per_second"],
        "init_s": info["init_time_in_second"],
        "time_to_first_token_s": info["time_to_first_token_in_second"],
        "litert_peak_rss_gib": info["peak_kib"] / 2**20 if info.get("peak_kib") else float("nan"),
    }


def torch_tokens_per_s(
    model: torch.nn.Module, prefill_tokens: int = 128, decode_tokens: int = 64, num_threads: int = 1
) -> dict:
    """PyTorch eager prefill and greedy decode tokens/s (batch 1, HF DynamicCache), on token ids 1..prefill_tokens."""
    torch.set_num_threads(num_threads)
    ids = torch.arange(1, prefill_tokens + 1)[None]
    with torch.no_grad():
        model(input_ids=ids[:, :8])  # warm-up
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill_s = time.perf_counter() - start
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - start
    return {
        "torch_prefill_tokens_per_s": prefill_tokens / prefill_s,
        "torch_decode_tokens_per_s": decode_tokens / decode_s,
    }
