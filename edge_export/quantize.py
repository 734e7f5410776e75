"""Post-training quantization of a ``.tflite`` file through ai-edge-quantizer's stock recipes.

| ``--quantize``  | ai_edge_quantizer.recipe      | weights            | activations at run time        |
|-----------------|-------------------------------|--------------------|--------------------------------|
| ``none``        | -                             | float32            | float32                        |
| ``dynamic-int8``| ``dynamic_wi8_afp32``         | int8, per channel  | quantized to int8 on the fly   |
| ``weight-int8`` | ``weight_only_wi8_afp32``     | int8, per channel  | float32 (weights dequantized)  |
| ``dynamic-int4``| ``dynamic_wi4_afp32``         | int4, per channel  | quantized to int8 on the fly   |
| ``dynamic-int4-block`` | ``dynamic_wi4b<N>_afp32`` | int4, per block of N (``--block-size``, 32) | as above |

Channelwise int4 collapses small LMs (litert-torch#1068: one scale per output row of a 576-wide matrix);
``dynamic-int4-block`` gives every ``block_size`` consecutive input weights their own scale (N = 32, 64, 128 or 256,
ai-edge-quantizer's ``QuantGranularity.BLOCKWISE_<N>``; the input width must be a multiple of N).
"""

from __future__ import annotations

import os

from edge_export.errors import BAD_QUANTIZATION, ExportError

RECIPES = {
    "none": None,
    "dynamic-int8": "dynamic_wi8_afp32",
    "weight-int8": "weight_only_wi8_afp32",
    "dynamic-int4": "dynamic_wi4_afp32",
    "dynamic-int4-block": "dynamic_wi4b<N>_afp32",
}
BLOCK_SIZES = (32, 64, 128, 256)


def recipe_name(quantization: str) -> str | None:
    """The ai-edge-quantizer recipe for a ``--quantize`` name; raises ``ExportError(BAD_QUANTIZATION)``."""
    if quantization not in RECIPES:
        raise ExportError(
            BAD_QUANTIZATION,
            f"unknown quantization '{quantization}'; use one of: {', '.join(RECIPES)}",
        )
    return RECIPES[quantization]


def check_block_size(block_size: int) -> int:
    """``block_size`` if ai-edge-quantizer has a blockwise granularity for it; else ``ExportError(BAD_QUANTIZATION)``."""
    if block_size not in BLOCK_SIZES:
        raise ExportError(
            BAD_QUANTIZATION,
            f"--block-size {block_size} is not offered by ai-edge-quantizer; use one of "
            f"{', '.join(map(str, BLOCK_SIZES))} (32 keeps small models best)",
        )
    return block_size


def _recipe(quantization: str, block_size: int):
    from ai_edge_quantizer import qtyping, recipe, recipe_manager

    if quantization != "dynamic-int4-block":
        return getattr(recipe, RECIPES[quantization])()
    manager = recipe_manager.RecipeManager()
    manager.add_dynamic_config(
        regex=".*", operation_name=qtyping.TFLOperationName.ALL_SUPPORTED, num_bits=4,
        granularity=qtyping.QuantGranularity[f"BLOCKWISE_{check_block_size(block_size)}"],
    )
    return manager.get_quantization_recipe()


def quantize_tflite(src: str, dst: str, quantization: str, block_size: int = 32) -> None:
    """Quantize the model at ``src`` with the recipe for ``quantization`` and write it to ``dst``.

    Args:
        block_size: input weights per int4 scale for ``dynamic-int4-block`` (32, 64, 128 or 256).
    Raises:
        ExportError(BAD_QUANTIZATION): unknown name or block size. ``quantization='none'`` is not accepted here.
    """
    name = recipe_name(quantization)
    if name is None:
        raise ValueError("quantize_tflite called with quantization='none'")
    from ai_edge_quantizer import quantizer

    qt = quantizer.Quantizer(src)
    qt.load_quantization_recipe(_recipe(quantization, block_size))
    qt.quantize().export_model(dst, overwrite=True)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(dst, 0o666 & ~umask)  # the quantizer writes the file executable
