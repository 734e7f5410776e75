"""The lowering server: FX graphs from a running job to StableHLO through TorchTPU, one process for a worker's life.

Run as ``<.venv-aot>/bin/python -m verl_backend.driver.aot.serve`` by :class:`verl_backend.tpu_on_cpu.Lowering`
(the ``tpu-on-cpu`` compile backend), never imported by a worker: TorchTPU's import takes 5-20 s and an eager TPU op
outside compile mode aborts the process, so it is imported once, here.

Protocol, on stdin and stdout (``sys.stdout`` is pointed at stderr, so nothing else writes there): each message is
an 8-byte little-endian length and a pickle. A request is ``{"name": graph name, "graph": an aot_autograd
``GraphModule`` (ATen ops, parameters as inputs) as :func:`verl_backend.tpu_on_cpu.graph_payload` sends it, "inputs": [("tensor", shape, dtype) | ("value", python
value)]}``; the reply is ``{"mlir": StableHLO text | None, "constants": [CPU tensors lifted to extra last inputs],
"seconds": lowering seconds, "op": the op that failed | None, "error": one line | None}``. The first message is the server's, ``{"ready": True, "pid",
"decompositions": [(op, module, qualified name)]}``: TorchTPU's decomposition table (what ``TpuBackend`` hands
aot_autograd on a chip) by name, which the worker applies in its own aot_autograd trace. Each graph is lowered on
metadata-only TPU placeholders by :func:`verl_backend.driver.aot.lower.lower`, the code ``--aot-only`` uses.
"""

from __future__ import annotations

import os
import sys
import time

from verl_backend.tpu_on_cpu import read_message, write_message


def _meta_inputs(inputs: list) -> list:
    """Meta tensors (and values) shaped like the request's ``inputs``."""
    import torch

    return [torch.empty(spec[1], dtype=spec[2], device="meta") if spec[0] == "tensor" else spec[1] for spec in inputs]


def decomposition_names() -> list[tuple[str, str, str]]:
    """TorchTPU's decomposition table (what ``TpuBackend`` hands aot_autograd on a chip) by name: ``[(op overload,
    function's module, function's qualified name)]``, for the worker to apply the same functions."""
    from verl_backend.patches.torch_tpu_aot import decompositions

    return [(str(op), fn.__module__, fn.__qualname__) for op, fn in decompositions().items()]


def lower_request(request: dict) -> dict:
    """The reply to one request (see the module docstring); a graph TorchTPU cannot lower is a reply with its op and
    one-line error, never an exception."""
    from verl_backend.driver.aot.lower import lower, lowering_failure_line
    from verl_backend.patches.torch_tpu_aot import LoweringError

    name = request["name"]
    start = time.perf_counter()
    try:
        from torch.fx.graph_module import reduce_graph_module

        from verl_backend.driver.aot.compile import compatible

        text, constants = lower(reduce_graph_module(*request["graph"]), _meta_inputs(request["inputs"]))
        text = compatible(text)  # what jaxlib's parser reads (chlo.top_k's is_stable)
        if any(c.device.type == "meta" for c in constants):
            raise ValueError("a constant of the graph has no value (it was made on the meta device)")
        constants = [c.detach().clone() for c in constants]
    except LoweringError as exc:
        return {
            "mlir": None,
            "constants": [],
            "seconds": time.perf_counter() - start,
            "op": exc.op,
            "error": lowering_failure_line(name, exc),
        }
    except Exception as exc:  # anything else TorchTPU's recorder raises: one line, not a dead worker
        line = (str(exc).strip().splitlines() or [""])[0][:200]
        return {
            "mlir": None,
            "constants": [],
            "seconds": time.perf_counter() - start,
            "op": None,
            "error": f"lowering graph {name} failed: {type(exc).__name__}: {line}",
        }
    return {"mlir": text, "constants": constants, "seconds": time.perf_counter() - start, "op": None, "error": None}


def main() -> int:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints from TorchTPU or this code go to stderr
    from verl_backend.patches.torch_tpu_aot import apply

    apply()
    write_message(out, {"ready": True, "pid": os.getpid(), "decompositions": decomposition_names()})
    while (request := read_message(sys.stdin.buffer)) is not None:
        write_message(out, lower_request(request))
    return 0


if __name__ == "__main__":
    sys.exit(main())
