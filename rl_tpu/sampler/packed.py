"""Decode-time linear layers on pre-packed weights (CPU).

At decode time the sampler multiplies a few rows (the batch, one token each) by every weight matrix of the model:
for SmolLM2-135M at batch 16 that is ``(16, 576) x (576, 1536)``-sized products and a ``(16, 576) x (576, 49152)``
LM head: every weight is read for only 16 rows, so the time goes to streaming it and to float32 multiply-adds in
about equal parts. ``torch.nn.functional.linear`` on CPU hands them to MKL's general ``sgemm``, which reads the
row-major weight as it is. :class:`PackedLinears` keeps a copy of each weight packed once for
:mod:`rl_tpu.sampler.panel_kernel`: rl-tpu's AVX-512 panel kernel, which streams each weight from memory while it
multiplies it (1.35-1.6x oneDNN's packed inner product over SmolLM2's 211 layers at 16 rows, one thread,
``benchmarks/bench_decode_linears.py``), or, where that kernel cannot run, oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what TorchInductor's CPU weight prepacking uses; ~1.2x MKL for the
layers and 1.45x for the LM head on this project's 2-core AMD EPYC).

The result is float32 as before, summed in a different order: it differs from ``F.linear`` by float32 rounding
(relative ~1e-6), far below anything a sampled token or its log-prob reflects.

Linear layers that read the same input (a layer's query, key and value projections) can also be packed as one
concatenated matrix (:meth:`PackedLinears.fused`): one product of width ``q + k + v`` instead of three narrow ones
(measured on oneDNN: ~10% less query/key/value time in a cold-cache measurement of SmolLM2-135M's 30 layers); the
gate and up projections of the MLP, already wide, gained nothing, so the lean decoder fuses only the former.

The packed copies cost the weights' size again while they exist (fused groups once more). :class:`PackedLinears`
builds them on first use, and they are dropped with :meth:`PackedLinears.release` (the rollout server does so
whenever weights change or it sleeps) and rebuilt at the next generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rl_tpu.patches import torch_internals
from rl_tpu.sampler import panel_kernel

__all__ = ["PackedLinears", "packed_linear_supported"]


def packed_linear_supported() -> bool:
    """Whether this torch build has oneDNN's packed linear (CPU builds with mkldnn)."""
    from rl_tpu.patches.torch_internals import packed_linear_available

    return packed_linear_available()


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    def forward(x: torch.Tensor) -> torch.Tensor:  # (..., in_features) -> (..., out_features), float32
        return panel_kernel.linear(x, packed, bias, out_features)

    return forward


class PackedLinears:
    """Packed copies (:func:`rl_tpu.sampler.panel_kernel.pack`) of a CPU float32 model's ``nn.Linear`` weights,
    swapped in during a ``with`` block.

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
        self._fused: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None, list[int], int]] = {}

    def _eligible(self) -> list[torch.nn.Linear]:
        # looked up again at each pack: the model may have been cast (bfloat16 has no packed path here) or moved
        return [
            m
            for m in self.model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
        ]

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies hold now (0 when released)."""
        if self._packed is None:
            return 0
        own = sum(m.weight.numel() * m.weight.element_size() for m in self.modules)
        return own + sum(sum(splits) * inner * 4 for _, _, splits, inner in self._fused.values())

    def _weights_key(self) -> tuple:
        # a copy_ in this process bumps _version; the data_ptr catches a rebind (param.data = ...)
        return tuple((m.weight.data_ptr(), torch_internals.version_counter(m.weight)) for m in self.modules)

    def pack(self) -> None:
        """Build the packed copies now (each ``with`` block does it when they are missing or stale)."""
        self.modules = self._eligible()
        self._fused = {}
        with torch.inference_mode(False), torch.no_grad():
            self._packed = [panel_kernel.pack(m.weight, self.batch_hint) for m in self.modules]
        self._key = self._weights_key()

    def stale(self) -> bool:
        """Whether the next :meth:`applied` block packs first (copies missing, or a weight changed in this process)."""
        return self._packed is None or self._key != self._weights_key() or self.modules != self._eligible()

    def prepare(self) -> bool:
        """Pack now what the next :meth:`applied` block would pack (nothing when the copies are current); returns
        whether it packed. Lets a caller time the packing apart from the forward that follows."""
        if not self.stale():
            return False
        self.pack()
        return True

    def release(self) -> None:
        """Drop the packed copies (weights changed elsewhere, or memory is needed); the next use packs again."""
        self._packed, self._key, self._fused = None, None, {}

    def fused(self, group: tuple[torch.nn.Linear, ...]):
        """A function computing every layer of ``group`` (linear layers of one input width, all packed here) as one
        product on their concatenated packed weights: ``x (..., in) -> tuple of (..., out_i)`` (views of one
        output), or ``None`` when a layer of the group is not packed. Call within :meth:`applied`; the packed
        concatenation is built on first request and dropped with the others."""
        if self._packed is None or not {id(m) for m in group} <= {id(n) for n in self.modules}:
            return None
        key = tuple(id(m) for m in group)
        if key not in self._fused:
            with torch.inference_mode(False), torch.no_grad():
                weight = torch.cat([m.weight.detach() for m in group])  # (sum out, in)
                biases = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in group]
                bias = torch.cat(biases) if any(m.bias is not None for m in group) else None
                packed = panel_kernel.pack(weight, self.batch_hint)
            self._fused[key] = (packed, bias, [m.out_features for m in group], weight.shape[1])
        packed, bias, splits, _ = self._fused[key]

        def forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return panel_kernel.linear(x, packed, bias, sum(splits)).split(splits, dim=-1)

        return forward

    @contextmanager
    def applied(self) -> Iterator[bool]:
        """Run every packed module on its packed weight within the block; yields whether any was packed.

        The modules' own ``forward`` is restored on exit, so a model shared with other code (e.g. a trainer) only
        runs packed inside the block. Packs first when the copies are missing or a weight changed in this process
        (its version counter or storage moved); a weight written by *another* process through shared memory needs
        :meth:`release`.
        """
        if self.stale():
            self.pack()
        if not self.modules:
            yield False
            return
        for m, w in zip(self.modules, self._packed):
            m.forward = _packed_forward(w, m.bias, m.out_features)
        try:
            yield True
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)
