"""The CPU backend's host-memory machinery, together: what keeps a CPU job's processes small.

- :mod:`.heap` glibc malloc settings, heap trims and the garbage collector's freeze (every CPU process);
- :mod:`.fork_server` the fork server: the ``verl train`` process starts it (:func:`~.fork_server.fork_here`,
  :func:`~.fork_server.stop`, :func:`~.fork_server.worker_py_executable`), it runs forked from that process, and each
  local Ray worker is a child of it until it becomes the worker;
- :mod:`.fork_client` the Ray worker command that asks the fork server for a child (run as a script: standard library
  only);
- :mod:`.plain_module` one CPU rank trained unwrapped, without FSDP2's copies (trainer workers).

Nothing here imports :mod:`verl_backend.driver` (``tests/test_layers.py``).
"""
