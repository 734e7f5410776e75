"""Post-training quantization of a ``.tflite`` file through ai-edge-quantizer's stock recipes.

| ``--quantize``  | ai_edge_quantizer.recipe      | weights            | activations at run time        |
|-----------------|-------------------------------|--------------------|--------------------------------|
| ``none``        | -                             | float32            | float32                        |
| ``dynamic-int8``| ``dynamic_wi8_afp32``         | int8, per channel  | quantized to int8 on the fly   |
| ``weight-int8`` | ``weight_only_wi8_afp32``     | int8, per channel  | float32 (weights dequantized)  |
| ``dynamic-int4``| ``dynamic_wi4_afp32``         | int4, per channel  | quantized to int8 on the fly   |
"""

from __future__ import annotations

import os

from edge_export.errors import BAD_QUANTIZATION, ExportError

RECIPES = {
    "none": None,
    "dynamic-int8": "dynamic_wi8_afp32",
    "weight-int8": "weight_only_wi8_afp32",
    "dynamic-int4": "dynamic_wi4_afp32",
}


def recipe_name(quantization: str) -> str | None:
    """The ai-edge-quantizer recipe for a ``--quantize`` name; raises ``ExportError(BAD_QUANTIZATION)``."""
    if quantization not in RECIPES:
        raise ExportError(
            BAD_QUANTIZATION,
            f"unknown quantization '{quantization}'; use one of: {', '.join(RECIPES)}",
        )
    return RECIPES[quantization]


def quantize_tflite(src: str, dst: str, quantization: str) -> None:
    """Quantize the model at ``src`` with the recipe for ``quantization`` and write it to ``dst``.

    Raises:
        ExportError(BAD_QUANTIZATION): unknown name. ``quantization='none'`` is not accepted here (nothing to do).
    """
    name = recipe_name(quantization)
    if name is None:
        raise ValueError("quantize_tflite called with quantization='none'")
    from ai_edge_quantizer import quantizer, recipe

    qt = quantizer.Quantizer(src)
    qt.load_quantization_recipe(getattr(recipe, name)())
    qt.quantize().export_model(dst, overwrite=True)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(dst, 0o666 & ~umask)  # the quantizer writes the file executable
