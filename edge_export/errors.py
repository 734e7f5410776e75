"""One exception class for everything a user can fix, and the translation of converter failures into it.

litert-torch reports the failures LiteRT users meet most often as deep stack traces whose last line rarely says
what to change. ``explain_conversion_failure`` maps each known kind onto one sentence that names the cause, where
it is, and the fix. The CLI prints ``ExportError`` as one line and exits non-zero; anything else is a bug in this
package or in a library and keeps its stack trace.
"""

from __future__ import annotations

import re

import torch

# kinds, so tests and callers can branch without matching prose
BAD_SOURCE = "bad-source"
BAD_INPUT_SPEC = "bad-input-spec"
BAD_QUANTIZATION = "bad-quantization"
BAD_CHECKPOINT = "bad-checkpoint"
DYNAMIC_DIM = "dynamic-dim"
NO_LOWERING = "no-lowering"
DATA_DEPENDENT_SHAPE = "data-dependent-shape"
MISSING_RUNTIME_OP = "missing-runtime-op"
VERIFICATION_FAILED = "verification-failed"
BAD_FILE = "bad-file"
UNSUPPORTED_LIBRARY = "unsupported-library"  # a library outside the range edge_export's patches were tested with


class ExportError(Exception):
    """A failure the user can act on; ``str(err)`` is one line naming the cause and the fix.

    Attributes:
        kind: one of the module-level kind constants (``NO_LOWERING``, ``DYNAMIC_DIM``, ...).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(" ".join(message.split()))  # always one line
        self.kind = kind


# A dynamic dimension reaches the JAX lowering as int64 min, e.g. "float32[-9223372036854775808,4]".
_DYNAMIC_DIM_RE = re.compile(r"-9223372036854775808")
_NO_LOWERING_RE = re.compile(r"Lowering not found:\s*(aten\.[\w.]+|[\w.]+)")
_RUNTIME_OP_RES = (
    re.compile(r"unresolved custom op:\s*(\w[\w\-]*(?:\.\w[\w\-]*)*)", re.IGNORECASE),
    re.compile(r"Didn't find op for builtin opcode '([\w.\-]+)' version '(\d+)'"),
    re.compile(r"Op type not registered '([\w.\-]+)'"),
)
_SOURCE_LINE_RE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def _user_frame(text: str) -> str:
    """The last ``file:line in fn`` of the "Original traceback" section torch.fx adds to a failure message."""
    frames = _SOURCE_LINE_RE.findall(text)
    frames = [f for f in frames if "/torch/" not in f[0]] or frames
    if not frames:
        return ""
    file, line, fn = frames[-1]
    return f" ({file}:{line} in {fn})"


def _module_of_op(module: torch.nn.Module | None, sample_args: tuple | None, op: str) -> str:
    """Name the submodule whose ``forward`` emits ``op``, from torch.export's ``nn_module_stack`` metadata."""
    if module is None or sample_args is None:
        return ""
    try:
        program = torch.export.export(module, sample_args, strict=False)
        program = program.run_decompositions()
    except Exception:  # naming the module is a courtesy; the op name alone is still actionable
        return ""
    target = op.removeprefix("aten.")
    for node in program.graph.nodes:
        if node.op != "call_function" or target.split(".")[0] not in str(node.target):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return f" in {type(module).__name__}.forward"
        path, cls = list(stack.values())[-1]
        cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        cls_name = cls_name.rsplit(".", 1)[-1]
        return f" in module '{path or '<root>'}' ({cls_name})"
    return ""


def explain_conversion_failure(
    exc: BaseException, module: torch.nn.Module | None = None, sample_args: tuple | None = None
) -> ExportError | None:
    """Map a litert-torch conversion failure onto an ``ExportError``, or None when the kind is not known.

    Args:
        exc: the exception raised by ``litert_torch.convert`` or the generative export.
        module: the module being converted, used to name the submodule an unsupported op came from.
        sample_args: the sample inputs it was converted with.
    """
    text = f"{type(exc).__name__}: {exc}"
    found = _NO_LOWERING_RE.search(text)
    if found:
        op = found.group(1).removesuffix(".default")
        where = _module_of_op(module, sample_args, op) or _user_frame(text)
        return ExportError(
            NO_LOWERING,
            f"operator {op}{where} has no LiteRT lowering in litert-torch; replace it with supported ops (for "
            f"random sampling, pass the noise in as an input) or leave it out of the exported forward()",
        )
    if (
        type(exc).__name__ == "NonConcreteBooleanIndexError"
        or "GuardOnDataDependentSymNode" in text
        or ("data-dependent" in text.lower())
    ):
        return ExportError(
            DATA_DEPENDENT_SHAPE,
            f"an output shape depends on tensor values (boolean masking such as x[x > 0], nonzero, unique)"
            f"{_user_frame(text)}; LiteRT needs static shapes: use torch.where(mask, x, 0) or a fixed-size top-k",
        )
    if _DYNAMIC_DIM_RE.search(text):
        return ExportError(
            DYNAMIC_DIM,
            f"a dynamic dimension (torch.export.Dim) could not be lowered by litert-torch{_user_frame(text)}; "
            "export with static shapes (drop 'name=' from --input), one file per shape you need, or for causal "
            "LMs use --prefill-lengths buckets",
        )
    return None


def explain_runtime_failure(exc: BaseException, path: str) -> ExportError | None:
    """Map a LiteRT interpreter load/run failure onto ``MISSING_RUNTIME_OP``, naming the opcode."""
    text = str(exc)
    for pattern in _RUNTIME_OP_RES:
        found = pattern.search(text)
        if found:
            version = f" version {found.group(2)}" if found.lastindex and found.lastindex >= 2 else ""
            return ExportError(
                MISSING_RUNTIME_OP,
                f"the LiteRT runtime (ai-edge-litert) has no kernel for opcode '{found.group(1)}'{version} used "
                f"in {path}; rewrite the op in PyTorch with supported ops, or link a runtime with that op "
                "(e.g. a custom-op resolver) on the device",
            )
    return None
