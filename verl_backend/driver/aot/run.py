"""``verl train --backend tpu --aot-only``: every graph of the TPU job lowered by TorchTPU and compiled by libtpu for
the slice's chip, on a machine without one, and the table of what XLA says each costs.

The driver never imports torch-tpu: :func:`lower_and_compile` runs :mod:`.lower` and then :mod:`.compile` as
subprocesses of the interpreter that has torch-tpu (:func:`aot_python`), each with a timeout, so a crash in TorchTPU
or libtpu (an abort, a segfault) is one line here, never a crash of ``verl``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from verl_backend.driver.aot.graphs import SAMPLER_KINDS
from verl_backend.errors import BadInputError
from verl_backend.tpu_on_cpu import LIBTPU_QUIET_ENV, aot_python_path

#: per chip generation: (peak bf16 dense FLOP/s, HBM bytes/s), from the Cloud TPU "TPU versions" pages
CHIP_PEAKS = {
    "v4": (275e12, 1228e9),
    "v5litepod": (197e12, 819e9),
    "v5p": (459e12, 2765e9),
    "v6e": (918e12, 1640e9),
    "v7x": (2307e12, 7380e9),
}
#: Ray's generation name -> the name libtpu's topology descriptions use
JAX_GENERATION = {"v5litepod": "v5e"}
LOWER_TIMEOUT_S = 1800
COMPILE_TIMEOUT_S = 1800
# no cloud metadata server wait; quieter libtpu; no libtpu lockfile (/tmp/libtpu_lockfile), which would refuse a
# second process on the machine (two --aot-only runs, a test beside a run, a tpu-on-cpu lowering server) although none
# of them opens a chip
_QUIET = LIBTPU_QUIET_ENV


class AotError(BadInputError):
    """Ahead-of-time lowering or compiling could not run or failed; the message is one line."""


def aot_python() -> str:
    """The interpreter with torch-tpu and libtpu: ``<this venv>-aot/bin/python`` (what ``.ci/aot_venv`` makes), else
    this interpreter when torch-tpu is importable here (not imported).

    Raises:
        AotError: none has torch-tpu.
    """
    python = aot_python_path()
    if python is not None:
        return python
    raise AotError(
        f"--aot-only needs torch-tpu 0.2.0 and libtpu 0.0.52, in {sys.prefix}-aot (make it with "
        "`.ci/aot_venv`, the `aot` extra) or this environment (`pip install -e '.[aot]'`)"
    )


def jax_topology(slice_name: str) -> tuple[str, str, float]:
    """``(jax topology, Ray generation, HBM GiB)`` of a slice name, e.g. ``v6e-8`` or ``v6e-8:2x4`` ->
    ``("v6e:2x4", "v6e", 32)``.

    Raises:
        rl_tpu.topology.TopologyError: a malformed slice name.
    """
    from rl_tpu.topology import parse_slice

    name, _, shape = slice_name.partition(":")  # the resolved rl_tpu.slice names its topology: v6e-8:2x4
    spec = parse_slice(name, shape or None)
    return f"{JAX_GENERATION.get(spec.generation, spec.generation)}:{spec.topology}", spec.generation, spec.hbm_gib


def _env(extra: dict | None = None) -> dict:
    env = {**os.environ, **_QUIET, **(extra or {})}
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the ``verl`` process dies (Linux ``PR_SET_PDEATHSIG``). The child has
    a session of its own (a TorchTPU crash must not signal ``verl``), so a ``timeout`` or Ctrl-C that ends ``verl``
    would otherwise leave it lowering on its own for minutes. libc is opened in the parent (:func:`_libc`): the
    child of a threaded parent (the TPU dry run lowers from a thread of the driver) calls no ``dlopen`` before exec.
    The signal comes when the thread that started the child ends: :func:`_run` waits in that thread until then."""
    _LIBC[0].prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)


_LIBC: list = []


