"""Per-expert weight names onto a model that stores its experts fused.

transformers 5 keeps a mixture of experts' weights (Qwen2/3-MoE, Mixtral, ...) as 3-D tensors, one per layer and
projection: ``<layer>.mlp.experts.gate_up_proj`` ``(experts, 2 * intermediate, hidden)`` (gate rows, then up rows)
and ``<layer>.mlp.experts.down_proj`` ``(experts, hidden, intermediate)``. Checkpoints, vLLM, and VeRL 0.9.1's weight
export (``verl.workers.engine.fsdp.utils.unfuse_moe_params``, on every path but ours through shared memory) name
them per expert: ``<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight``, 2-D. :func:`expert_slice` says where such a
tensor goes in the fused one, so a weight sync writes each expert into its slice in place: no fused copy is ever
assembled, and the sync's extra memory stays one bucket whatever the expert tensors' size.

On TPU the experts run as transformers' ``batched_mm`` (:data:`TPU_EXPERTS`), not its default ``grouped_mm``:
``grouped_mm`` counts each expert's tokens with ``torch.cumsum``, which TorchTPU 0.2.0 lowers to ``chlo.scan``, and
libtpu 0.0.52 refuses that op (XLA:CPU aborts on it). ``batched_mm`` gathers each token's ``k`` experts' weights and
runs one batched matmul: static shapes, no scan, at the cost of ``tokens x k`` copies of an expert's weights
(docs/tpu.md, "MoE on TPU"). :func:`tpu_experts_kwargs` is what a TPU process passes to ``from_pretrained``; the
trainer's models get it through the TPU profile's ``override_config`` (:mod:`verl_backend.driver.profiles`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

_PER_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def expert_slice(name: str, lookup: Callable[[str], torch.Tensor | None]) -> tuple[str, torch.Tensor] | None:
    """The fused tensor a per-expert name belongs to, and the view of it that the expert's weight fills.

    Args:
        name: a weight name, e.g. ``model.layers.3.mlp.experts.7.up_proj.weight``.
        lookup: the destination's tensor for a name (``None`` when it has none).

    Returns:
        ``(fused name, view)``: ``view`` is ``(out, in)``, a view into the fused ``(experts, ., .)`` tensor (write
        it in place: ``view.copy_(weight)``); ``None`` when ``name`` is not a per-expert name, or the destination
        has no fused tensor of a shape it fits (then the name is the destination's own, or a mismatch to report).
    """
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    base, e, proj = m["base"], int(m["e"]), m["proj"]
    fused_name = f"{base}.down_proj" if proj == "down_proj" else f"{base}.gate_up_proj"
    fused = lookup(fused_name)
    if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused_name, fused[e]  # (hidden, intermediate)
    half = fused.shape[1] // 2
    rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
    return fused_name, fused[e, rows]  # (intermediate, hidden)


#: the experts implementation of every MoE model a TPU job builds (trainer, reference, critic, sampler, lowering)
TPU_EXPERTS = "batched_mm"


def tpu_experts_kwargs(device_type: str) -> dict[str, str]:
    """``from_pretrained`` keyword arguments for a model that runs on ``device_type`` (``"tpu"``, ``"cpu"``, ...):
    ``{"experts_implementation": "batched_mm"}`` on TPU (harmless for a model without experts), else ``{}``
    (transformers' default)."""
    return {"experts_implementation": TPU_EXPERTS} if device_type == "tpu" else {}


def has_fused_experts(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a mixture of experts stored fused (a 3-D ``down_proj`` parameter, ``(experts, ., .)``):
    the modules an experts implementation applies to."""
    return any(name.endswith("experts.down_proj") and p.dim() == 3 for name, p in model.named_parameters())
