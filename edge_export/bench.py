"""Latency of an exported file under the LiteRT runtime against PyTorch eager, same machine, same thread count.

Figures are wall-clock medians (``time.perf_counter``) after one warm-up call, in milliseconds:
- plain modules: one call on the sample inputs;
- causal LMs: ``prefill_ms`` for one prefill call of the prompt, ``decode_ms_per_token`` for single-token decode
  steps with the KV cache (LiteRT: the ``decode`` signature; PyTorch: ``model(input_ids, past_key_values)`` with
  HF's DynamicCache), batch 1.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

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
    report = {"file_bytes": os.path.getsize(path), "threads": num_threads,
              "litert_ms": _median_ms(lambda: lite(*arrays), repeats)}
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
    report = {"file_bytes": os.path.getsize(path), "threads": num_threads, "prompt_tokens": len(prompt_ids),
              "decode_steps": steps}
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
