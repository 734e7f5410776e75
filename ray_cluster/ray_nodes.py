"""Ray nodes as processes we own: start ``ray start --block`` nodes and stop exactly them, by pid.

Each node is a child in its own session, tagged with a marker in its environment that every
process Ray spawns from it inherits (raylet, agents, workers, job drivers). Stopping signals the
recorded pids (checked against their start times, so a reused pid is never hit), their
descendants and the marked processes — never ``ray stop``, which ends every Ray process on the
machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from .errors import ClusterError

MARKER_ENV = "RL_TPU_FAKE_CLUSTER"


@dataclass
class NodeRecord:
    """One ``ray start --block`` process we started."""

    role: str  # "head" or "<slice name>/<worker id>"
    pid: int
    create_time: float  # psutil create_time, guards against pid reuse
    log: str
    resources: dict[str, float] = field(default_factory=dict)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def alive(rec: NodeRecord) -> psutil.Process | None:
    try:
        p = psutil.Process(rec.pid)
        if abs(p.create_time() - rec.create_time) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except psutil.Error:
        pass
    return None


def tagged_processes(marker: str) -> list[psutil.Process]:
    """Processes that carry our marker in their environment (same user only)."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(MARKER_ENV) == marker:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def node_command(
    ports: dict[str, int],
    *,
    head: bool,
    gcs: str,
    temp_dir: str,
    num_cpus: int,
    resources: dict[str, float],
    object_store_bytes: int,
    dashboard_port: int | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--num-cpus",
        str(num_cpus),
        "--num-gpus",
        "0",
        "--resources",
        json.dumps(resources),
        "--object-store-memory",
        str(object_store_bytes),
        "--node-manager-port",
        str(ports["node_manager"]),
        "--object-manager-port",
        str(ports["object_manager"]),
        "--metrics-export-port",
        str(ports["metrics"]),
        "--dashboard-agent-listen-port",
        str(ports["agent_http"]),
        "--dashboard-agent-grpc-port",
        str(ports["agent_grpc"]),
        "--runtime-env-agent-port",
        str(ports["runtime_env"]),
        "--disable-usage-stats",
        "--log-style",
        "record",
    ]
    if head:
        cmd += [
            "--head",
            "--port",
            gcs.rsplit(":", 1)[1],
            "--temp-dir",
            temp_dir,
            "--include-dashboard",
            "true",
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard_port),
            "--ray-client-server-port",
            str(ports["client"]),
        ]
    else:
        # A temp dir per node: nodes sharing one pick socket names by a racy "does it exist"
        # check, and two raylets starting together then collide ("bind: Address already in use").
        cmd += ["--address", gcs, "--temp-dir", temp_dir]
    return cmd


def spawn(cmd: list[str], env: dict[str, str], log: Path, role: str, resources: dict[str, float]) -> NodeRecord:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return NodeRecord(
        role=role, pid=proc.pid, create_time=psutil.Process(proc.pid).create_time(), log=str(log), resources=resources
    )


def tail(path: str, n: int = 5) -> str:
    try:
        lines = [l for l in Path(path).read_text(errors="replace").splitlines() if l.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return "(no log)"


@dataclass
class NodeLaunch:
    """How to start one node: ``command(ports, attempt)`` gives the argv."""

    role: str
    command: Callable[[dict[str, int], int], list[str]]  # (ports, attempt) -> argv
    env: dict[str, str]
    log_stem: Path
    resources: dict[str, float]
    attempt: int = 0


PORT_KEYS = ("node_manager", "object_manager", "metrics", "agent_http", "agent_grpc", "runtime_env", "client")
_STARTED = "Ray runtime started."


def start_nodes(
    launches: list[NodeLaunch],
    records: list[NodeRecord],
    on_change: Callable[[], None],
    deadline: float,
    parallel: int,
    attempts: int = 3,
) -> None:
    """Start ``launches`` at most ``parallel`` at a time; retry a node that dies while starting.

    Every process started is appended to ``records`` (a failed attempt is removed again) and
    ``on_change()`` is called, so the caller's state file always lists the live pids.

    ``ray start`` gives a node 30 s (hard-coded in Ray 2.60) to register with the GCS, and on a
    loaded 2-core machine the dashboard agent it waits for can take longer; a retry on fresh
    ports and a fresh temp dir usually goes through.
    """
    pending = list(launches)
    running: list[tuple[NodeLaunch, NodeRecord]] = []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            ports = dict(zip(PORT_KEYS, free_ports(len(PORT_KEYS))))
            log = job.log_stem.with_name(f"{job.log_stem.name}.{job.attempt}.log")
            rec = spawn(job.command(ports, job.attempt), job.env, log, job.role, job.resources)
            records.append(rec)
            on_change()
            running.append((job, rec))
        for job, rec in list(running):
            if _STARTED in Path(rec.log).read_text(errors="replace"):
                running.remove((job, rec))
            elif alive(rec) is None:
                running.remove((job, rec))
                records.remove(rec)
                job.attempt += 1
                if job.attempt >= attempts:
                    raise ClusterError(
                        f"Ray node {job.role} failed to start {attempts} times; last log {rec.log}: {tail(rec.log)}"
                    )
                pending.insert(0, job)
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Ray nodes {[j.role for j, _ in running]} not started in time; "
                f"logs beside {running[0][1].log if running else 'the head log'}"
            )
        time.sleep(0.3)
    on_change()


def stop_processes(records: list[NodeRecord], marker: str, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the recorded ``ray start`` parents, then SIGKILL whatever of theirs (descendants,
    processes carrying ``marker``) is left after ``grace_s``. Returns the pids signalled."""
    procs: dict[int, psutil.Process] = {}
    for rec in records:
        p = alive(rec)
        if p is not None:
            procs[p.pid] = p
            try:
                for c in p.children(recursive=True):
                    procs[c.pid] = c
            except psutil.Error:
                pass
    for p in tagged_processes(marker):
        procs.setdefault(p.pid, p)
    # Workers first would make the head log noise; ask the `ray start --block` parents to stop
    # their nodes cleanly, then everything that is left.
    for rec in reversed(records):
        if rec.pid in procs:
            try:
                procs[rec.pid].send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    _, left = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    # Stragglers Ray forked after we looked (worker processes) carry the marker too.
    late = [p for p in tagged_processes(marker) if p.pid not in procs]
    for p in late:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(late, timeout=5)
    return sorted(list(procs) + [p.pid for p in late])
