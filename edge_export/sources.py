"""What to export: an HF causal-LM folder or an ``nn.Module`` factory, and the sample inputs for the latter.

SOURCE forms accepted by ``litert export``:
- a directory with ``config.json`` of a causal LM, ``*.safetensors`` (or ``pytorch_model*.bin``) weights and
  tokenizer files: what ``save_pretrained`` / ``verl train`` writes;
- ``package.module:factory``: an importable callable returning an ``nn.Module`` (a module class works too).

Input specs (``--input``) for modules: ``SHAPE:DTYPE`` with SHAPE as ``x``-separated sizes, e.g.
``1x3x224x224:float32``. A size written ``name=N`` asks for a dynamic dimension (``torch.export.Dim(name)``)
with sample size N, e.g. ``batch=2x16:float32``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import torch

from edge_export.errors import BAD_CHECKPOINT, BAD_INPUT_SPEC, BAD_SOURCE, ExportError

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_FLOAT_SAFETENSORS = {"F32", "F16", "BF16", "F64"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One positional input of a module: static shape, dtype, and the dims marked dynamic (index -> name)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dynamic: dict[int, str]

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        """A sample tensor: N(0, 1) for floats, integers in [0, 16) for ints, coin flips for bool."""
        if self.dtype.is_floating_point:
            return torch.randn(self.shape, generator=generator).to(self.dtype)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, self.shape, generator=generator).bool()
        return torch.randint(0, 16, self.shape, generator=generator).to(self.dtype)


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``1x3x224x224:float32`` / ``batch=2x16:float32``; raises ``ExportError(BAD_INPUT_SPEC)``."""
    shape_text, sep, dtype_text = text.rpartition(":")
    if not sep or dtype_text not in DTYPES or not shape_text:
        raise ExportError(
            BAD_INPUT_SPEC,
            f"--input '{text}' is not SHAPE:DTYPE; write e.g. 1x3x224x224:float32 (dtypes: {', '.join(DTYPES)})",
        )
    shape, dynamic = [], {}
    for index, size in enumerate(shape_text.split("x")):
        name, eq, value = size.rpartition("=")
        if not value.isdigit() or int(value) < 1 or (eq and not name.isidentifier()):
            raise ExportError(
                BAD_INPUT_SPEC,
                f"--input '{text}': size '{size}' is not a positive integer (or name=N for a dynamic dimension)",
            )
        shape.append(int(value))
        if eq:
            dynamic[index] = name
    return InputSpec(tuple(shape), DTYPES[dtype_text], dynamic)


def dynamic_shapes_for(specs: list[InputSpec]) -> tuple | None:
    """``torch.export`` dynamic_shapes for the specs, sharing one ``Dim`` per name; None when all static."""
    if not any(spec.dynamic for spec in specs):
        return None
    dims: dict[str, torch.export.Dim] = {}
    return tuple(
        {i: dims.setdefault(name, torch.export.Dim(name)) for i, name in spec.dynamic.items()} or None for spec in specs
    )


def is_checkpoint_dir(source: str) -> bool:
    return os.path.isdir(source) and os.path.isfile(os.path.join(source, "config.json"))


