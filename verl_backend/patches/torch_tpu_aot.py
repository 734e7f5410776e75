"""TorchTPU 0.2.0's private names that ahead-of-time lowering uses, in one place, with the one patch it needs.

``verl train --aot-only`` (:mod:`verl_backend.driver.aot`) lowers the TPU job's graphs to StableHLO with TorchTPU's
own ATen kernels on a machine without a chip. TorchTPU's ``fx_to_mlir`` does that and then two things that need a
chip: it looks up the TPU default RNG generator (``torch.tpu.default_generators``) and it compiles the module through
PJRT (``traverse_and_compile``). :data:`PATCH` replaces ``fx_to_mlir`` (both bindings,
``torch_tpu._internal.export.export.fx_to_mlir`` and ``torch_tpu._internal.export.fx_to_mlir``) with
:func:`lower_fx_to_mlir`, which keeps the rest: the graph runs through TorchTPU's ``EagerLikeFxInterpreter`` under
``EagerMode._INTERNAL_COMPILE_FX_GRAPH`` on metadata-only TPU placeholders, so TorchTPU's kernels record StableHLO,
then ``build_mlir`` builds the module. No RNG: a graph with a random op is refused (it needs the TPU generator).

Private names read here, checked with torch-tpu ==0.2.0 only (:data:`VERSIONS`):

- ``torch_tpu._loader._init_device("tpu")``: registers the ``tpu`` device with PJRT initialisation deferred;
- ``torch_tpu._internal.export.export.EagerLikeFxInterpreter`` and ``fx_to_mlir``;
- ``torch_tpu._internal.execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH`` and ``set_eager_mode``;
- ``torch_tpu._internal.compile.tpu_torch_compile``: ``placeholder``, ``build_mlir``, ``serialize_mlir_text``;
- ``torch_tpu._internal.compile._backend._TPU_DECOMPOSITIONS``: the decompositions ``TpuBackend`` gives
  aot_autograd.

This module imports torch_tpu: import it only in the lowering subprocess (``python -m
verl_backend.driver.aot.lower``), never in the driver or a worker (an eager TPU op outside compile mode aborts the
process).
"""

from __future__ import annotations

import sys
from types import ModuleType

from verl_backend.patches.record import Patch, attribute_check, check_versions, mark, searched

VERSIONS = "==0.2.0"
TARGET = "torch_tpu._internal.export.export.fx_to_mlir"


class LoweringError(RuntimeError):
    """An FX graph TorchTPU could not lower; ``op`` names the ATen op, when one is known."""

    def __init__(self, message: str, op: str | None = None, module: str | None = None):
        super().__init__(message)
        self.op = op
        self.module = module


def init_device() -> None:
    """Register TorchTPU's ``tpu`` device without a chip (PJRT initialisation deferred); idempotent."""
    from torch_tpu import _loader

    _loader._init_device("tpu")


def decompositions() -> dict:
    """The decomposition table TorchTPU's ``TpuBackend`` hands aot_autograd (``masked_fill`` in 0.2.0)."""
    from torch_tpu._internal.compile import _backend

    return dict(_backend._TPU_DECOMPOSITIONS)


def placeholder(shape, dtype):
    """A metadata-only TPU tensor of ``shape`` and ``dtype`` (no storage; an input of the lowered graph)."""
    from torch_tpu._internal.compile import tpu_torch_compile

    return tpu_torch_compile.placeholder(list(shape), dtype, False)


def lower_fx_to_mlir(module, args, build_mlir_module: bool = True, **_ignored) -> str:
    """Lower ``module`` (a ``torch.fx.GraphModule``) to StableHLO text, as TorchTPU would before compiling it.

    Args:
        module: the graph; ``device=`` keyword arguments in it must already name the ``tpu`` device.
        args: its inputs, TPU placeholders (:func:`placeholder`) or Python scalars, in placeholder order.
    Returns:
        the module's MLIR text (``func.func @main`` with one argument per tensor input, in order).
    Raises:
        LoweringError: an op has no TorchTPU lowering, or the graph draws random numbers (``op`` names the node's
            target when the failure is inside one node).
    """
    import torch
    from torch.utils import _pytree as pytree
    from torch_tpu._internal import execution_mode
    from torch_tpu._internal.compile import tpu_torch_compile
    from torch_tpu._internal.export import export

    failed: dict = {}

    class Interpreter(export.EagerLikeFxInterpreter):
        def run_node(self, node):
            try:
                return super().run_node(node)
            except Exception:
                failed.setdefault("node", node)
                raise

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    try:
        with execution_mode.set_eager_mode(execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH):
            cloned = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # in-place ops keep inputs
            outs = Interpreter(module).run(*cloned)
            results, seen = [], set()
            for t in pytree.tree_leaves(outs):
                if not isinstance(t, torch.Tensor):
                    continue
                if t.data_ptr() in seen:  # each @main result needs its own value
                    t = t.clone()
                seen.add(t.data_ptr())
                results.append(t)
            built = tpu_torch_compile.build_mlir(
                result_tensors=results, argument_tensors=tensors, use_stablehlo_bounds=False
            )
        return tpu_torch_compile.serialize_mlir_text(built, enable_debug_info=False)
    except LoweringError:
        raise
    except Exception as exc:
        node = failed.get("node")
        op = str(node.target) if node is not None and node.op == "call_function" else None
        stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
        owner = next(reversed(stack.values()), None) if stack else None  # (qualified name, class) of the innermost
        module = f"{owner[0]} ({getattr(owner[1], '__name__', owner[1])})" if owner else None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise LoweringError(first, op=op, module=module) from None


def _apply(module: ModuleType) -> None:
    replacement = mark(lower_fx_to_mlir, TARGET)
    module.fx_to_mlir = replacement
    package = sys.modules.get("torch_tpu._internal.export")
    if package is not None:
        package.fx_to_mlir = replacement


PATCH = Patch(
    target=TARGET,
    module="torch_tpu._internal.export.export",
    library="torch-tpu",
    versions=VERSIONS,
    why="fx_to_mlir needs a chip for the TPU RNG generator and the PJRT compile; lowering alone does not",
    upstream=searched(
        "GitHub",
        "torch_tpu fx_to_mlir lowering without TPU chip ahead-of-time StableHLO",
        "no torch-tpu issue tracker found",
    ),
    apply=_apply,
    applied=attribute_check("fx_to_mlir", TARGET),
)
PATCHES = (PATCH,)


def apply() -> None:
    """Refuse torch-tpu outside :data:`VERSIONS` (one line), register the device, apply :data:`PATCH`."""
    check_versions(PATCHES)
    init_device()
    import torch_tpu._internal.export.export as export

    PATCH.apply(export)
