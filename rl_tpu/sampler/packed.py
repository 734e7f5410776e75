"""Decode-time linear layers on pre-packed weights (CPU, oneDNN).

At decode time the sampler multiplies a few rows (the batch, one token each) by every weight matrix of the model:
for SmolLM2-135M at batch 16 that is ``(16, 576) x (576, 1536)``-sized products and a ``(16, 576) x (576, 49152)``
LM head: every weight is read for only 16 rows, so the time goes to streaming it and to float32 multiply-adds in
about equal parts (a profile of the sampler shows ~38 GFLOP/s on one core). ``torch.nn.functional.linear``
on CPU hands them to MKL's general ``sgemm``, which reads the row-major weight as it is. oneDNN's inner-product
primitive can run on a copy of the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what TorchInductor's CPU weight prepacking uses); on this project's
2-core AMD EPYC that is about 1.2x faster for the layers and 1.45x for the LM head (``benchmarks/bench_sampler.py``
shows the end-to-end effect).

The result is float32 as before, summed in a different order: it differs from ``F.linear`` by float32 rounding
(relative ~1e-6), far below anything a sampled token or its log-prob reflects.

The packed copies cost the weights' size again while they exist. :class:`PackedLinears` builds them on first use,
and they are dropped with :meth:`PackedLinears.release` (the rollout server does so whenever weights change or it
sleeps) and rebuilt at the next generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PackedLinears", "packed_linear_supported"]


def packed_linear_supported() -> bool:
    """Whether this torch build has oneDNN's packed linear (CPU builds with mkldnn)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:  # (..., in_features) -> (..., out_features), float32
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return forward


class PackedLinears:
    """oneDNN-packed copies of a CPU float32 model's ``nn.Linear`` weights, swapped in during a ``with`` block.

    Args:
        model: the model whose ``torch.nn.Linear`` modules (float32, on the CPU) to pack; others are left alone.
        batch_hint: the row count the packing is tuned for (the decode batch); other row counts give the same result.

    """

    def __init__(self, model: torch.nn.Module, batch_hint: int = 16) -> None:
        self.model = model
        self.modules: list[torch.nn.Linear] = self._eligible()
        self.batch_hint = max(1, int(batch_hint))
        self._packed: list[torch.Tensor] | None = None
        self._key: tuple | None = None

    def _eligible(self) -> list[torch.nn.Linear]:
        # looked up again at each pack: the model may have been cast (bfloat16 has no packed path here) or moved
        return [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)
                and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies hold now (0 when released)."""
        return sum(m.weight.numel() * m.weight.element_size() for m in self.modules) if self._packed is not None else 0

    def _weights_key(self) -> tuple:
        # a copy_ in this process bumps _version; the data_ptr catches a rebind (param.data = ...)
        return tuple((m.weight.data_ptr(), m.weight._version) for m in self.modules)

    def pack(self) -> None:
        """Build the packed copies now (each ``with`` block does it when they are missing or stale)."""
        self.modules = self._eligible()
        with torch.inference_mode(False), torch.no_grad():
            self._packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), self.batch_hint)
                            for m in self.modules]
        self._key = self._weights_key()

    def release(self) -> None:
        """Drop the packed copies (weights changed elsewhere, or memory is needed); the next use packs again."""
        self._packed, self._key = None, None

    @contextmanager
    def applied(self) -> Iterator[bool]:
        """Run every packed module on its packed weight within the block; yields whether any was packed.

        The modules' own ``forward`` is restored on exit, so a model shared with other code (e.g. a trainer) only
        runs packed inside the block. Packs first when the copies are missing or a weight changed in this process
        (its version counter or storage moved); a weight written by *another* process through shared memory needs
        :meth:`release`.
        """
        if self._packed is None or self._key != self._weights_key() or self.modules != self._eligible():
            self.pack()
        if not self.modules:
            yield False
            return
        for m, w in zip(self.modules, self._packed):
            m.forward = _packed_forward(w, m.bias)
        try:
            yield True
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)
