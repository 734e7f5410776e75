"""The Ray worker command when a fork server runs (:mod:`verl_backend.host_memory.fork_server`): standard library only,
so it starts in ~20 ms and holds ~5 MiB.

Ray starts every worker of the job as ``<runtime_env py_executable> default_worker.py ARGS``. With
``py_executable = "python -I -S fork_client.py SOCKET"`` this program asks the fork server at ``SOCKET`` for a
child that runs ``default_worker.py ARGS`` with this process's environment, working directory and stdin, stdout and
stderr, then stays as that worker's stand-in for whoever started it (Ray's raylet): it passes on the signals it
gets, and ends the way the child ends (its exit code, or the same signal). If it is killed (SIGKILL, which it cannot
pass on), the child notices its connection close and kills itself.

When the fork server cannot be reached it runs the worker itself (``exec python ARGS``): a plain Ray worker.
"""

import json
import os
import signal
import socket
import struct
import sys

CONNECT_TIMEOUT_S = 60.0  # connecting and sending: the server listens before Ray starts any worker
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _fallback(python: str, argv: list) -> None:
    os.execv(python, [python, *argv])


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def main() -> None:
    path, python, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(path)
        payload = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [struct.pack("!Q", len(payload))], [0, 1, 2])
        sock.sendall(payload)
        sock.settimeout(None)
        head = _read_exact(sock, 8)
    except OSError:
        head = b""
    if not head:  # no server (or it refused): be a plain worker
        sock.close()
        _fallback(python, argv)
    child = struct.unpack("!q", head)[0]

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for s in _FORWARDED:
        signal.signal(s, forward)
    status = _read_exact(sock, 8)  # the server writes the child's wait status when it is reaped
    if not status:  # the server died: the child cannot be waited for; end it
        forward(signal.SIGKILL, None)
        os._exit(1)
    code = struct.unpack("!q", status)[0]
    if os.WIFSIGNALED(code):
        sig = os.WTERMSIG(code)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(code) if os.WIFEXITED(code) else 1)


if __name__ == "__main__":
    main()
