"""Why compiled CPU decode is slower than the lean CPU decode: the linear layers of one decode step, timed as each
path runs them.

Inductor's CPU decode graph (``Sampler(compile=True)``, no ``freezing``) calls ``extern_kernels.mm(x, weight.t())``
for every linear layer: the weights are graph inputs (so a weight sync needs no recompile), read in their plain
``(out, in)`` layout by MKL's sgemm. The sampler's packed weights (``rl_tpu.sampler.packed``, and inside its compiled
graphs ``rl_tpu.sampler.compiled_packed``) run on rl-tpu's panel kernel (``rl_tpu.sampler.panel_kernel``: each
weight streamed from memory while it is multiplied), or on oneDNN's ``_linear_pointwise`` on weights packed once
per generation where the panel kernel cannot run; both are timed. Inductor packs weights the same way only with
``freezing`` (weights baked in as constants: a sync would be ignored), and it refuses a packed (``torch._mkldnn``
layout) tensor as a graph input (checked here: ``inductor`` raises, ``aot_eager`` runs it).

Printed: ms per decode step for the model's linear layers (the attention, norms and sampling left out), at the batch
given, for ``F.linear`` (eager), ``mm(x, w.t())`` (what a plain compiled graph calls), oneDNN-packed weights and the
panel kernel's panels; median of ``--repeats``, the paths interleaved.

    python benchmarks/bench_decode_linears.py [--rows 16] [--repeats 7]   (SmolLM2-135M's shapes)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rl_tpu.patches import torch_internals
from rl_tpu.sampler import panel_kernel

#: SmolLM2-135M: hidden 576, 9 query / 3 key-value heads of 64, MLP 1536, 30 layers, vocabulary 49152 (tied head)
HIDDEN, KV, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="decode batch (default job: 4 prompts x 4 samples)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layer = [
        (HIDDEN, HIDDEN),
        (KV, HIDDEN),
        (KV, HIDDEN),
        (HIDDEN, HIDDEN),
        (MLP, HIDDEN),
        (MLP, HIDDEN),
        (HIDDEN, MLP),
    ]
    shapes = layer * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    inputs = {i: torch.randn(args.rows, i) for i in (HIDDEN, MLP)}
    packed = [torch_internals.reorder_linear_weight(w, args.rows) for w in weights]

    def linear():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    def mm_t():
        for w in weights:
            torch.mm(inputs[w.shape[1]], w.t())

    def onednn():
        for w, p in zip(weights, packed):
            torch_internals.linear_pointwise(inputs[w.shape[1]], p, None)

    paths = {"F.linear (eager)": linear, "mm(x, w.t()) (inductor graph)": mm_t, "oneDNN packed": onednn}
    if panel_kernel.backend() == "panel":
        panels = [panel_kernel.pack_panels(w) for w in weights]

        def panel():
            for w, p in zip(weights, panels):
                panel_kernel.linear(inputs[w.shape[1]], p, None, w.shape[0])

        paths["rl-tpu panel kernel"] = panel
    times = {name: [] for name in paths}
    for _ in range(args.repeats):  # interleaved, so a change in the machine's load hits every path alike
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(
        f"linear layers of one SmolLM2-135M decode step: {len(weights)} matmuls, {mb:.0f} MB of weights, "
        f"batch {args.rows}, 1 thread"
    )
    base = statistics.median(times["oneDNN packed"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<30} {med * 1e3:8.1f} ms/step   {med / base:5.2f}x oneDNN   ({mb / 1e3 / med:5.1f} GB/s)")

    def graph(x, p):
        return torch_internals.linear_pointwise(x, p, None)

    for backend in ("aot_eager", "inductor"):
        torch.compiler.reset()
        try:
            torch.compile(graph, backend=backend, fullgraph=True)(inputs[HIDDEN], packed[0])
            print(f"  a packed weight as a graph input, backend {backend}: runs")
        except torch_internals.compile_errors() as exc:
            print(
                f"  a packed weight as a graph input, backend {backend}: {type(exc).__name__} "
                f"{(str(exc).splitlines() or [''])[0][:120]}"
            )


if __name__ == "__main__":
    main()
