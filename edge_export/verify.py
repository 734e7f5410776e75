"""Verification: run the written file with the LiteRT runtime and compare with PyTorch eager.

Error measure: ``max_abs_error = max |y_litert - y_torch|`` over all output elements (logits for LMs), and
``relative_error = max_abs_error / max |y_torch|`` -- scale-free, so one tolerance per quantization serves models
whose outputs or logits differ in magnitude. For LMs the LiteRT file decodes greedily and PyTorch scores the same
token sequence in one forward pass (teacher forcing); ``greedy_agreement`` is the number of leading steps whose
PyTorch argmax equals the LiteRT token, i.e. how many tokens PyTorch's own greedy decoding reproduces exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from edge_export.runtime import LiteRTCausalLM, TFLiteModule
from rl_tpu.patches.torch_internals import tree_flatten


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass bounds for one quantization: relative error ceiling and least share of greedy steps that agree."""

    relative_error: float
    greedy_agreement: float


# Bounds from measurements (benchmarks/bench_litert_export.py, 32 greedy steps): SmolLM2-135M relative error
# fp32 < 1e-5, weight-int8 0.050, dynamic-int8 0.087, dynamic-int4 (channelwise) 0.56; tiny random models and
# the MLP/CNN stay well below these. fp32 must also reproduce every greedy token; quantized files are allowed to
# drift after near-ties, so their greedy agreement is reported, not required.
TOLERANCES = {
    "none": Tolerance(relative_error=1e-3, greedy_agreement=1.0),
    "weight-int8": Tolerance(relative_error=0.10, greedy_agreement=0.0),
    "dynamic-int8": Tolerance(relative_error=0.20, greedy_agreement=0.0),
    "dynamic-int4": Tolerance(relative_error=0.75, greedy_agreement=0.0),
    "dynamic-int4-block": Tolerance(relative_error=0.75, greedy_agreement=0.0),
}


def _errors(lite: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    max_abs = float(np.max(np.abs(lite.astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return max_abs, max_abs / scale if scale > 0 else max_abs


def _verdict(report: dict, tolerance: Tolerance) -> dict:
    failures = []
    if not report["relative_error"] <= tolerance.relative_error:  # NaN fails too
        failures.append(
            f"relative error {report['relative_error']:.3g} exceeds {tolerance.relative_error:.3g} by "
            f"{report['relative_error'] - tolerance.relative_error:.3g} (max abs error {report['max_abs_error']:.4g})"
        )
    if "greedy_agreement" in report and report["greedy_agreement"] < tolerance.greedy_agreement:
        failures.append(
            f"greedy tokens agree for {report['greedy_agreed_steps']}/{report['steps']} steps, "
            f"{tolerance.greedy_agreement:.0%} required"
        )
    report.update(
        tolerance={"relative_error": tolerance.relative_error, "greedy_agreement": tolerance.greedy_agreement},
        passed=not failures,
        failures=failures,
    )
    return report


def verify_module(
    path: str, module: torch.nn.Module, sample_args: tuple, tolerance: Tolerance, num_threads: int = 1
) -> dict:
    """Compare the file's single signature with ``module(*sample_args)`` on the sample inputs.

    Returns:
        dict with ``max_abs_error``, ``relative_error``, ``outputs`` (count), ``passed``, ``failures``.
    Raises:
        ExportError(MISSING_RUNTIME_OP): the runtime lacks a kernel for an opcode in the file.
    """
    lite = TFLiteModule(path, num_threads)(*[a.numpy() for a in sample_args])
    with torch.no_grad():
        ref, _ = tree_flatten(module.eval()(*sample_args))
    ref = [r.detach().float().numpy() if r.is_floating_point() else r.numpy() for r in ref]
    if len(ref) != len(lite):
        raise AssertionError(f"{path}: {len(lite)} outputs, PyTorch gives {len(ref)}")
    pairs = [_errors(l.astype(r.dtype).reshape(r.shape), r) for l, r in zip(lite, ref)]
    report = {
        "outputs": len(ref),
        "max_abs_error": max(p[0] for p in pairs),
        "relative_error": max(p[1] for p in pairs),
    }
    return _verdict(report, tolerance)


def verify_causal_lm(
    path: str,
    model: torch.nn.Module,
    prompt_ids: list[int],
    steps: int,
    tolerance: Tolerance,
    num_threads: int = 1,
) -> dict:
    """Greedy-decode ``steps`` tokens with the LiteRT file and compare every step's logits with PyTorch.

    Args:
        model: the HF ``*ForCausalLM`` in float32 eval mode.
        prompt_ids: prompt token ids, at least one; prompt + steps must fit the file's cache length.
    Returns:
        dict with ``max_abs_error`` / ``relative_error`` over all (steps, vocab) logits, ``greedy_agreed_steps``,
        ``greedy_agreement`` (share of leading steps agreeing), ``top1_agreement`` (share of all steps),
        ``litert_tokens``, ``passed``, ``failures``.
    """
    lm = LiteRTCausalLM(path, num_threads)
    tokens, lite_logits = lm.greedy(prompt_ids, steps)
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + tokens[:-1]])
        ref = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :].float().numpy()  # (steps, vocab)
    max_abs, rel = _errors(lite_logits, ref)
    agree = ref.argmax(-1) == np.asarray(tokens)
    agreed_steps = int(np.argmin(agree)) if not agree.all() else steps
    report = {
        "prompt_tokens": len(prompt_ids),
        "steps": steps,
        "max_abs_error": max_abs,
        "relative_error": rel,
        "greedy_agreed_steps": agreed_steps,
        "greedy_agreement": agreed_steps / steps,
        "top1_agreement": float(agree.mean()),
        "litert_tokens": tokens,
    }
    return _verdict(report, tolerance)


def format_table(rows: list[tuple[str, str]]) -> str:
    """Two-column plain-text table."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
