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
   each graph's ``copy_s`` (:class:`GraphStats`)).

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
from dataclasses import dataclass
from pathlib import Path

NAME = "tpu-on-cpu"
#: the environment of a process that loads libtpu without a chip: no cloud metadata server wait, quieter libtpu, and no
#: libtpu lockfile (/tmp/libtpu_lockfile), which would refuse any other such process on the machine (the lowering
#: servers of a host's ranks, the dry run's compile check, --aot-only)
LIBTPU_QUIET_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "PYTHONWARNINGS": "ignore",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "TPU_STDERR_LOG_LEVEL": "3",
    "TPU_MIN_LOG_LEVEL": "3",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
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
            [self.python, "-m", SERVER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, **LIBTPU_QUIET_ENV},
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
    """What one graph did in this process: its name (``<region>.<part><n>``), region, part (``fwd`` and ``bwd``: a training
    graph's forward and backward, ``inf``: a graph run without gradients), the region's own tensor inputs (``{name: shape}``, parameters left out:
    :func:`region_inputs`), its cache key (graph code, input shapes and dtypes, constants), how it runs
    (``xla-cpu`` or ``eager: <reason>``), whether its StableHLO came from the cache, and wall seconds: lowering,
    XLA:CPU compile, execution (``run_s``, over ``runs`` calls) and the DLPack hand-overs (``copy_s``)."""

    name: str
    region: str
    part: str
    inputs: dict
    key: str = ""
    lowered: str = "xla-cpu"
    cached: bool = False
    lower_s: float = 0.0
    compile_s: float = 0.0
    runs: int = 0
    run_s: float = 0.0
    copy_s: float = 0.0


#: every graph compiled in this process, in order
GRAPHS: list[GraphStats] = []
#: XLA:CPU executables of this process by cache key
_EXECUTABLES: dict[str, object] = {}
_SAID: set[str] = set()


def region_inputs(gm, example_inputs) -> dict:
    """The shapes of a dynamo graph's own tensor inputs, ``{name: [dims]}``: its placeholders less the parameters
    and buffers dynamo lifted (their names hold ``_parameters_`` / ``_buffers_``), e.g. ``{"L_ids_": [8, 1],
    "L_mask_": [8, 80], ...}`` for a decode step or ``{"L_hidden_states_": [1, 128, 576], ...}`` for a block."""
    import torch

    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = {}
    for name, value in zip(names, example_inputs):
        if isinstance(value, torch.Tensor) and "_parameters_" not in name and "_buffers_" not in name:
            out[name] = [int(d) for d in value.shape]
    return out


def _write_stats(cache_dir: Path) -> None:
    """This process's :data:`GRAPHS` to ``<cache_dir>/stats/<host>-<pid>.json`` (atomically; what the TPU dry run's
    driver reads at the end of the run)."""
    import json
    import socket
    from dataclasses import asdict

    folder = Path(cache_dir) / "stats"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{socket.gethostname()}-{os.getpid()}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps([asdict(g) for g in GRAPHS]))
        os.replace(tmp, path)
    except OSError:
        pass  # the counts are a report; a full disk must not stop the job


def _save_constants(constants: list, path: Path) -> None:
    """A graph's constants as a pickle of ``(dtype name, shape, raw bytes)``: not ``torch.save``, whose
    ``torch.load`` hands back meta tensors inside aot_autograd's compile (torch 2.13)."""
    import torch

    rows = [
        (
            str(c.dtype).removeprefix("torch."),
            list(c.shape),
            c.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
        )
        for c in constants
    ]
    path.write_bytes(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL))


def _load_constants(path: Path) -> list:
    """The constants :func:`_save_constants` wrote, as CPU tensors."""
    import torch

    out = []
    for dtype, shape, data in pickle.loads(path.read_bytes()):
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out.append(raw.view(getattr(torch, dtype)).reshape(shape).clone())
    return out


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


