"""A fork server for the Ray workers of a local ``verl train --backend cpu`` job: they share one copy of the imports.

VeRL 0.9.1's trainer runs as eight Python processes (TaskRunner, trainer, rollout server, agent loop, reward loop,
load balancer, TransferQueue controller and storage). Each imports torch, VeRL, transformers, tensordict and
TransferQueue before it does any work: ~0.25-0.3 GiB of private memory per process (``Pss_Anon``;
``benchmarks/bench_process_floor.py``), 2.4 GiB for the job, and 10-15 CPU seconds each.

This server imports almost all of it once (:data:`PRELOAD`: everything but Ray and what imports Ray), freezes the
objects out of the garbage collector's reach (``gc.freeze``: a collection would otherwise write to every object and
un-share its page), and then forks one child per Ray worker. A child's pages stay shared with the server and its
siblings until written (copy-on-write), so what the imports built is held once. The idea is Android's zygote and the
``forkserver`` start method of :mod:`multiprocessing`; Ray itself has no such mode.

Ray starts each worker through the runtime environment's ``py_executable`` (:func:`worker_py_executable`): a tiny
client (:mod:`verl_backend.host_memory.fork_client`) that passes its arguments, environment, working directory and
standard streams over a Unix socket and stays as the worker's stand-in for the raylet (signals passed on, the child's
exit status returned). The child replaces its environment with the client's, re-seeds its random generators, and runs
Ray's ``default_worker.py`` as ``__main__``.

Only for local CPU runs: a worker on another host (a Ray cluster) starts as usual. ``rl_tpu.fork_server=false`` turns
it off.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path


# What VeRL's eight processes import to host their classes (benchmarks/bench_process_floor.py's roles), less Ray
# and what imports it (VeRL, TransferQueue, this package): Ray's core library reads the worker's job id from the
# environment once, when it is loaded (RayConfig), so it must be loaded by each worker itself, after the fork.
# These are ~95% of the import memory (372 of 391 MiB of Pss_Anon with VeRL).
PRELOAD = (
    "torch",
    "torch._dynamo",  # a private module: rl_tpu.patches.torch_internals.DYNAMO records it
    "torch.distributed.fsdp",
    "tensordict",
    "numpy",
    "pandas",
    "pyarrow",
    "datasets",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "omegaconf",
    "hydra",
    "reasoning_gym",
)


def worker_py_executable(socket_path: str | os.PathLike) -> str:
    """The Ray ``runtime_env`` ``py_executable`` that starts workers through the fork server at ``socket_path``."""
    client = Path(__file__).with_name("fork_client.py")
    return f"{sys.executable} -I -S {client} {socket_path} {sys.executable}"


# ------------------------------------------------------------------------------------------- the server
def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fork() -> int:
    """``os.fork()`` after flushing Python's stdout and stderr: else what this process printed but had not written
    yet would be written again by the child."""
    sys.stdout.flush()
    sys.stderr.flush()
    return os.fork()


def _preload(modules: list[str]) -> bool:
    """Import ``modules`` and freeze what exists out of the collector's reach; False if one of them imported Ray."""
    import gc
    import importlib

    for name in modules:
        importlib.import_module(name)
    if "ray" in sys.modules:  # see PRELOAD
        return False
    gc.collect()
    gc.freeze()
    return True


def _child(conn: socket.socket, request: dict, fds: list[int], inherited: list) -> None:
    """In the forked child: become the worker the client asked for. Never returns."""
    code = 1
    try:
        # Its own session and process group, as Ray gives a worker it starts: when a worker exits, the raylet
        # kills the worker's whole process group (its subprocesses), which would otherwise be the server's and
        # every other worker's.
        os.setsid()
        signal.set_wakeup_fd(-1)
        for other in inherited:  # the server's listener, wake-up pipe and its other children's connections
            try:
                other.close() if hasattr(other, "close") else os.close(other)
            except OSError:
                pass
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _reseed()
        _watch_client(conn)
        import runpy

        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must end here whatever happens
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reseed() -> None:
    """The fork copied the server's random states. Seed ``random``, numpy and torch with the job's seed (``job_seed``
    of the settings record in the worker's environment: VeRL's ``data.seed``), as every worker started by Ray without
    the fork server would be by torch's fixed default seed, so a run repeats; a job without a seed (or a worker
    without a record) is seeded from the OS's entropy."""
    import random

    seed = _job_seed()
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(None if seed is None else seed % 2**32)
    if "torch" in sys.modules:
        if seed is None:
            sys.modules["torch"].seed()
        else:
            sys.modules["torch"].manual_seed(seed)


def _job_seed() -> int | None:
    """``job_seed`` of the settings record (``verl_backend.settings.RECORD_ENV``) in this process's environment, or
    ``None``; parsed here, as the fork server keeps to :data:`PRELOAD` and the standard library."""
    try:
        seed = json.loads(os.environ.get("RL_TPU_SETTINGS") or "{}").get("job_seed")
    except (ValueError, AttributeError):
        return None
    return int(seed) if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 else None


def _watch_client(conn: socket.socket) -> None:
    """Kill this child when its client's connection closes (the client was killed: SIGKILL cannot be passed on)."""
    import threading

    def watch():
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rl-tpu-fork-client-watch", daemon=True).start()


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
    if len(head) != 8 or len(fds) != 3:
        raise OSError("malformed request")
    size = struct.unpack("!Q", head)[0]
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise OSError("client went away")
        body += chunk
    return json.loads(body), fds


def fork_here(preload: tuple[str, ...] = PRELOAD, folder: str | os.PathLike | None = None):
    """Import ``preload`` in this process, then fork the server from it: this process (``verl train``, which runs
    VeRL's TaskRunner) then shares the imports' pages with every worker too. Return ``(server pid, socket)``, or
    ``None`` when Ray is imported here (see :data:`PRELOAD`; the workers then start as plain processes).

    Call it while this process has one thread (before Ray, tokenizers or data loaders start theirs): a fork copies
    only the calling thread. Stop the server with :func:`stop`.
    """
    if "ray" in sys.modules:
        return None
    folder = Path(folder or tempfile.mkdtemp(prefix="rlz"))  # short: a Unix socket path must fit 107 bytes
    sock = folder / "fork.sock"
    if not _preload(list(preload)):
        return None
    listener = _listen(str(sock))
    pid = _fork()
    if pid == 0:
        try:
            _die_with_parent()
            os.setsid()
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's to handle, through `verl train`
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)  # not the terminal's stdin (each worker gets its client's)
            os.close(null)
            _serve(listener)
        finally:
            os._exit(0)
    listener.close()
    return pid, sock


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """End a server from :func:`fork_here` (SIGTERM, then SIGKILL after ``timeout_s`` seconds) and reap it."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _listen(sock_path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    return listener


def _serve(listener: socket.socket) -> None:
    children: dict[int, socket.socket] = {}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # delivered through the wakeup fd
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    while True:
        for key, _ in selector.select():
            if key.data == "reap":
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(struct.pack("!q", status))
                        except OSError:
                            pass
                        conn.close()
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _recv_request(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = _fork()
            if pid == 0:
                selector.close()
                _child(conn, request, fds, [listener, wake_r, wake_w, *children.values()])
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            try:
                conn.sendall(struct.pack("!q", pid))
            except OSError:
                pass
