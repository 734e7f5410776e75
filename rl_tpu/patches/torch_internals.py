"""The private torch names the sampler and the op counters use, in one place, with the torch versions they were
checked with (:data:`RECORDS`).

- oneDNN's packed linear (:data:`MKLDNN_LINEAR`): ``torch.ops.mkldnn._reorder_linear_weight`` packs a weight in
  oneDNN's blocked layout once, ``torch.ops.mkldnn._linear_pointwise`` multiplies by it (what TorchInductor's CPU
  weight prepacking emits); torch has no public op for either. The sampler's packed linear layers use them where its
  own AVX-512 kernel cannot run (:mod:`rl_tpu.sampler.panel_kernel`).
- ``torch.utils._python_dispatch._disable_current_modes`` (:data:`DISPATCH_MODES`): the op counters
  (:mod:`rl_tpu.sampler.opcount`, :mod:`rl_tpu.train_opcount`) count one launch per compiled graph and run the graph
  outside their own dispatch mode; torch has no public way to leave the modes in force.

Every accessor checks torch's version first (:meth:`~rl_tpu.patches.record.Patch.check`): outside the range it
raises :class:`~rl_tpu.patches.record.UnsupportedVersionError` with one line.
"""

from __future__ import annotations

import contextlib

import torch

from rl_tpu.patches.record import Patch, names_check, searched

VERSIONS = ">=2.13,<2.14"  # the torch versions these names were checked with (pyproject pins torch==2.13.0)

MKLDNN_LINEAR = Patch(
    target="torch.ops.mkldnn._reorder_linear_weight + _linear_pointwise", module="torch", library="torch",
    versions=VERSIONS,
    why="oneDNN's packed linear (the sampler's fallback where its AVX-512 kernel cannot run) has no public op",
    upstream="https://github.com/pytorch/pytorch/pull/139387 (proposed a public pack_linear_weight; closed)",
    apply=None, applied=names_check("ops.mkldnn._reorder_linear_weight", "ops.mkldnn._linear_pointwise"))

DISPATCH_MODES = Patch(
    target="torch.utils._python_dispatch._disable_current_modes", module="torch.utils._python_dispatch",
    library="torch", versions=VERSIONS,
    why="the op counters run a compiled graph outside their own TorchDispatchMode; torch has no public call for it",
    upstream=searched("pytorch/pytorch", "public API disable current TorchDispatchMode _disable_current_modes"),
    apply=None, applied=names_check("_disable_current_modes"))

RECORDS: tuple[Patch, ...] = (MKLDNN_LINEAR, DISPATCH_MODES)


def packed_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (a CPU build with mkldnn, the two ops present)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and MKLDNN_LINEAR.applied(torch)
    except (AttributeError, RuntimeError):
        return False


def reorder_linear_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight`` ``(out, in)`` float32 packed in oneDNN's layout for ``batch_hint`` rows
    (``torch.ops.mkldnn._reorder_linear_weight``)."""
    MKLDNN_LINEAR.check()
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``packed = reorder_linear_weight(weight, ...)``
    (``torch.ops.mkldnn._linear_pointwise`` with no fused activation). The packing checked torch's version."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def disable_current_modes() -> contextlib.AbstractContextManager:
    """A context in which no ``TorchDispatchMode`` is in force (``_disable_current_modes``)."""
    DISPATCH_MODES.check()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
