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
from importlib.util import find_spec
from pathlib import Path

from verl_backend.errors import BadInputError

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
# second process on the machine (two --aot-only runs, a test beside a run) although none of them opens a chip
_QUIET = {"TPU_SKIP_MDS_QUERY": "1", "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3",
          "TPU_STDERR_LOG_LEVEL": "3", "TPU_MIN_LOG_LEVEL": "3", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


class AotError(BadInputError):
    """Ahead-of-time lowering or compiling could not run or failed; the message is one line."""


def aot_python() -> str:
    """The interpreter with torch-tpu and libtpu: ``<this venv>-aot/bin/python`` (what ``.ci/aot_venv`` makes), else
    this interpreter when torch-tpu is importable here (not imported).

    Raises:
        AotError: none has torch-tpu.
    """
    beside = Path(sys.prefix + "-aot") / "bin" / "python"
    if beside.exists():
        return str(beside)
    if find_spec("torch_tpu") is not None:
        return sys.executable
    raise AotError(f"--aot-only needs torch-tpu 0.2.0 and libtpu 0.0.52, in {sys.prefix}-aot (make it with "
                   "`.ci/aot_venv`, the `aot` extra) or this environment (`pip install -e '.[aot]'`)")


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
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                                  start_new_session=True,
                                  preexec_fn=_die_with_parent if linux else None)
        except subprocess.TimeoutExpired:
            raise AotError(f"{what} took longer than {timeout_s:.0f} s and was stopped; its output is in {log}") \
                from None
    if proc.returncode != 0:
        how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with code {proc.returncode}")
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or [""]
        raise AotError(f"{what} {how}: {tail[0].strip()[:200]} (output: {log})")


@dataclasses.dataclass
class AotResult:
    """What :func:`lower_and_compile` found: ``lowered`` records (:mod:`.lower`), ``compiled`` per topology
    (:mod:`.compile`), and the folder holding the StableHLO files and logs."""

    lowered: list[dict]
    compiled: dict[str, dict]
    folder: Path


def lower_and_compile(jobs: list[dict], topologies: list[str], folder: Path | None = None,
                      python: str | None = None, lower_timeout_s: float = LOWER_TIMEOUT_S,
                      compile_timeout_s: float = COMPILE_TIMEOUT_S) -> AotResult:
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
    _run([python, "-m", "verl_backend.driver.aot.lower", str(spec)], "TorchTPU's lowering (subprocess)",
         lower_timeout_s, folder / "lower.log", _env())
    lowered = json.loads((folder / "lowered.json").read_text())
    compiled = {}
    for topo in topologies:
        out = folder / f"compiled-{topo.replace(':', '_')}.json"
        _run([python, "-m", "verl_backend.driver.aot.compile", str(folder / "lowered.json"), topo, str(out)],
             f"libtpu's compile for {topo} (subprocess)", compile_timeout_s,
             folder / f"compile-{topo.replace(':', '_')}.log", _env({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}))
        compiled[topo] = json.loads(out.read_text())
    return AotResult(lowered, compiled, folder)


def errors(result: AotResult) -> list[str]:
    """Every one-line failure in ``result``: graphs not lowered, topologies refused, graphs not compiled."""
    lines = [r["error"] for r in result.lowered if r.get("error")]
    for topo in result.compiled.values():
        if topo.get("error"):
            lines.append(topo["error"])
        lines += [g["error"] for g in topo.get("graphs", []) if g.get("error")]
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
        rows.append((name, f"{g['compile_s']:.2f}", _gib(g["argument_bytes"]), _gib(g["output_bytes"]),
                     _gib(g["temp_bytes"]), f"{g['generated_code_bytes'] / 2**20:.1f}", f"{g['flops'] / 1e9:.2f}",
                     f"{g['bytes_accessed'] / 1e9:.3f}", f"{bound:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def per_chip_bytes(compiled: dict, layers: int, checkpointed: bool = False) -> dict[str, int]:
    """The training step's HBM per chip from XLA's numbers: without gradient checkpointing every block's forward
    keeps its outputs (what the backward reads) until the backward, so ``layers × block.fwd outputs``; with it, each
    block keeps only its input (the fwd graph's first argument, ``(batch, seq, hidden)``) and one block's forward
    outputs are live again while it is recomputed: ``layers × input + block.fwd outputs``. Plus the largest working
    set of one trainer graph (arguments + outputs + temporaries + code − aliased); and the sampler's largest graph.
    Returns ``{"saved_activations", "largest_trainer_graph", "largest_sampler_graph", "training_peak"}`` in bytes.
    Parameters, gradients and optimizer state held between graphs are the memory plan's terms, not here."""
    def working(g):
        return (g["argument_bytes"] + g["output_bytes"] + g["temp_bytes"] + g["generated_code_bytes"]
                - g.get("alias_bytes", 0))

    graphs = [g for g in compiled.get("graphs", []) if not g.get("error")]
    fwd = [g for g in graphs if g["kind"] == "block" and g["graph"].endswith(".fwd")]
    outputs = max((g["output_bytes"] for g in fwd), default=0)
    saved = layers * max((g.get("first_argument_bytes", 0) for g in fwd), default=0) + outputs if checkpointed \
        else layers * outputs
    trainer = max((working(g) for g in graphs if g["kind"] in ("block", "lm_head")), default=0)
    sampler = max((working(g) for g in graphs if g["kind"] in ("prefill", "decode")), default=0)
    return {"saved_activations": saved, "largest_trainer_graph": trainer, "largest_sampler_graph": sampler,
            "training_peak": saved + trainer}


def plan_comparison(plan, compiled: dict, checkpointed: bool) -> list[tuple[str, float, float, str]]:
    """The memory plan's terms (:mod:`verl_backend.driver.memory_plan`) beside XLA's compiled bytes, where the two
    count the same thing: ``[(term, plan bytes, XLA bytes, what XLA's number is)]``. The plan counts the unpadded
    ``prompt + response`` tokens and dense HBM; XLA the padded bucket (a power of two) and its tiled layouts (a
    bf16 array's last two dimensions padded to 16x128, f32's to 8x128)."""
    graphs = {g["graph"]: g for g in compiled.get("graphs", []) if not g.get("error")}
    out = []
    fwd = [g for g in graphs.values() if g["kind"] == "block" and g["graph"].endswith(".fwd")]
    layers = plan.model.layers if hasattr(plan.model, "layers") else None
    if fwd and layers:
        g = fwd[0]
        xla = (layers * g.get("first_argument_bytes", 0) + g["output_bytes"]) if checkpointed \
            else layers * g["output_bytes"]
        how = (f"{layers} x block input + one block's fwd outputs" if checkpointed
               else f"{layers} x block fwd outputs (saved for the backward)")
        out.append(("activations", plan.term("activations"), xla, how))
    head = [g for g in graphs.values() if g["kind"] == "lm_head" and g["graph"].endswith(".fwd")]
    if head:
        g = head[0]
        out.append(("LM head logits", plan.term("LM head logits"), g["output_bytes"] + g["temp_bytes"],
                    "lm_head fwd outputs + temporaries"))
    decode = [g for g in graphs.values() if g["kind"] == "decode"]
    if decode:
        g = max(decode, key=lambda g: g["argument_bytes"])
        out.append(("sampler weights + KV cache", plan.term("sampler weights") + plan.term("sampler KV cache"),
                    g["argument_bytes"], f"{g['graph']} arguments"))
    return out
