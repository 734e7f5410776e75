"""Conversion: causal LMs through litert-torch's generative export, plain modules through ``litert_torch.convert``.

Both write into a caller-chosen temporary path; ``edge_export.export`` verifies and moves the result into place.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import sys

import torch

from edge_export import litert_patches
from edge_export.errors import ExportError, explain_conversion_failure
from edge_export.quantize import quantize_tflite, recipe_name
from edge_export.sources import Checkpoint
from rl_tpu.patches.torch_internals import tree_flatten

CONVERSION_FAILED = "conversion-failed"


def _conversion_error(exc: BaseException, what: str, module=None, sample_args=None) -> ExportError:
    known = explain_conversion_failure(exc, module, sample_args)
    if known is not None:
        return known
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    return ExportError(
        CONVERSION_FAILED,
        f"litert-torch could not convert {what}: {type(exc).__name__}: {first_line} (rerun with --debug for the "
        "stack trace)",
    )


def export_causal_lm(
    checkpoint: Checkpoint,
    output_path: str,
    workdir: str,
    *,
    bundle: bool,
    quantization: str,
    prefill_lengths: list[int],
    cache_length: int,
    block_size: int = 32,
) -> None:
    """Export an HF causal LM with ``litert_torch.generative.export_hf`` (what ``litert-torch export_hf`` runs).

    Args:
        checkpoint: the checked folder (``sources.inspect_checkpoint``).
        output_path: where to write the ``.litertlm`` (``bundle=True``) or ``.tflite``.
        workdir: scratch folder on the same file system, removed by the caller.
        bundle: a float ``.litertlm`` with the tokenizer inside (``edge_export.bundle.finish_bundle`` then writes
            its chat format and quantizes it); else a ``.tflite`` with ``prefill_<N>`` and ``decode`` signatures,
            quantized here with the ai-edge-quantizer recipe.
        prefill_lengths: one ``prefill_<N>`` signature per length (tokens per prefill call).
        cache_length: KV-cache slots (maximum prompt + generated tokens).
    Raises:
        ExportError: a known conversion failure kind, or CONVERSION_FAILED with the library's message.
    """
    recipe = recipe_name(quantization)
    litert_patches.install()  # litert-torch fixes, version-ranged (edge_export/litert_patches.py)
    with quiet_stdout(True):  # transformers prints "[ERROR] ... not documented" lines for litert's model files
        from litert_torch.generative.export_hf import export as export_hf

    out_dir = os.path.join(workdir, "export_hf")
    try:
        export_hf.export(
            model=checkpoint.path,
            output_dir=out_dir,
            prefill_lengths=list(prefill_lengths),
            cache_length=cache_length,
            quantization_recipe="none",
            bundle_litert_lm=bundle,
        )
    except ExportError:
        raise
    except Exception as exc:
        raise _conversion_error(exc, f"{checkpoint.source} (model_type {checkpoint.model_type})") from exc
    pattern = "model.litertlm" if bundle else os.path.join("*", "model.tflite")
    found = glob.glob(os.path.join(out_dir, pattern))
    if len(found) != 1:
        raise ExportError(CONVERSION_FAILED, f"litert-torch export_hf wrote {found or 'nothing'} under {out_dir}")
    if bundle or recipe is None:
        os.replace(found[0], output_path)
    else:
        quantize_tflite(found[0], output_path, quantization, block_size)


def int64_notes(sample_args: tuple, outputs) -> list[str]:
    """Notices for int64 inputs/outputs, which LiteRT runs as int32 (litert-torch's default enable_x64=False)."""
    notes = [
        f"input {i} is int64 in PyTorch; the LiteRT file takes and computes it as int32 (values outside "
        "[-2^31, 2^31) wrap): feed int32"
        for i, arg in enumerate(sample_args)
        if isinstance(arg, torch.Tensor) and arg.dtype == torch.int64
    ]
    flat, _ = tree_flatten(outputs)
    notes += [
        f"output {i} is int64 in PyTorch; LiteRT returns it as int32"
        for i, out in enumerate(flat)
        if isinstance(out, torch.Tensor) and out.dtype == torch.int64
    ]
    return notes


def export_plain_module(
    module: torch.nn.Module,
    sample_args: tuple,
    output_path: str,
    workdir: str,
    *,
    quantization: str,
    dynamic_shapes=None,
    name: str = "module",
    block_size: int = 32,
) -> None:
    """Convert ``module`` with ``litert_torch.convert`` to a one-signature ``.tflite``, then quantize it.

    Args:
        sample_args: positional sample tensors; their shapes and dtypes are frozen into the file (except dims in
            ``dynamic_shapes``, in ``torch.export`` form).
    Raises:
        ExportError: a known conversion failure kind (naming the op and submodule), or CONVERSION_FAILED.
    """
    recipe = recipe_name(quantization)
    import litert_torch

    float_path = output_path if recipe is None else os.path.join(workdir, "float.tflite")
    try:
        edge_model = litert_torch.convert(module.eval(), sample_args, dynamic_shapes=dynamic_shapes)
        edge_model.export(float_path)
    except ExportError:
        raise
    except Exception as exc:
        raise _conversion_error(exc, name, module, sample_args) from exc
    if recipe is not None:
        quantize_tflite(float_path, output_path, quantization, block_size)


@contextlib.contextmanager
def quiet_stdout(enabled: bool):
    """Silence chatty library output (progress trees, absl logs on stdout) when ``enabled``."""
    if not enabled:
        yield
        return
    saved = sys.stdout
    sys.stdout = io.StringIO()
    try:
        yield
    finally:
        sys.stdout = saved
