"""The ``tpu-on-cpu`` compile backend: a job's compiled regions lowered as the chip lowers them, executed on the host.

``rl_tpu.compile_backend=tpu-on-cpu`` gives the trainer's compiled blocks (``rl_tpu.compile_trainer``) and the
sampler's prefill and decode steps (``rl_tpu.compile_sampler``) this ``torch.compile`` backend in place of the
device's (inductor on CPU). Each region dynamo captures goes through aot_autograd (forward, backward and inference
graphs, min-cut partitioning, as TorchTPU's own backend does); each graph is then

1. sent to the lowering server (:mod:`verl_backend.driver.aot.serve`, one process per worker, started from the
   interpreter that has torch-tpu, ``<venv>-aot``), which retraces it on the meta device with TorchTPU's
   decomposition table and lowers it to StableHLO with TorchTPU's kernels on TPU placeholders: the code
   ``--aot-only`` uses, so code past dynamo sees what the chip's compile sees;
2. compiled by XLA:CPU (jaxlib's cpu client, ``jax_enable_x64`` on so int64 stays int64);
3. executed with torch tensors in and out through DLPack (numpy has no bf16; no copy either way, measured in
   :func:`summary`'s ``copy_s``).

What differs from the chip: dynamo traces on CPU tensors, so model code that branches on the device type takes the
CPU branch (the TPU profile's choices that matter, such as ``batched_mm`` experts, come from the config, not the
device); attention is whatever the graph holds (the dry run's models use SDPA, which aot_autograd decomposes to
plain StableHLO math: the OVERRIDEABLE path, where the chip would run TorchTPU's Mosaic flash kernel).

**One cache.** StableHLO is cached on disk by (graph code, input shapes and dtypes, constants) in ``cache_dir``
(default ``~/.cache/rl-tpu/tpu-on-cpu``), written atomically, shared by every process of the host as the chip's
compilation cache is; the XLA:CPU executable is kept per process.

**Refusals.** A graph TorchTPU cannot lower, or XLA:CPU cannot compile, runs as torch eager (its aot_autograd graph,
same numbers as the eager job) and is said in one line naming the op and the graph, once: never a dead worker.

The backend imports neither torch-tpu nor jax until a graph is compiled, so the CPU job's import time and console are
unchanged when it is off.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NAME = "tpu-on-cpu"
SERVER_MODULE = "verl_backend.driver.aot.serve"  # run in the torch-tpu interpreter, never imported here


def read_message(stream):
    """One message of the lowering server's protocol (an 8-byte little-endian length, then a pickle) from a binary
    ``stream``; ``None`` at its end."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def write_message(stream, message) -> None:
    """One message of the lowering server's protocol to a binary ``stream``."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def graph_payload(gm) -> tuple[dict, str]:
    """``gm`` as :func:`torch.fx.graph_module.reduce_graph_module` takes it back: ``(body, import block)``, what
    ``GraphModule.__reduce__`` pickles (its generated code, tensors and module state), less the entries that do not
    pickle (dynamo's metadata holds weak references; the code does not read them). Reads torch.fx's private
    ``_format_import_block`` and ``sys_importer`` (torch 2.13)."""
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    python_code = gm.graph.python_code(root_module="self")
    body = {"_code": python_code.src}
    for key, value in gm.__dict__.items():
        if key in ("_graph", "_code"):
            continue
        try:
            pickle.dumps(value)
        except Exception:
            continue
        body[key] = value
    return body, _format_import_block(python_code.globals, sys_importer)


def aot_python_path() -> str | None:
    """The interpreter with torch-tpu and libtpu: ``<this venv>-aot/bin/python`` (what ``.ci/aot_venv`` makes), else
    this interpreter when torch-tpu is importable here (not imported), else ``None``."""
    from importlib.util import find_spec

    beside = Path(sys.prefix + "-aot") / "bin" / "python"
    if beside.exists():
        return str(beside)
    if find_spec("torch_tpu") is not None:
        return sys.executable
    return None


def default_cache_dir() -> Path:
    return Path(os.path.expanduser("~")) / ".cache" / "rl-tpu" / "tpu-on-cpu"


class Lowering:
    """The lowering server of this process (:mod:`verl_backend.driver.aot.serve`), started at the first graph.

    Args:
        python: the interpreter with torch-tpu (:func:`aot_python_path`).
        log: file the server's stderr goes to (TorchTPU's warnings stay off the job's console).

    Raises:
        RuntimeError: (from :meth:`lower`) the server died or did not start; its log's last line is named.
    """

    def __init__(self, python: str, log: Path):
        self.python = python
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.decomposition_names: list = []

    def _start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        err = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [self.python, "-m", SERVER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err
        )
        err.close()
        ready = self._read()
        if ready is None:
            raise RuntimeError(f"the TorchTPU lowering server did not start: {self._log_tail()}")
        self.decomposition_names = ready["decompositions"]

    def decompositions(self) -> dict:
        """TorchTPU's decomposition table as this process's functions (the server names them; they are torch's
        own, ``torch._refs.masked_fill`` and ``masked_fill_`` in TorchTPU 0.2.0): ``{OpOverload: function}``.

        Raises:
            RuntimeError: the table names a function outside torch (TorchTPU's own code, which this process lacks).
        """
        import importlib

        import torch

        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
        table = {}
        for op_name, module, qualname in self.decomposition_names:
            if not module.startswith("torch.") and module != "torch":
                raise RuntimeError(f"TorchTPU decomposes {op_name} with {module}.{qualname}, not a torch function")
            fn = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            namespace, name, overload = op_name.split(".")
            table[getattr(getattr(getattr(torch.ops, namespace), name), overload)] = fn
        return table

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"{lines[-1][:200] if lines else 'no output'} (log: {self.log})"

    def _read(self):
        return read_message(self.proc.stdout)

    def lower(self, name: str, gm, inputs: list) -> dict:
        """The server's reply for graph ``name`` (see :mod:`verl_backend.driver.aot.serve`)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            try:
                write_message(self.proc.stdin, {"name": name, "graph": graph_payload(gm), "inputs": inputs})
                reply = self._read()
            except (BrokenPipeError, OSError) as exc:
                reply, self.proc = None, None
                raise RuntimeError(f"the TorchTPU lowering server died: {self._log_tail()}") from exc
            if reply is None:
                self.proc = None
                raise RuntimeError(f"the TorchTPU lowering server died: {self._log_tail()}")
            return reply

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


@dataclass
class GraphStats:
    """What one graph cost and did in this process. Seconds are wall seconds."""

    name: str
    region: str
    part: str
    inputs: list
    lowered: str = "xla-cpu"  # or "eager: <reason>"
    cached: bool = False
    lower_s: float = 0.0
    compile_s: float = 0.0
    runs: int = 0
    run_s: float = 0.0
    copy_s: float = 0.0
    extra: dict = field(default_factory=dict)


#: every graph compiled in this process, in order
GRAPHS: list[GraphStats] = []
_SAID: set[str] = set()


def _specs(example_inputs) -> list:
    import torch

    specs = []
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            specs.append(("tensor", tuple(int(d) for d in t.shape), t.dtype))
        else:
            specs.append(("value", t))
    return specs


def _key(gm, specs: list) -> str:
    import torch

    h = hashlib.sha256(gm.code.encode())
    h.update(repr(specs).encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor):
                h.update(repr((node.target, tuple(value.shape), value.dtype)).encode())
                h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def _output_slots(gm) -> list[bool]:
    """For each output of ``gm``: whether it is a tensor the StableHLO returns (``False``: a ``None``)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    return [v is not None for v in values]


class _XlaCpu:
    """jaxlib's CPU client, made once per process."""

    _instance = None

    def __init__(self):
        import jax
        from jax.extend.backend import get_compile_options

        jax.config.update("jax_enable_x64", True)  # int64 inputs stay int64, as TorchTPU's graphs take them
        self.jax = jax
        self.device = jax.devices("cpu")[0]
        self.options = get_compile_options(num_replicas=1, num_partitions=1, device_assignment=(self.device,))

    @classmethod
    def get(cls) -> _XlaCpu:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def compile(self, text: str):
        from jax.extend.mlir import ir
        from jax.interpreters import mlir
        from jaxlib import xla_client as xc

        with mlir.make_ir_context():
            return self.device.client.compile_and_load(
                ir.Module.parse(text), executable_devices=xc.DeviceList((self.device,)), compile_options=self.options
            )


class TpuOnCpu:
    """A ``torch.compile`` backend (pass the instance as ``backend=``) for one compiled region (``region``: a name
    such as ``trainer.block`` or ``sampler``). See the module docstring.

    Args:
        region: the region's name, the prefix of each graph's name (``<region>.<fwd|bwd><n>``).
        python: the interpreter with torch-tpu (default :func:`aot_python_path`).
        cache_dir: the StableHLO cache (default :func:`default_cache_dir`).
        say: where the one-line refusals go (default ``print``).

    Raises:
        RuntimeError: no interpreter has torch-tpu (make ``.venv-aot`` with ``.ci/aot_venv``).
    """

    _lowering: Lowering | None = None  # one server per process, shared by the regions

    def __init__(self, region: str, python: str | None = None, cache_dir: Path | None = None, say=print):
        from functorch.compile import min_cut_rematerialization_partition

        from rl_tpu.patches.torch_internals import aot_autograd

        self.region = region
        self.python = python or aot_python_path()
        if self.python is None:
            raise RuntimeError(
                f"rl_tpu.compile_backend={NAME} needs torch-tpu 0.2.0 in {sys.prefix}-aot: make it with .ci/aot_venv"
            )
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.say = say
        self.table: dict = {}  # TorchTPU's decompositions, filled from the server at the first graph
        self.backend = aot_autograd(
            fw_compiler=self._compiler("fwd"),
            bw_compiler=self._compiler("bwd"),
            inference_compiler=self._compiler("fwd"),
            decompositions=self.table,
            partition_fn=min_cut_rematerialization_partition,
        )

    def __call__(self, gm, example_inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # SDPA as math (matmuls, a mask, a softmax; its backward derived from them), traced here: on a CPU tensor SDPA
        # would be the CPU flash kernel, which TorchTPU cannot lower. Math is the plain StableHLO TorchTPU's
        # OVERRIDEABLE SDPA backend lowers to; a chip's default is TorchTPU's Mosaic flash kernel instead (a
        # tpu_custom_call that XLA:CPU cannot run)
        if not self.table:
            self.table.update(self._server().decompositions())
        with sdpa_kernel([SDPBackend.MATH]):
            return self.backend(gm, example_inputs)

    def _server(self) -> Lowering:
        if TpuOnCpu._lowering is None:
            TpuOnCpu._lowering = Lowering(self.python, self.cache_dir / f"serve-{os.getpid()}.log")
        return TpuOnCpu._lowering

    def _stablehlo(self, name: str, gm, specs: list, stats: GraphStats) -> tuple[str | None, list, str | None]:
        """``(StableHLO text, lifted constants, refusal line)`` of ``gm``, from the disk cache or the server."""
        import torch

        key = _key(gm, specs)
        text_path, const_path = self.cache_dir / f"{key}.mlir", self.cache_dir / f"{key}.pt"
        if text_path.exists() and const_path.exists():
            stats.cached = True
            return text_path.read_text(), torch.load(const_path), None
        reply = self._server().lower(name, gm, specs)
        stats.lower_s = reply["seconds"]
        if reply["error"]:
            return None, [], reply["error"]
        # plain tensors: a constant lifted from dynamo's graph may carry python attributes that do not pickle
        constants = [torch.empty(c.shape, dtype=c.dtype).copy_(c) for c in reply["constants"]]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for path, write in (
            (const_path, lambda p: torch.save(constants, p)),
            (text_path, lambda p: p.write_text(reply["mlir"])),
        ):
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            write(tmp)
            os.replace(tmp, path)  # atomic: another rank reads the whole file or none
        return reply["mlir"], constants, None

    def _refuse(self, stats: GraphStats, line: str, gm):
        stats.lowered = f"eager: {line}"
        if line not in _SAID:
            _SAID.add(line)
            self.say(f"[rl-tpu] {NAME}: {line}; that graph runs as torch eager")
        return gm

    def _compiler(self, part: str):
        def compiler(gm, example_inputs):
            specs = _specs(example_inputs)
            name = f"{self.region}.{part}{sum(g.region == self.region and g.part == part for g in GRAPHS)}"
            stats = GraphStats(name, self.region, part, [s[1] if s[0] == "tensor" else s[1] for s in specs])
            GRAPHS.append(stats)
            if any(s[0] == "value" and not isinstance(s[1], (int, float, bool)) for s in specs):
                return self._refuse(stats, f"graph {name} takes a non-tensor input", gm)
            try:
                text, constants, refusal = self._stablehlo(name, gm, specs, stats)
            except Exception as exc:  # the server died, the cache unreadable: this graph eager, the job goes on
                refusal = f"graph {name} not lowered: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            if refusal:
                return self._refuse(stats, refusal, gm)
            xla = _XlaCpu.get()
            t0 = time.perf_counter()
            try:
                exe = xla.compile(text)
            except Exception as exc:
                line = (str(exc).strip().splitlines() or [""])[0][:200]
                return self._refuse(stats, f"XLA:CPU cannot compile graph {name}: {line}", gm)
            stats.compile_s = time.perf_counter() - t0
            shapes = " ".join("x".join(map(str, s[1])) for s in specs[:2] if s[0] == "tensor")
            self.say(
                f"[rl-tpu] {NAME}: graph {name} ({len(specs)} inputs, first {shapes}) "
                + ("from the StableHLO cache" if stats.cached else f"lowered by TorchTPU in {stats.lower_s:.1f} s")
                + f", compiled by XLA:CPU in {stats.compile_s:.1f} s"
            )
            return self._runner(exe, xla, gm, constants, stats)

        def boxed(gm, example_inputs):  # aot_autograd calls compiled graphs with one list of arguments
            from functorch.compile import make_boxed_func

            from rl_tpu.patches import torch_internals

            # aot_autograd calls its compilers under its fake tensor mode: the cache, the constants and the
            # executable are real
            with torch_internals.disable_current_modes():
                return make_boxed_func(compiler(gm, example_inputs))

        return boxed

    def _runner(self, exe, xla, gm, constants: list, stats: GraphStats):
        import torch

        jax = xla.jax
        slots = _output_slots(gm)
        const_args = [jax.device_put(jax.dlpack.from_dlpack(c.contiguous()), xla.device) for c in constants]

        def run(*args):
            t0 = time.perf_counter()
            inputs = [
                jax.dlpack.from_dlpack(a.detach().contiguous()) if isinstance(a, torch.Tensor) else jax.numpy.asarray(a)
                for a in args
            ]
            t1 = time.perf_counter()
            outs = exe.execute(inputs + const_args)
            t2 = time.perf_counter()
            tensors = iter(torch.from_dlpack(o) for o in outs)
            result = [next(tensors) if slot else None for slot in slots]
            t3 = time.perf_counter()
            stats.runs += 1
            stats.run_s += t2 - t1
            stats.copy_s += (t1 - t0) + (t3 - t2)
            return result

        return run


def compile_backend(name: str, region: str):
    """The ``torch.compile`` backend for ``rl_tpu.compile_backend`` = ``name`` in ``region``: a :class:`TpuOnCpu`
    for ``tpu-on-cpu``, ``None`` for ``device`` (the caller's device backend).

    Raises:
        ValueError: an unknown ``name``.
        RuntimeError: ``tpu-on-cpu`` without torch-tpu (:class:`TpuOnCpu`).
    """
    if name == "device":
        return None
    if name == NAME:
        return TpuOnCpu(region)
    raise ValueError(f"rl_tpu.compile_backend={name!r}: use device or {NAME}")


def summary() -> dict:
    """This process's graphs: ``{"graphs": [GraphStats as dicts], "distinct": n, "executions": n, "eager": n,
    "lower_s", "compile_s", "run_s", "copy_s"}`` (seconds, summed)."""
    from dataclasses import asdict

    rows = [asdict(g) for g in GRAPHS]
    for row in rows:
        row["inputs"] = [list(i) if isinstance(i, tuple) else i for i in row["inputs"]]
    return {
        "graphs": rows,
        "distinct": len(rows),
        "executions": sum(g.runs for g in GRAPHS),
        "eager": sum(g.lowered != "xla-cpu" for g in GRAPHS),
        **{k: sum(getattr(g, k) for g in GRAPHS) for k in ("lower_s", "compile_s", "run_s", "copy_s")},
    }
