"""Heap probe for ``bench_memory_plan.py``: live C-heap bytes of every python process started with this folder on
``PYTHONPATH`` and ``RL_TPU_BENCH_HEAP_DIR`` set (a benchmark instrument, never part of a job).

Live bytes are glibc's ``mallinfo2()``: ``uordblks + hblkhd``, the bytes of every malloc'd block in use (all arenas)
plus every block malloc gave its own mmap (large tensors). Freed blocks glibc keeps are not counted, nor shared
libraries or files mapped from disk: on CPU this is what a device allocator's "allocated" figure is on an accelerator.
Sampled every ``INTERVAL_S`` in a daemon thread (restarted in a forked child); each process writes
``<dir>/<pid>.json`` (``{"pid", "argv0", "series": [[seconds since the epoch, bytes], ...]}``, one point per
``INTERVAL_S`` where the value moved by ``STEP_BYTES`` or more, plus each new peak) about once a second and at exit.
"""

import atexit
import ctypes
import json
import os
import sys
import threading
import time

INTERVAL_S = 0.05  # mallinfo2 walks the free lists under the arena locks: ~15% of a core per process at 0.01 s
STEP_BYTES = 8 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _start() -> None:
    folder = os.environ.get("RL_TPU_BENCH_HEAP_DIR")
    if not folder:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return
    pid = os.getpid()
    path = os.path.join(folder, f"{pid}.json")
    series: list[list[float]] = []
    state = {"last": -STEP_BYTES, "peak": 0, "written": 0.0}

    def live() -> int:
        m = libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)

    def write() -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"pid": pid, "argv0": (sys.argv or [""])[0], "series": list(series)}, fh)
        os.replace(tmp, path)

    def loop() -> None:
        while os.getpid() == pid:
            now, value = time.time(), live()
            if abs(value - state["last"]) >= STEP_BYTES or value > state["peak"]:
                series.append([now, value])
                state["last"], state["peak"] = value, max(state["peak"], value)
            if now - state["written"] >= 1.0:
                state["written"] = now
                try:
                    write()
                except OSError:
                    pass
            time.sleep(INTERVAL_S)

    threading.Thread(target=loop, daemon=True, name="rl-tpu-heap-probe").start()
    atexit.register(lambda: os.getpid() == pid and write())


_start()
os.register_at_fork(after_in_child=_start)