def _libc():
    if not _LIBC:
        import ctypes

        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def _run(cmd: list[str], what: str, timeout_s: float, log: Path, env: dict) -> None:
    """Run ``cmd``, output into ``log``; a timeout, a signal or a non-zero exit is one :class:`AotError` line. The
    subprocess dies with this process (:func:`_die_with_parent`)."""
    linux = sys.platform.startswith("linux")
    if linux:
        _libc()  # opened here, not in the child (see _die_with_parent)
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout_s,
                start_new_session=True,
                preexec_fn=_die_with_parent if linux else None,
            )
        except subprocess.TimeoutExpired:
            raise AotError(
                f"{what} took longer than {timeout_s:.0f} s and was stopped; its output is in {log}"
            ) from None
    if proc.returncode != 0:
        how = (
            f"was killed by {signal.Signals(-proc.returncode).name}"
            if proc.returncode < 0
            else f"exited with code {proc.returncode}"
        )
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or [""]
        raise AotError(f"{what} {how}: {tail[0].strip()[:200]} (output: {log})")


@dataclasses.dataclass
class AotResult:
    """What :func:`lower_and_compile` found: ``lowered`` records (:mod:`.lower`), ``compiled`` per topology
    (:mod:`.compile`), and the folder holding the StableHLO files and logs."""

    lowered: list[dict]
    compiled: dict[str, dict]
    folder: Path


