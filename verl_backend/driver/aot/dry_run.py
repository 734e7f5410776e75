"""The TPU dry run's compile check (``--tpu-dry-run``, ``rl_tpu.tpu_dry_run_compile``): while the job trains on CPU
devices, the driver lowers the same job's graphs with TorchTPU and compiles them with libtpu for the fake slice's
chip and topology, the ``--aot-only`` code path (:func:`verl_backend.driver.aot.job.aot_jobs`,
:func:`verl_backend.driver.aot.run.lower_and_compile`) in a thread of the driver that only waits on its
subprocesses (they die with the driver: ``run._die_with_parent``).

The run folder gets ``aot/graphs.json`` (the (graph, input shapes) list, :func:`graphs.graph_list`, the list
``--aot-only`` lowers for the same composed config, written whether or not the check runs), the StableHLO and the
subprocesses' logs under ``aot/``; ``summary.json`` gets ``tpu_compile`` (:meth:`DryRunCompile.finish`), and the
console one line (:func:`compile_line`). The check never fails the training run: no torch-tpu is
``skipped: torch-tpu not installed (.ci/aot_venv)``, a lowering or compile that fails is ``failed: <one line>``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from verl_backend.driver.aot.graphs import graph_list
from verl_backend.driver.job_shape import job_shape
from verl_backend.driver.aot.run import (
    COMPILE_TIMEOUT_S,
    LOWER_TIMEOUT_S,
    AotError,
    aot_python,
    errors,
    jax_topology,
    lower_and_compile,
    per_chip_bytes,
)

SKIPPED_NO_TORCH_TPU = "skipped: torch-tpu not installed (.ci/aot_venv)"


def _one_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


class DryRunCompile:
    """The compile check of one dry run: :meth:`start` before training, :meth:`finish` after it.

    Args:
        config: the composed VeRL config (its model path has a ``config.json``).
        slice_name: the fake slice as resolved (``v6e-4:2x2``).
        out: the run folder; everything goes under ``out/aot``.
        enabled: ``rl_tpu.tpu_dry_run_compile``; off, only ``aot/graphs.json`` is written.
        python: the interpreter with torch-tpu (default :func:`run.aot_python`).
    """

    def __init__(
        self,
        config,
        slice_name: str,
        out: Path,
        enabled: bool = True,
        python: str | None = None,
        lower_timeout_s: float = LOWER_TIMEOUT_S,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
    ):
        self.slice_name, self.enabled, self.python = slice_name, enabled, python
        self.job = job_shape(config)  # the typed job the graph list, the lowering and the report read
        self.folder = Path(out) / "aot"
        self.timeouts = (lower_timeout_s, compile_timeout_s)
        self.entry: dict | None = None  # set when the check ended (or never started)
        self._thread: threading.Thread | None = None
        self._start = 0.0
        self._result = None
        self._error: str | None = None

    def start(self) -> "DryRunCompile":
        """Write ``aot/graphs.json`` and start lowering in the background (nothing starts when the check is off or
        cannot run: :attr:`entry` then says why)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        graphs = graph_list(self.job)
        (self.folder / "graphs.json").write_text(json.dumps(graphs, indent=1))
        self._base = {"slice": self.slice_name, "graphs": len(graphs), "graphs_file": str(self.folder / "graphs.json")}
        if not self.enabled:
            self.entry = {
                **self._base,
                "status": "off",
                "line": "off (rl_tpu.tpu_dry_run_compile=false): the graph list only, aot/graphs.json",
            }
            return self
        try:
            python = self.python or aot_python()
        except AotError:
            self.entry = {**self._base, "status": "skipped", "line": SKIPPED_NO_TORCH_TPU}
            return self
        try:
            from verl_backend.driver.aot.job import aot_jobs

            self.topology, self.generation, self.hbm_gib = jax_topology(self.slice_name)
            self.jobs = aot_jobs(self.job)
        except Exception as exc:  # no config.json, a slice libtpu has no name for: said, training goes on
            self.entry = {**self._base, "status": "failed", "line": f"failed: {_one_line(exc)}"}
            return self
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._work, args=(python,), name="rl-tpu-dry-run-compile", daemon=True)
        self._thread.start()
        return self

    def _work(self, python: str) -> None:
        try:
            self._result = lower_and_compile(
                self.jobs,
                [self.topology],
                self.folder,
                python=python,
                lower_timeout_s=self.timeouts[0],
                compile_timeout_s=self.timeouts[1],
            )
        except Exception as exc:  # AotError: a crash or timeout of a subprocess, one line
            self._error = _one_line(exc)
        self._seconds = time.perf_counter() - self._start

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finish(self, timeout_s: float | None = None) -> dict:
        """Wait for the check (at most ``timeout_s``) and return its ``summary.json`` entry:
        ``{"status": "compiled"|"failed"|"skipped"|"off", "line", "slice", "graphs", "graphs_file"}`` and, once it
        ran, ``topology``, ``seconds`` (lowering + compile, wall), ``waited_s`` (after training), ``lowered`` and
        ``compiled`` (graph counts), ``errors``, ``hbm_bytes`` and ``per_chip`` (:func:`run.per_chip_bytes`)."""
        if self.entry is not None:
            return self.entry
        waited = time.perf_counter()
        self._thread.join(timeout_s)
        waited = time.perf_counter() - waited
        if self._thread.is_alive():
            self.entry = {
                **self._base,
                "status": "failed",
                "topology": self.topology,
                "waited_s": waited,
                "line": f"failed: still lowering or compiling {timeout_s:.0f} s after training ended; "
                f"logs in {self.folder}",
            }
            return self.entry
        entry = {
            **self._base,
            "topology": self.topology,
            "seconds": self._seconds,
            "waited_s": waited,
            "folder": str(self.folder),
        }
        if self._error:
            self.entry = {**entry, "status": "failed", "line": f"failed: {self._error}"}
            return self.entry
        result = self._result
        compiled = result.compiled[self.topology]
        lowered = sum(1 for r in result.lowered if not r.get("error"))
        ok = sum(1 for g in compiled.get("graphs", []) if not g.get("error"))
        failed = errors(result)
        layers = int(self.jobs[0]["config"].get("num_hidden_layers", 1))
        chip = per_chip_bytes(compiled, layers, self.job.gradient_checkpointing) if not compiled.get("error") else {}
        hbm = self.hbm_gib * 2**30
        entry.update(
            lowered=lowered,
            compiled=ok,
            errors=failed,
            hbm_bytes=hbm,
            per_chip=chip,
            status="failed" if failed else "compiled",
        )
        total = len(result.lowered)  # lowered graphs: a block or LM head request is two (forward, backward)
        head = (
            f"{ok} of {total} graphs lowered by TorchTPU and compiled by libtpu for {self.slice_name} "
            f"({self.topology}), no chip"
        )
        if chip:
            head += (
                f"; per chip: training {chip['training_peak'] / 2**30:.2f} GiB of {self.hbm_gib:g} GiB HBM "
                f"({100 * chip['training_peak'] / hbm:.0f}%), largest sampler graph "
                f"{chip['largest_sampler_graph'] / 2**30:.2f} GiB "
                f"({100 * chip['largest_sampler_graph'] / hbm:.0f}%)"
            )
        head += f"; {self._seconds:.0f} s, {waited:.0f} s of it after training"
        if failed:
            head = f"failed: {head}; first failure: {failed[0]}"
        entry["line"] = head
        self.entry = entry
        return entry


def compile_line(entry: dict) -> str:
    """The console's line for a check's ``summary.json`` entry."""
    return f"[rl-tpu] TPU compile check: {entry['line']}"


def record(out: Path, entry: dict, key: str = "tpu_compile") -> None:
    """Put ``entry`` into ``out/summary.json`` as ``key`` (the file
    :func:`verl_backend.driver.report.write_report` wrote), atomically."""
    import os

    path = Path(out) / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary[key] = entry
    tmp = path.with_name(".summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, path)