def _one_line(exc: BaseException) -> str:
    """``Type: first line (file:line)`` of ``exc``, the innermost frame of its traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}{where}"


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

    def __init__(self, region: str, python: str | None = None, cache_dir: Path | None = None, say=None):
        self.region = region
        self.python = python or aot_python_path()
        if self.python is None:
            raise RuntimeError(
                f"rl_tpu.compile_backend={NAME} needs torch-tpu 0.2.0 in {sys.prefix}-aot: make it with .ci/aot_venv"
            )
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.say = say or (lambda line: print(line, flush=True))
        self.table: dict = {}  # TorchTPU's decompositions, filled from the server at the first graph

    def __call__(self, gm, example_inputs):
        """Compile one region dynamo captured (``gm``, its ``example_inputs``) through aot_autograd; each of its
        graphs (forward, backward, inference) is lowered, compiled and run as the module docstring says."""
        from functorch.compile import min_cut_rematerialization_partition
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from rl_tpu.patches.torch_internals import aot_autograd

        if not self.table:
            self.table.update(self._server().decompositions())
        user_inputs = region_inputs(gm, example_inputs)
        backend = aot_autograd(
            fw_compiler=self._compiler("fwd", user_inputs),
            bw_compiler=self._compiler("bwd", user_inputs),
            inference_compiler=self._compiler("inf", user_inputs),
            decompositions=self.table,
            partition_fn=min_cut_rematerialization_partition,
        )
        # SDPA as math (matmuls, a mask, a softmax; its backward derived from them), traced here: on a CPU tensor SDPA
        # would be the CPU flash kernel, which TorchTPU cannot lower. Math is the plain StableHLO TorchTPU's
        # OVERRIDEABLE SDPA backend lowers to; a chip's default is TorchTPU's Mosaic flash kernel instead (a
        # tpu_custom_call that XLA:CPU cannot run)
        with sdpa_kernel([SDPBackend.MATH]):
            return backend(gm, example_inputs)

    def _server(self) -> Lowering:
        if TpuOnCpu._lowering is None:
            TpuOnCpu._lowering = Lowering(self.python, self.cache_dir / f"serve-{os.getpid()}.log")
        return TpuOnCpu._lowering

    def _stablehlo(self, name: str, gm, specs: list, stats: GraphStats) -> tuple[str | None, list, str | None]:
        """``(StableHLO text, lifted constants, refusal line)`` of ``gm``, from the disk cache or the server."""
        import torch

        key = stats.key
        text_path, const_path = self.cache_dir / f"{key}.mlir", self.cache_dir / f"{key}.pt"
        if text_path.exists() and const_path.exists():
            stats.cached = True
            return text_path.read_text(), _load_constants(const_path), None
        reply = self._server().lower(name, gm, specs)
        stats.lower_s = reply["seconds"]
        if reply["error"]:
            return None, [], reply["error"]
        # plain tensors: a constant lifted from dynamo's graph may carry python attributes that do not pickle
        constants = [torch.empty(c.shape, dtype=c.dtype, device="cpu").copy_(c) for c in reply["constants"]]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for path, write in (
            (const_path, lambda p: _save_constants(constants, p)),
            (text_path, lambda p: p.write_text(reply["mlir"])),
        ):
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            write(tmp)
            os.replace(tmp, path)  # atomic: another rank reads the whole file or none
        return reply["mlir"], constants, None

    def _refuse(self, stats: GraphStats, line: str, gm):
        stats.lowered = f"eager: {line}"
        _write_stats(self.cache_dir)
        if line not in _SAID:
            _SAID.add(line)
            self.say(f"[rl-tpu] warning: {NAME}: {line}; that graph runs as torch eager")
        return gm

    def _compiler(self, part: str, user_inputs: dict):
        def compiler(gm, example_inputs):
            specs = _specs(example_inputs)
            name = f"{self.region}.{part}{sum(g.region == self.region and g.part == part for g in GRAPHS)}"
            stats = GraphStats(name, self.region, part, user_inputs, key=_key(gm, specs))
            GRAPHS.append(stats)
            _write_stats(self.cache_dir)
            if any(s[0] == "value" and not isinstance(s[1], (int, float, bool)) for s in specs):
                return self._refuse(stats, f"graph {name} takes a non-tensor input", gm)
            try:
                text, constants, refusal = self._stablehlo(name, gm, specs, stats)
            except Exception as exc:  # the server died, the cache unreadable: this graph eager, the job goes on
                refusal = f"graph {name} not lowered: {_one_line(exc)}"
            if refusal:
                return self._refuse(stats, refusal, gm)
            xla = _XlaCpu.get()
            t0 = time.perf_counter()
            new = stats.key not in _EXECUTABLES
            try:
                exe = _EXECUTABLES.get(stats.key) or xla.compile(text)  # 30 blocks of one code: one executable
                _EXECUTABLES[stats.key] = exe
            except Exception as exc:
                return self._refuse(stats, f"XLA:CPU cannot compile graph {name}: {_one_line(exc)}", gm)
            stats.compile_s = time.perf_counter() - t0
            try:
                run = self._runner(exe, xla, gm, constants, stats)
            except Exception as exc:
                return self._refuse(stats, f"graph {name} not set up on XLA:CPU: {_one_line(exc)}", gm)
            shapes = ", ".join(
                f"{k.lower().removeprefix('l_').rstrip('_')} {'x'.join(map(str, v))}"
                for k, v in list(user_inputs.items())[:3]
            )
            if new:  # train.log only (the console shows rl-tpu's warnings): one line per graph this process compiled
                self.say(
                    f"[rl-tpu] {NAME}: graph {name} ({shapes}; {len(specs)} inputs) "
                    + ("from the StableHLO cache" if stats.cached else f"lowered by TorchTPU in {stats.lower_s:.1f} s")
                    + f", compiled by XLA:CPU in {stats.compile_s:.1f} s"
                )
            return run

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
        cache_dir = self.cache_dir
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
            jax.block_until_ready(outs)  # execute only dispatches: without the wait, the execution's time would be
            t2 = time.perf_counter()  # counted in the first torch.from_dlpack, as a hand-over's
            tensors = iter(torch.from_dlpack(o) for o in outs)
            result = [next(tensors) if slot else None for slot in slots]
            t3 = time.perf_counter()
            stats.runs += 1
            stats.run_s += t2 - t1
            stats.copy_s += (t1 - t0) + (t3 - t2)
            _write_stats(cache_dir)
            return result

        return run


def compile_backend(name: str, region: str, cache_dir: str = ""):
    """The ``torch.compile`` backend for ``rl_tpu.compile_backend`` = ``name`` in ``region``: a :class:`TpuOnCpu`
    for ``tpu-on-cpu``, ``None`` for ``device`` (the caller's device backend).

    Raises:
        ValueError: an unknown ``name``.
        RuntimeError: ``tpu-on-cpu`` without torch-tpu (:class:`TpuOnCpu`).
    """
    if name == "device":
        return None
    if name == NAME:
        return TpuOnCpu(region, cache_dir=Path(cache_dir) if cache_dir else None)
    raise ValueError(f"rl_tpu.compile_backend={name!r}: use device or {NAME}")


def aggregate(rows: list[dict]) -> dict:
    """Graph counts over ``rows`` (:class:`GraphStats` as dicts, from one process or all of a run's):
    ``{"traced": graphs compiled, "distinct": distinct graphs (by cache key: the same code at the same shapes is
    one graph, as the chip's compilation cache makes it), "executions", "eager": graphs that ran as torch eager,
    "lower_s", "compile_s", "run_s", "copy_s" (seconds, summed), "by_kind": {"<region>.<part>": {"traced",
    "distinct", "executions"}}}``."""
    by_kind: dict[str, dict] = {}
    for row in rows:
        kind = by_kind.setdefault(f"{row['region']}.{row['part']}", {"traced": 0, "keys": set(), "executions": 0})
        kind["traced"] += 1
        kind["keys"].add(row["key"])
        kind["executions"] += row["runs"]
    return {
        "traced": len(rows),
        "distinct": len({row["key"] for row in rows}),
        "executions": sum(row["runs"] for row in rows),
        "eager": sum(row["lowered"] != "xla-cpu" for row in rows),
        **{k: sum(row[k] for row in rows) for k in ("lower_s", "compile_s", "run_s", "copy_s")},
        "by_kind": {
            k: {"traced": v["traced"], "distinct": len(v["keys"]), "executions": v["executions"]}
            for k, v in by_kind.items()
        },
    }
