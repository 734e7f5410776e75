"""Counting the ops one training micro batch dispatches (forward and backward of the loss), eager and with compiled
blocks (:mod:`rl_tpu.compiled_blocks`): what TorchTPU's strict eager mode pays per op, against one launch per graph.

What the counter sees inside a compiled region: nothing useful by itself. Dynamo refuses to trace or run a frame
while a non-infra ``TorchDispatchMode`` such as :class:`~rl_tpu.sampler.opcount.OpCounter` is active (with
``fullgraph=True`` that is an error), and inductor's generated code would leak part of its work to the mode (its
``extern_kernels.mm`` and buffer allocations are aten calls; its fused C++ kernels are not), so a plain count under
compile would be neither eager nor one launch. :func:`micro_batch_ops` therefore makes the count honest this way:

* each block's forward call runs the compiled graph with the dispatch modes off and counts **one launch** under
  :data:`FORWARD_GRAPH`;
* AOT autograd's backward graph of that call, run by the autograd engine inside ``loss.backward()``, counts **one
  launch** under :data:`BACKWARD_GRAPH`, with the modes off while it runs;
* everything else is counted op by op as in eager: the embedding, rotary tables, masks, final norm, LM head, loss and
  their backward, plus what the autograd engine itself does at each block's boundary (one ``add_`` per block
  parameter as ``AccumulateGrad`` adds its gradient into ``.grad``; ``zeros`` for block outputs that get none).

Forward and backward are separate graphs (AOT autograd partitions them; a device runs them as two executables), so
a micro batch through ``L`` blocks is ``2 L`` launches. The graphs are compiled for counting with AOT autograd and
no code generation (``aot_eager``'s graphs, the same one forward and one backward per block call that inductor or
the TPU backend receive), so the count needs no compiler and is the same for any backend.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from rl_tpu.patches.torch_internals import boxed, disable_current_modes
from rl_tpu.sampler.opcount import OpCounter

#: the names a compiled block's forward and backward launches are counted under
FORWARD_GRAPH = "<compiled forward graph>"
BACKWARD_GRAPH = "<compiled backward graph>"
#: ops the autograd engine dispatches at a compiled block's boundary (outside its graphs)
BOUNDARY_OPS = frozenset({"add_", "zeros"})


class CountingBackend:
    """A ``torch.compile`` backend (AOT autograd, graphs run as traced) whose every graph call counts one launch in
    :attr:`launches` (under :data:`FORWARD_GRAPH` / :data:`BACKWARD_GRAPH`) and runs with dispatch modes off."""

    def __init__(self) -> None:
        from rl_tpu.patches.torch_internals import aot_autograd

        self.launches: Counter[str] = Counter()
        self._aot = aot_autograd(fw_compiler=self._compiler(FORWARD_GRAPH), bw_compiler=self._compiler(BACKWARD_GRAPH))

    def _compiler(self, name: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            def launch(args):
                self.launches[name] += 1
                with disable_current_modes():
                    return gm(*args)

            return boxed(launch)

        return compile_graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        return self._aot(gm, example_inputs)


def _modes_off(forward: Callable) -> Callable:
    def call(*args, **kwargs):
        with disable_current_modes():  # dynamo runs no frame under a dispatch mode
            return forward(*args, **kwargs)

    return call


def micro_batch_ops(
    model: torch.nn.Module, step: Callable[[torch.nn.Module], torch.Tensor], *, compiled: bool = False
) -> Counter[str]:
    """Aten ops one training micro batch dispatches: ``step(model)`` (forward and loss, returning the scalar loss)
    and ``loss.backward()``, by op name; with ``compiled=True`` each decoder block is compiled in place
    (:class:`rl_tpu.compiled_blocks.CompiledBlocks`) and its forward and backward graphs count one launch each.

    The step runs once uncounted first (to compile, and so that every parameter has a ``.grad``: the count is of a
    micro batch in the middle of a gradient accumulation), then once counted. Gradients are left accumulated.

    Args:
        model: a Hugging Face causal LM in train mode. ``compiled=True`` changes it (its blocks stay compiled): pass a
            copy if the eager model is wanted afterwards.
        step: ``step(model) -> loss``, a scalar tensor; shapes must be the same on both calls.
        compiled: compile the blocks; raises ``RuntimeError`` when a block fell back to eager (the count would not
            be of compiled blocks) or the model names no block class.

    Returns:
        ``Counter`` of op name -> calls, plus :data:`FORWARD_GRAPH` and :data:`BACKWARD_GRAPH` launches when compiled.
    """
    from rl_tpu.compiled_blocks import CompiledBlocks, decoder_blocks

    backend = None
    if compiled:
        backend = CountingBackend()
        blocks = CompiledBlocks(model, backend, say=lambda line: None)
        if not blocks.blocks:
            raise RuntimeError(
                f"{type(model).__name__} names no decoder block class (_no_split_modules): nothing to compile"
            )
        for block in decoder_blocks(model):
            block.forward = _modes_off(block.forward)
    step(model).backward()
    if compiled:
        if blocks.eager_reason is not None:
            raise RuntimeError(f"compiled blocks fell back to eager ({blocks.eager_reason}): not a compiled count")
        backend.launches.clear()
    with OpCounter() as counter:
        step(model).backward()
    counts = counter.counts
    if backend is not None:
        counts.update(backend.launches)
    return counts


def split(counts: Counter[str]) -> tuple[int, int]:
    """``(ops dispatched op by op, graph launches)`` of a :func:`micro_batch_ops` count."""
    launches = counts[FORWARD_GRAPH] + counts[BACKWARD_GRAPH]
    return sum(counts.values()) - launches, launches
