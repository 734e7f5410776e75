"""The compile subprocess: libtpu compiles lowered StableHLO for a TPU topology, with no chip (deviceless).

Run as ``python -m verl_backend.driver.aot.compile LOWERED.json TOPOLOGY OUT.json`` (``TOPOLOGY`` as JAX names it,
e.g. ``v6e:2x4``) by the interpreter that has libtpu, with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch is not
imported here). JAX's compile-only client (``jax.experimental.topologies.get_topology_desc(topology, "tpu")``)
compiles each module for one device of the topology (one chip's program: the trainer's FSDP gathers a block before
it runs, so a block graph holds its whole weights). Writes ``OUT.json``: ``{"topology", "device_kind", "error",
"graphs": [{"graph", "compile_s", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
"generated_code_bytes", "flops", "bytes_accessed", "transcendentals", "arguments", "outputs", "error"}]}``; sizes in
bytes, FLOPs as XLA's cost analysis counts them (a Mosaic ``tpu_custom_call`` counts as nothing there).
``arguments`` and ``outputs`` list each array, ``[dims, dtype, bytes]``, its bytes from the layout XLA chose for it
(:func:`layout_bytes`; their sums are XLA's ``argument_bytes`` and ``output_bytes`` less a tuple's index table).

``TOPOLOGY`` ``cpu`` is the numerics check instead (:func:`check_numerics`): graphs lowered with saved torch eager
inputs and outputs run on XLA:CPU and are compared with them.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:240]


def compatible(text: str) -> str:
    """TorchTPU 0.2.0's MLIR text, readable by jaxlib 0.10.2's parser: its ``chlo.top_k`` carries an ``is_stable``
    attribute that jaxlib's CHLO does not have (seen in Qwen3-MoE's router); ``is_stable = false`` is that op's only
    behaviour there, so it is dropped (``true`` is left, and then refused by the parser)."""
    return text.replace(", is_stable = false)", ")")


#: CHLO ops libtpu 0.0.52's plugin cannot take (``Failed to serialize StableHLO to plugin version 1.13.7``), with the
#: torch op TorchTPU 0.2.0 lowers to each. Measured one op a module (tests/verl_backend/driver/test_aot.py
#: ``test_which_chlo_op_libtpu_refuses``): ``chlo.scan`` fails; ``chlo.top_k``, ``chlo.ragged_dot`` and
#: ``chlo.is_neg_inf`` compile.
UNSERIALIZABLE_CHLO = {"chlo.scan": "torch.cumsum"}

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "i1": 1, "f64": 8, "ui32": 4, "i8": 1}
_TENSOR = r"tensor<((?:[0-9]+x)*)([a-z]+[0-9]*)>"


def main_types(text: str) -> tuple[list[tuple[list[int], str]], list[tuple[list[int], str]]]:
    """``@main``'s argument and result types, ``([(dims, dtype)], [(dims, dtype)])``, from the module's text."""
    import re

    m = re.search(
        r"func\.func (?:public )?@main\((.*?)\)\s*->\s*(\(.*?\)|tensor<[^>]*>)\s*(?:attributes|\{)", text, re.S
    )
    if m is None:
        raise ValueError("no func.func @main in the module")

    def types(part):
        return [([int(d) for d in dims.split("x") if d], dtype) for dims, dtype in re.findall(_TENSOR, part)]

    return types(m.group(1)), types(m.group(2))


def layout_bytes(dims: list[int], dtype: str, layout: str | None) -> int:
    """Bytes of an array of ``dims`` and MLIR ``dtype`` in XLA's ``layout`` (``{1,2,0:T(8,128)(2,1)}``: minor-to-major
    order, then tiles): its dimensions in that order with the first tile's padding applied to the minor ones. Dense
    when there is no layout."""
    import math
    import re

    size = _BYTES.get(dtype, 4)
    m = re.match(r"\{([0-9,]*)(?::T\(([0-9,]+)\))?", layout or "")
    if not dims or m is None:
        return math.prod(dims) * size if dims else size
    order = [int(i) for i in m.group(1).split(",") if i] or list(range(len(dims)))[::-1]
    padded = [dims[i] for i in order]  # minor first
    for k, t in enumerate(reversed([int(x) for x in m.group(2).split(",")] if m.group(2) else [])):
        if k < len(padded):
            padded[k] = -(-padded[k] // t) * t
    return math.prod(padded) * size


def _arrays(types, layouts) -> list[list]:
    layouts = [str(x) for x in layouts] if layouts is not None and len(layouts) == len(types) else [None] * len(types)
    return [[dims, dtype, layout_bytes(dims, dtype, lay)] for (dims, dtype), lay in zip(types, layouts)]


def _first_argument_bytes(text: str) -> int:
    """Dense bytes of ``@main``'s first argument (a block graph's input hidden states)."""
    args, _ = main_types(text)
    return layout_bytes(*args[0], None) if args else 0


def compile_all(lowered: list[dict], topology: str) -> dict:
    """Compile every lowered graph of ``lowered`` (records of :mod:`.lower`) for ``topology``; see the module
    docstring for the result. A topology libtpu does not know is ``error`` (one line) with no graphs."""
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(topology, "tpu")
    except Exception as exc:  # an unknown chip or shape: libtpu's own message
        return {
            "topology": topology,
            "device_kind": None,
            "graphs": [],
            "error": f"libtpu cannot compile for {topology}: {_first_line(exc)}",
        }
    from jax.extend.backend import get_compile_options
    from jax.extend.mlir import ir
    from jax.interpreters import mlir
    from jaxlib import xla_client as xc

    device = topo.devices[0]
    devices = xc.DeviceList((device,))
    options = get_compile_options(num_replicas=1, num_partitions=1, device_assignment=(device,))
    out = []
    for record in lowered:
        if record.get("error") or not record.get("file"):
            continue
        row = {
            "graph": record["graph"],
            "label": record["label"],
            "kind": record["kind"],
            "error": None,
            "block": record.get("block", ""),
            "block_layers": record.get("block_layers"),
        }
        start = time.perf_counter()
        try:
            module_text = compatible(Path(record["file"]).read_text())
            with mlir.make_ir_context():
                module = ir.Module.parse(module_text)
                exe = device.client.compile(module, executable_devices=devices, compile_options=options)
            row["compile_s"] = time.perf_counter() - start
            mem = exe.get_compiled_memory_stats()
            row["first_argument_bytes"] = _first_argument_bytes(module_text)
            try:  # each array's bytes in the layout XLA chose for it
                arg_types, out_types = main_types(module_text)
                row["arguments"] = _arrays(arg_types, exe.get_parameter_layouts())
                row["outputs"] = _arrays(out_types, exe.get_output_layouts())
                row["first_argument_bytes"] = row["arguments"][0][2] if row["arguments"] else 0
            except Exception:  # the totals below stand without them
                row["arguments"] = row["outputs"] = None
            row.update(
                argument_bytes=mem.argument_size_in_bytes,
                output_bytes=mem.output_size_in_bytes,
                temp_bytes=mem.temp_size_in_bytes,
                alias_bytes=mem.alias_size_in_bytes,
                generated_code_bytes=mem.generated_code_size_in_bytes,
            )
            cost = exe.cost_analysis() or {}
            if isinstance(cost, list):
                cost = cost[0] if cost else {}
            row.update(
                flops=float(cost.get("flops", 0.0)),
                bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                transcendentals=float(cost.get("transcendentals", 0.0)),
            )
        except Exception as exc:
            text = Path(record["file"]).read_text()
            bad = [op for op in UNSERIALIZABLE_CHLO if re.search(rf"\b{re.escape(op)}\b", text)]
            op = ""
            if bad and "serialize StableHLO" in str(exc):
                op = (
                    " ("
                    + ", ".join(f"its {o}, TorchTPU's lowering of {UNSERIALIZABLE_CHLO[o]}" for o in bad)
                    + ", has no form in the StableHLO that libtpu's plugin takes in this version)"
                )
            row["error"] = f"libtpu could not compile {record['graph']} for {topology}{op}: {_first_line(exc)}"
        out.append(row)
    return {"topology": topology, "device_kind": device.device_kind, "error": None, "graphs": out}


#: tolerance of the numerics check: max |XLA:CPU - torch eager| <= RTOL * max |torch eager|, per output, fp32
RTOL = 1e-5
_NP = {"f32": "float32", "f64": "float64", "i64": "int64", "i32": "int32", "i1": "bool"}


def _signature(text: str) -> list[str]:
    """The element type of each ``@main`` argument (``f32``, ``i64``, …), in order."""
    import re

    head = re.search(r"func\.func (?:public )?@main\((.*?)\)\s*->", text, re.S).group(1)
    return re.findall(r"tensor<(?:[0-9]+x)*([a-z]+[0-9]*)>", head)


def check_numerics(lowered: list[dict]) -> dict:
    """Run each lowered graph that has saved inputs and torch eager outputs (``numerics``, see :mod:`.lower`) on
    XLA:CPU (jaxlib's cpu backend; Mosaic-free StableHLO only) and compare every output with torch's.

    Returns:
        ``{"topology": "cpu", "error": None, "graphs": [{"graph", "label", "kind", "outputs", "max_abs_diff",
        "max_abs_ref", "ok", "error"}]}``: ``ok`` when every output has torch's shape and
        ``max|Δ| <= RTOL × max|ref|`` (:data:`RTOL`).
    """
    import numpy as np
    import jax
    from jax.extend.backend import get_compile_options
    from jax.extend.mlir import ir
    from jax.interpreters import mlir
    from jaxlib import xla_client as xc

    jax.config.update("jax_enable_x64", True)  # int64 inputs stay int64, as TorchTPU's graphs take them
    device = jax.devices("cpu")[0]
    options = get_compile_options(num_replicas=1, num_partitions=1, device_assignment=(device,))
    out = []
    for record in lowered:
        if record.get("error") or not record.get("numerics"):
            continue
        row = {
            "graph": record["graph"],
            "label": record["label"],
            "kind": record["kind"],
            "error": None,
            "ok": False,
            "block": record.get("block", ""),
        }
        try:
            text = compatible(Path(record["file"]).read_text())
            saved = np.load(record["numerics"])
            inputs = [saved[f"in{i}"] for i in range(sum(k.startswith("in") for k in saved.files))]
            refs = [saved[f"out{i}"] for i in range(sum(k.startswith("out") for k in saved.files))]
            types = _signature(text)
            if len(types) != len(inputs):
                raise ValueError(f"@main takes {len(types)} arguments, torch's graph {len(inputs)}")
            args = [jax.device_put(np.asarray(a, dtype=_NP[t]), device) for a, t in zip(inputs, types)]
            with mlir.make_ir_context():
                exe = device.client.compile_and_load(
                    ir.Module.parse(text), executable_devices=xc.DeviceList((device,)), compile_options=options
                )
            got = [np.asarray(o) for o in exe.execute(args)]
            if len(got) != len(refs) or any(g.shape != r.shape for g, r in zip(got, refs)):
                raise ValueError(f"outputs {[g.shape for g in got]} against torch's {[r.shape for r in refs]}")
            floats = [
                (g.astype("float64"), r.astype("float64"))
                for g, r in zip(got, refs)
                if np.issubdtype(r.dtype, np.floating)
            ]
            diff = max((float(np.abs(g - r).max()) if g.size else 0.0 for g, r in floats), default=0.0)
            scale = max((float(np.abs(r).max()) if r.size else 0.0 for _, r in floats), default=0.0)
            exact = all(np.array_equal(g, r) for g, r in zip(got, refs) if not np.issubdtype(r.dtype, np.floating))
            row.update(outputs=len(refs), max_abs_diff=diff, max_abs_ref=scale, ok=bool(exact and diff <= RTOL * scale))
        except Exception as exc:
            row["error"] = f"numerics of {record['graph']} on XLA:CPU failed: {_first_line(exc)}"
        out.append(row)
    return {"topology": "cpu", "device_kind": "cpu", "error": None, "graphs": out}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    lowered = json.loads(Path(argv[0]).read_text())
    result = check_numerics(lowered) if argv[1] == "cpu" else compile_all(lowered, argv[1])
    Path(argv[2]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
