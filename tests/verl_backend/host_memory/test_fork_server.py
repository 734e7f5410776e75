"""The fork server that starts a local CPU job's Ray workers (verl_backend.host_memory.fork_server): real processes,
real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from verl_backend.host_memory import fork_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux only")

WORKER = textwrap.dedent("""
    import os, random, sys, time
    print(os.getcwd(), os.environ.get("ZT_VALUE"), random.random(), os.getpid(), "json" in sys.modules, flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    sys.exit(int(sys.argv[1]))
""")


# A stand-in for `verl train`: forks the server from itself, prints its socket, stops it on SIGTERM.
HOST = textwrap.dedent("""
    import os, signal
    from verl_backend.host_memory import fork_server

    pid, sock = fork_server.fork_here(preload=("json",))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print(sock, flush=True)
    signal.sigwait({signal.SIGTERM})
    fork_server.stop(pid)
    raise SystemExit(0 if not os.path.exists(f"/proc/{pid}") else 1)
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fork")
    script = folder / "worker.py"
    script.write_text(WORKER)
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    sock = host.stdout.readline().strip()
    assert sock, "the fork server did not start"
    yield fork_server.worker_py_executable(sock).split(), str(script)
    host.terminate()
    assert host.wait(timeout=30) == 0  # the server stopped and was reaped


def test_child_runs_with_the_clients_environment_directory_and_exit_code(server, tmp_path):
    cmd, script = server
    runs = [
        subprocess.run(
            [*cmd, script, "7"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
            env={**os.environ, "ZT_VALUE": f"v{i}"},
        )
        for i in range(2)
    ]
    fields = []
    for i, r in enumerate(runs):
        assert r.returncode == 7, r.stderr[-2000:]
        cwd, value, rand, pid, preloaded = r.stdout.split()
        assert (cwd, value, preloaded) == (str(tmp_path), f"v{i}", "True")
        fields.append((float(rand), int(pid)))
    assert fields[0][0] != fields[1][0]  # random states re-seeded after the fork


def test_signals_reach_the_child_and_the_client_ends_the_same_way(server):
    cmd, script = server
    client = subprocess.Popen([*cmd, script, "0", "60"], stdout=subprocess.PIPE, text=True)
    child = int(client.stdout.readline().split()[3])
    assert child != client.pid
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=30) == -signal.SIGTERM
    assert _gone(child)


def test_a_killed_client_takes_its_child_with_it(server):
    cmd, script = server
    client = subprocess.Popen([*cmd, script, "0", "60"], stdout=subprocess.PIPE, text=True)
    child = int(client.stdout.readline().split()[3])
    client.kill()  # SIGKILL cannot be passed on: the child sees its connection close
    client.wait(timeout=30)
    assert _gone(child)


def test_without_a_server_the_client_runs_the_worker_itself(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = fork_server.worker_py_executable(tmp_path / "no.sock").split()
    r = subprocess.run([*cmd, str(script), "5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 5 and r.stdout.split()[4] == "False", r.stderr[-2000:]


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True  # exited, waiting to be reaped by the server
        except (FileNotFoundError, ProcessLookupError):  # reaped between open and read
            return True
        time.sleep(0.1)
    return False


FORK_HERE = textwrap.dedent("""
    import os, subprocess, sys
    from verl_backend.host_memory import fork_server

    started = fork_server.fork_here(preload=("json",))
    assert started is not None
    pid, sock = started
    cmd = fork_server.worker_py_executable(sock).split()
    r = subprocess.run([*cmd, sys.argv[1], "4"], capture_output=True, text=True, timeout=60)
    print(r.returncode, r.stdout.strip(), os.getsid(pid) == pid)
    fork_server.stop(pid)
    print("stopped", not os.path.exists(f"/proc/{pid}"))
    import ray  # noqa: F401
    print("after ray", fork_server.fork_here(preload=("json",)))
""")


def test_fork_here_serves_from_the_calling_process_and_refuses_once_ray_is_imported(tmp_path):
    """`verl train` forks the server from itself (it then shares the imports' pages with every worker too)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = subprocess.run(
        [sys.executable, "-c", FORK_HERE, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    first, stopped, after = r.stdout.strip().splitlines()
    code, *fields, own_session = first.split()
    assert code == "4" and fields[4] == "True" and own_session == "True"  # json preloaded; out of the caller's session
    assert stopped == "stopped True"
    assert after == "after ray None"  # Ray's core library must be loaded after the fork (see fork_server.PRELOAD)


def test_each_child_leads_its_own_process_group_and_a_killed_one_ends_its_client_the_same_way(server):
    """Ray's raylet kills a dead worker's whole process group: a child sharing the server's group would take the
    server and every other worker with it."""
    cmd, script = server
    clients = [subprocess.Popen([*cmd, script, "0", "60"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    children = [int(c.stdout.readline().split()[3]) for c in clients]
    assert all(os.getpgid(child) == child for child in children)
    os.killpg(children[0], signal.SIGKILL)
    assert clients[0].wait(timeout=30) == -signal.SIGKILL  # the client ends as its child did
    assert clients[1].poll() is None and not _gone(children[1], timeout_s=1.0)  # the sibling is untouched
    clients[1].terminate()
    assert clients[1].wait(timeout=30) == -signal.SIGTERM


def test_children_of_a_seeded_job_draw_the_jobs_numbers(server, tmp_path):
    """The settings record's job_seed (VeRL's data.seed) seeds each forked worker, so a run repeats; another seed
    draws other numbers (without a seed the test above sees OS entropy)."""
    import random

    cmd, script = server

    def draw(seed: int) -> float:
        env = {**os.environ, "RL_TPU_SETTINGS": f'{{"job_seed": {seed}}}'}
        r = subprocess.run([*cmd, script, "0"], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        return float(r.stdout.split()[2])

    assert draw(5) == draw(5) == random.Random(5).random() != draw(6)


def _private_modules(names) -> list[str]:
    return [name for name in names if any(part.startswith("_") for part in name.split("."))]


def test_every_private_module_the_server_preloads_has_a_patch_record():
    """A private module imported by name (``torch._dynamo``) is a touch point like any other: a record names it,
    with its versions and upstream. Negative control: an unrecorded private module is found."""
    from rl_tpu.patches import torch_internals

    recorded = {record.module for record in torch_internals.RECORDS}
    private = _private_modules(fork_server.PRELOAD)
    assert private == ["torch._dynamo"], private
    assert [name for name in private if name not in recorded] == []
    assert [
        name for name in _private_modules((*fork_server.PRELOAD, "torch._inductor.fx_passes")) if name not in recorded
    ] == ["torch._inductor.fx_passes"]