def lower_and_compile(
    jobs: list[dict],
    topologies: list[str],
    folder: Path | None = None,
    python: str | None = None,
    lower_timeout_s: float = LOWER_TIMEOUT_S,
    compile_timeout_s: float = COMPILE_TIMEOUT_S,
) -> AotResult:
    """Lower ``jobs`` (the ``jobs`` of :mod:`.lower`'s spec) in one subprocess, then compile them for each of
    ``topologies`` (JAX names, ``v6e:2x4``) in one subprocess per topology.

    Raises:
        AotError: no torch-tpu, a subprocess crashed or timed out (one line with its last output line and the log).
    """
    python = python or aot_python()
    folder = Path(folder or tempfile.mkdtemp(prefix="rl-tpu-aot-"))
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"out": str(folder), "jobs": jobs}))
    _run(
        [python, "-m", "verl_backend.driver.aot.lower", str(spec)],
        "TorchTPU's lowering (subprocess)",
        lower_timeout_s,
        folder / "lower.log",
        _env(),
    )
    lowered = json.loads((folder / "lowered.json").read_text())
    compiled = {}
    for topo in topologies:
        out = folder / f"compiled-{topo.replace(':', '_')}.json"
        _run(
            [python, "-m", "verl_backend.driver.aot.compile", str(folder / "lowered.json"), topo, str(out)],
            f"libtpu's compile for {topo} (subprocess)",
            compile_timeout_s,
            folder / f"compile-{topo.replace(':', '_')}.log",
            _env({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
        )
        compiled[topo] = json.loads(out.read_text())
    return AotResult(lowered, compiled, folder)


def errors(result: AotResult) -> list[str]:
    """Every failure in ``result`` once, one line each: graphs not lowered, topologies refused, graphs not compiled.
    A failure that several graphs share (the same op in the same module: a prefill and every decode bucket) is the
    first graph's line, ending with how many more graphs it stopped and the first of them."""
    rows = [r for r in result.lowered if r.get("error")]
    lines = []
    for topo in result.compiled.values():
        if topo.get("error"):
            lines.append(topo["error"])
        rows += [g for g in topo.get("graphs", []) if g.get("error")]
    seen: dict[str, list] = {}
    for row in rows:  # the cause: the line without its graph's name
        seen.setdefault(row["error"].replace(row["graph"], "<graph>"), []).append(row)
    for same in seen.values():
        more = [r["graph"] for r in same[1:]]
        line = same[0]["error"]
        if more:
            line += (
                f" (also {len(more)} more graph{'s' if len(more) > 1 else ''}: {', '.join(more[:2])}"
                + (", ..." if len(more) > 2 else "")
                + ")"
            )
        lines.append(line)
    return lines


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def table(compiled: dict, generation: str, mosaic: dict[str, bool] | None = None) -> str:
    """One topology's graphs as a text table: compile seconds, HBM bytes (GiB) of arguments, outputs, temporaries
    and generated code, XLA's FLOPs and bytes accessed, and the roofline lower bound ``max(FLOPs / peak FLOP/s,
    bytes / HBM bandwidth)`` in ms at the chip's peaks (:data:`CHIP_PEAKS`)."""
    peak_flops, bandwidth = CHIP_PEAKS[generation]
    head = ("graph", "compile s", "args GiB", "out GiB", "temp GiB", "code MiB", "GFLOP", "GB moved", "bound ms")
    rows = [head]
    for g in compiled.get("graphs", []):
        if g.get("error"):
            continue
        bound = max(g["flops"] / peak_flops, g["bytes_accessed"] / bandwidth) * 1e3
        name = g["graph"] + (" *" if mosaic and mosaic.get(g["graph"]) else "")
        rows.append(
            (
                name,
                f"{g['compile_s']:.2f}",
                _gib(g["argument_bytes"]),
                _gib(g["output_bytes"]),
                _gib(g["temp_bytes"]),
                f"{g['generated_code_bytes'] / 2**20:.1f}",
                f"{g['flops'] / 1e9:.2f}",
                f"{g['bytes_accessed'] / 1e9:.3f}",
                f"{bound:.3f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _shared_inputs(fwd: dict) -> int:
    """Bytes of a block forward's arguments that every block reads besides its hidden states: its 3-D and 4-D
    arguments after the first (the rotary ``cos``/``sin`` tables and the attention mask; a block's parameters are 1-D
    and 2-D), by XLA's per-array sizes; 0 when the compile did not list them."""
    arrays = fwd.get("arguments") or []
    return sum(a[2] for a in arrays[1:] if len(a[0]) >= 3)


def saved_activations(fwd: dict | list[dict], layers: int, checkpointed: bool) -> int:
    """The update's saved activations from a block forward graph's XLA numbers: with gradient checkpointing each
    block keeps only its input (the graph's first argument) and one block's forward outputs are live again while it
    is recomputed, ``layers × input + outputs``; without, every block's outputs, ``layers × outputs``; plus the inputs
    all blocks share (:func:`_shared_inputs`). ``fwd`` may be the forward graphs of each kind of block at one shape
    (``block_layers`` blocks each): then the largest kind's outputs are the recomputed ones, and without
    checkpointing each kind counts for its own blocks."""
    kinds = fwd if isinstance(fwd, list) else [fwd]
    top = max(kinds, key=lambda g: g["output_bytes"])
    if checkpointed:
        kept = layers * top.get("first_argument_bytes", 0) + top["output_bytes"]
    elif len(kinds) == 1:
        kept = layers * top["output_bytes"]
    else:
        kept = sum((g.get("block_layers") or 1) * g["output_bytes"] for g in kinds)
    return kept + _shared_inputs(top)


def _by_shape(graphs: list[dict], kind: str, suffix: str = "") -> dict[str, list[dict]]:
    """``kind`` graphs ending in ``suffix``, grouped by shape (``8x1024``, the block kind left out)."""
    out: dict[str, list[dict]] = {}
    for g in graphs:
        if g["kind"] == kind and g["graph"].endswith(suffix):
            out.setdefault(_shape_of(g["graph"]).split("|")[0], []).append(g)
    return out


def per_chip_bytes(compiled: dict, layers: int, checkpointed: bool = False) -> dict[str, int]:
    """The training step's HBM per chip from XLA's numbers: the saved activations (:func:`saved_activations`), plus
    the largest working set of one trainer graph (arguments + outputs + temporaries + code − aliased); and the
    sampler's largest graph. Returns ``{"saved_activations", "largest_trainer_graph", "largest_sampler_graph",
    "training_peak"}`` in bytes. Parameters, gradients and optimizer state held between graphs are the memory plan's
    terms, not here."""

    def working(g):
        return (
            g["argument_bytes"]
            + g["output_bytes"]
            + g["temp_bytes"]
            + g["generated_code_bytes"]
            - g.get("alias_bytes", 0)
        )

    graphs = [g for g in compiled.get("graphs", []) if not g.get("error")]
    fwd = _by_shape(graphs, "block", ".fwd").values()  # a shape's graphs, one per kind of block
    saved = max((saved_activations(kinds, layers, checkpointed) for kinds in fwd), default=0)
    trainer = max((working(g) for g in graphs if g["kind"] not in SAMPLER_KINDS), default=0)
    sampler = max((working(g) for g in graphs if g["kind"] in SAMPLER_KINDS), default=0)
    return {
        "saved_activations": saved,
        "largest_trainer_graph": trainer,
        "largest_sampler_graph": sampler,
        "training_peak": saved + trainer,
    }


#: the plan's terms that no compiled graph holds, and why (``plan_comparison`` lists them with no XLA number)
IN_NO_GRAPH = {
    "parameters": "in no graph: FSDP2's shard of the fp32 weights, between graphs",
    "gradients": "in no graph: the reduce-scattered fp32 shard, between graphs",
    "optimizer": "in no graph: AdamW's moments, read by the optimizer step (not compiled here)",
    "reference policy": "in no graph: the reference's shard; its log-prob forward is not in the list",
    "FSDP2 gather buffers": "in no graph as such: its bf16 parts are the graphs' parameter arguments and gradient "
    "outputs above; the fp32 copies for the reduce-scatter live outside the graphs",
    "log-prob forward": "in no graph here: no no-grad forward (reference, old policy) was compiled",
    "critic activations": "in no graph here: the critic's graphs were not compiled",
    "critic": "in no graph: the critic's fp32 shard, gradients and AdamW moments, between graphs",
}


def _shape_of(graph: str) -> str:
    """``8x1024`` of a graph name such as ``critic.value_head[8x1024].fwd``."""
    return graph[graph.index("[") + 1 : graph.index("]")]


def _first_shape_graph(graphs: list[dict], kind: str, suffix: str = "") -> dict | None:
    """The ``kind`` graph ending in ``suffix`` of the first shape compiled (:func:`_by_shape`); of several kinds of
    block at that shape, the one with the most output + temporary bytes; ``None`` when none compiled."""
    shapes = list(_by_shape(graphs, kind, suffix).values())
    return max(shapes[0], key=lambda g: g["output_bytes"] + g["temp_bytes"]) if shapes else None


def _update_rows(plan, fwd: dict | None, bwd: dict | None, checkpointed: bool) -> list[tuple[str, float, str]]:
    """XLA's numbers for the plan's update terms from the block's forward (``fwd``) and backward (``bwd``) graph
    records: ``[(term, bytes, what XLA's number is)]`` for the block forward arguments, the activations
    (:func:`saved_activations` over the model's layers), the block backward outputs and the larger temporaries; the
    rows of a graph that did not compile are left out."""
    layers = getattr(plan.model, "layers", 1)
    rows: list[tuple[str, float, str]] = []
    if fwd:
        rows.append(
            (
                "block forward arguments",
                fwd["argument_bytes"],
                f"{fwd['graph']} arguments: the gathered block ({plan.model.name}'s bf16 weights), its input, "
                "rotary tables and mask",
            )
        )
        how = (
            f"{layers} x {fwd['graph']}'s first argument + its outputs + rotary and mask"
            if checkpointed
            else f"{layers} x {fwd['graph']} outputs + rotary and mask"
        )
        rows.append(("activations", saved_activations(fwd, layers, checkpointed), how))
    if bwd:
        rows.append(
            (
                "block backward outputs",
                bwd["output_bytes"],
                f"{bwd['graph']} outputs: the block's gradients (unsharded, bf16) and its input's",
            )
        )
    if fwd or bwd:
        temps = [g for g in (fwd, bwd) if g]
        rows.append(
            (
                "update temporaries",
                max(g["temp_bytes"] for g in temps),
                "the larger temporaries of " + " and ".join(g["graph"] for g in temps),
            )
        )
    return rows


def _lm_head_rows(hf: dict | None, hb: dict | None) -> list[tuple[str, float, str]]:
    """XLA's numbers for the plan's LM head terms from its forward (``hf``) and backward (``hb``) graph records:
    ``[(term, bytes, what XLA's number is)]``, the arguments and logits (outputs + temporaries) of the forward and
    the outputs of the backward; a graph that did not compile gives no rows."""
    rows: list[tuple[str, float, str]] = []
    if hf:
        rows.append(("LM head forward arguments", hf["argument_bytes"], f"{hf['graph']} arguments"))
        rows.append(("LM head logits", hf["output_bytes"] + hf["temp_bytes"], f"{hf['graph']} outputs + temporaries"))
    if hb:
        rows.append(("LM head backward outputs", hb["output_bytes"], f"{hb['graph']} outputs"))
    return rows


def _sampler_rows(graphs: list[dict]) -> list[tuple[str, float, str]]:
    """XLA's numbers for the plan's sampler terms: ``[(term, bytes, what XLA's number is)]``, the weights and KV cache
    (the arguments of the decode graph with the most) and its step outputs, then the largest temporaries of any
    sampler graph (:data:`~verl_backend.driver.aot.graphs.SAMPLER_KINDS`)."""
    rows: list[tuple[str, float, str]] = []
    decode = max((g for g in graphs if g["kind"] == "decode"), key=lambda g: g["argument_bytes"], default=None)
    if decode:
        rows.append(("sampler weights + KV cache", decode["argument_bytes"], f"{decode['graph']} arguments"))
        rows.append(("sampler step outputs", decode["output_bytes"], f"{decode['graph']} outputs"))
    sampler = [g for g in graphs if g["kind"] in SAMPLER_KINDS]
    if sampler:
        top = max(sampler, key=lambda g: g["temp_bytes"])
        rows.append(("sampler temporaries", top["temp_bytes"], f"{top['graph']} temporaries (the largest)"))
    return rows


def _log_prob_forward_rows(graphs: list[dict]) -> list[tuple[str, float, str]]:
    """XLA's number for the plan's no-grad log-prob forward: one block's and the LM head's outputs and temporaries
    (one at a time), at the micro batch shape where their sum is largest (of several kinds of block, the largest
    one's); ``[]`` when no shape has both a block_forward and an lm_head_forward graph."""
    block_forward = {
        shape: max(kinds, key=lambda g: g["output_bytes"] + g["temp_bytes"])
        for shape, kinds in _by_shape(graphs, "block_forward").items()
    }
    pairs = [(block_forward.get(_shape_of(g["graph"])), g) for g in graphs if g["kind"] == "lm_head_forward"]
    pairs = [(b, h) for b, h in pairs if b]
    if not pairs:
        return []
    b, h = max(pairs, key=lambda bh: sum(g["output_bytes"] + g["temp_bytes"] for g in bh))
    return [
        (
            "log-prob forward",
            sum(g["output_bytes"] + g["temp_bytes"] for g in (b, h)),
            f"{b['graph']} and {h['graph']} outputs + temporaries",
        )
    ]


def _critic_rows(graphs: list[dict], layers: int, checkpointed: bool) -> list[tuple[str, float, str]]:
    """XLA's number for the plan's critic activations: the saved activations (:func:`saved_activations`) of the
    block forward graphs at the first value head's shape, plus that value head forward's outputs; ``[]`` without
    both."""
    value = _first_shape_graph(graphs, "value_head", ".fwd")
    cfwd = value and _by_shape(graphs, "block", ".fwd").get(_shape_of(value["graph"]))
    if not cfwd:
        return []
    return [
        (
            "critic activations",
            saved_activations(cfwd, layers, checkpointed) + value["output_bytes"],
            f"as activations, from {', '.join(g['graph'] for g in cfwd)}, + {value['graph']} outputs",
        )
    ]


def plan_comparison(plan, compiled: dict, checkpointed: bool) -> list[tuple[str, float | None, float | None, str]]:
    """The memory plan (:mod:`verl_backend.driver.memory_plan`) beside XLA's compiled bytes, term by term:
    ``[(term, plan bytes, XLA bytes, what XLA's number is)]``. Each row with an XLA number is a quantity of the
    compiled graphs the plan computes from the model's shapes (``MemoryPlan.graphs``: the arrays of
    :meth:`~verl_backend.driver.model_shape.ModelShape.block_graph` and its siblings, each sized as the TPU lays it
    out); the plan's terms in no graph (:data:`IN_NO_GRAPH`) follow with XLA ``None``."""
    graphs = [g for g in compiled.get("graphs", []) if not g.get("error")]
    layers = getattr(plan.model, "layers", 1)
    planned = dict(plan.graphs)
    fwd, bwd = _first_shape_graph(graphs, "block", ".fwd"), _first_shape_graph(graphs, "block", ".bwd")
    hf, hb = _first_shape_graph(graphs, "lm_head", ".fwd"), _first_shape_graph(graphs, "lm_head", ".bwd")
    xla = (
        _update_rows(plan, fwd, bwd, checkpointed)
        + _lm_head_rows(hf, hb)
        + _sampler_rows(graphs)
        + _log_prob_forward_rows(graphs)
        + _critic_rows(graphs, layers, checkpointed)
    )
    out = [(name, planned[name], number, how) for name, number, how in xla if name in planned]
    compared = {name for name, *_ in out}
    for term in plan.terms:
        why = next((v for k, v in IN_NO_GRAPH.items() if term.name.startswith(k)), None)
        if why is not None and term.name not in compared:
            out.append((term.name, term.bytes, None, why))
    return out