def load_factory(source: str) -> torch.nn.Module:
    """Import ``package.module:factory`` and call it; raises ``ExportError(BAD_SOURCE)`` naming what failed."""
    usage = (
        "give a model folder (config.json + weights + tokenizer) or an importable factory "
        "'package.module:factory' returning an nn.Module"
    )
    if os.path.isdir(source):
        raise ExportError(BAD_SOURCE, f"SOURCE '{source}' is a folder without config.json; {usage}")
    if not _FACTORY_RE.match(source):
        raise ExportError(
            BAD_SOURCE, f"SOURCE '{source}' is neither a model folder nor 'package.module:factory'; {usage}"
        )
    module_name, attr = source.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: factories in the current folder are importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ExportError(BAD_SOURCE, f"SOURCE '{source}': cannot import '{module_name}' ({exc}); {usage}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ExportError(BAD_SOURCE, f"SOURCE '{source}': '{module_name}' has no callable '{attr}'; {usage}")
    try:
        required = [
            p.name
            for p in inspect.signature(factory).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
    except (TypeError, ValueError):  # no introspectable signature (some builtins): just call it
        required = []
    if required:
        raise ExportError(
            BAD_SOURCE,
            f"SOURCE '{source}': {attr}() needs arguments ({', '.join(required)}) but is called with none; point "
            f"SOURCE at a function of no arguments that builds the module, e.g. in mymodels.py "
            f"'def make(): return {module_name}.{attr}(...)', then SOURCE=mymodels:make",
        )
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ExportError(
            BAD_SOURCE, f"SOURCE '{source}': {attr}() returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def run_on_sample(module: torch.nn.Module, sample_args: tuple, source: str):
    """``module(*sample_args)`` in eval mode without grad; raises ``ExportError(BAD_INPUT_SPEC)`` when it fails.

    A forward that rejects the ``--input`` tensors (wrong shape, dtype or count) would otherwise fail deep inside
    torch.export with a stack trace; run it once first and name the inputs and the fix.
    """
    try:
        with torch.no_grad():
            return module.eval()(*sample_args)
    except Exception as exc:
        given = " ".join(
            f"--input {'x'.join(map(str, t.shape))}:{str(t.dtype).removeprefix('torch.')}" for t in sample_args
        )
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ExportError(
            BAD_INPUT_SPEC,
            f"SOURCE '{source}' ({type(module).__name__}) fails on the sample inputs {given}: "
            f"{type(exc).__name__}: {first}; give one --input per forward() argument with the shape and dtype it "
            "accepts (--debug shows the stack trace)",
        ) from exc


def _safetensors_dtypes(path: Path) -> set[str]:
    """Tensor dtypes listed in a safetensors header (8-byte little-endian length, then JSON), without loading."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@dataclasses.dataclass
class Checkpoint:
    """A checked causal-LM folder; ``path`` may be a staged copy with a cleaned config (see ``notes``)."""

    path: str
    source: str
    model_type: str
    notes: list[str]


def inspect_checkpoint(source: str, staging_dir: str) -> Checkpoint:
    """Check that ``source`` is an exportable HF causal-LM folder, staging a cleaned copy when needed.

    A folder saved from a GGUF-loaded model without removing ``quantization_config`` holds dequantized float
    weights but still declares ``quant_method: gguf``, which litert-torch refuses ("Quantized checkpoint is not
    supported"). When every weight is a float tensor, a copy is staged in ``staging_dir`` (weights hard-linked or
    copied, config without ``quantization_config``) and exported instead; truly quantized weights are refused.

    Raises:
        ExportError(BAD_CHECKPOINT): no weights, no tokenizer, not a causal LM, or quantized weights.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(source)
    with open(root / "config.json") as f:
        config = json.load(f)
    model_type = config.get("model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ExportError(
            BAD_CHECKPOINT,
            f"{root / 'config.json'}: model_type '{model_type}' is not a transformers causal LM; export a "
            "*ForCausalLM checkpoint, or a plain nn.Module with SOURCE=package.module:factory and --input",
        )
    weights = sorted(root.glob("*.safetensors"))
    if not weights and not list(root.glob("pytorch_model*.bin")):
        raise ExportError(
            BAD_CHECKPOINT, f"{root}: no *.safetensors or pytorch_model*.bin weights; save with model.save_pretrained()"
        )
    if not any((root / name).exists() for name in _TOKENIZER_FILES):
        raise ExportError(
            BAD_CHECKPOINT,
            f"{root}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}); the bundle and the verification prompt "
            "need one: tokenizer.save_pretrained(folder)",
        )
    notes: list[str] = []
    path = str(root)
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        dtypes = set().union(*(_safetensors_dtypes(w) for w in weights)) if weights else {"?"}
        if not dtypes <= _FLOAT_SAFETENSORS:
            raise ExportError(
                BAD_CHECKPOINT,
                f"{root / 'config.json'}: quantization_config (quant_method={method}) with non-float weights "
                f"({', '.join(sorted(dtypes))}); dequantize and save float weights, then use --quantize",
            )
        del config["quantization_config"]
        path = _stage(root, staging_dir, config)
        notes.append(
            f"ignored quantization_config (quant_method={method}) in config.json: the weights are already float "
            f"({', '.join(sorted(dtypes))})"
        )
    try:
        loaded = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ExportError(BAD_CHECKPOINT, f"{root / 'config.json'} does not load with transformers: {exc}") from exc
    if _routes_through_experts_kernels(loaded) and config.get("experts_implementation") != EXPORT_EXPERTS:
        config["experts_implementation"] = EXPORT_EXPERTS
        path = _stage(root, staging_dir, config)
        notes.append(
            f"mixture of experts: exported with transformers' {EXPORT_EXPERTS} experts forward (its default "
            "counts tokens per expert with aten.histc, which has no LiteRT lowering); the same experts, "
            "weights and routing"
        )
    return Checkpoint(path=path, source=str(root), model_type=model_type, notes=notes)


EXPORT_EXPERTS = "batched_mm"  # transformers' experts forward with static shapes: gathers each token's experts


def _routes_through_experts_kernels(config) -> bool:
    """Whether the model's experts dispatch through transformers' experts interface (``use_experts_implementation``;
    Qwen3-MoE, Mixtral, ... in transformers 5), decided from the model built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, ImportError, RuntimeError, AttributeError, KeyError):  # the export says why
        return False
    return any(hasattr(m, "is_concatenated") and hasattr(m, "has_gate") for m in model.modules())


def _stage(root: Path, staging_dir: str, config: dict) -> str:
    """A copy of ``root`` in ``staging_dir`` with ``config`` as its config.json (files hard-linked where the file
    system allows, else copied; the source folder is only read). Returns the staged folder."""
    os.makedirs(staging_dir, exist_ok=True)
    for item in root.iterdir():
        target = os.path.join(staging_dir, item.name)
        if item.is_file() and item.name != "config.json" and not os.path.exists(target):
            try:
                os.link(item, target)
            except OSError:
                shutil.copy2(item, staging_dir)
    with open(os.path.join(staging_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return staging_dir
