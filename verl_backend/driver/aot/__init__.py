"""Ahead-of-time lowering and compiling of a TPU job's graphs on a machine without a chip (``verl train --aot-only``).

- :mod:`.graphs`: which graphs the job compiles, at which shapes (from the composed config);
- :mod:`.lower`: the lowering subprocess (TorchTPU, StableHLO);
- :mod:`.compile`: the compile subprocess (libtpu through JAX's compile-only client, per topology);
- :mod:`.run`: the driver side: subprocesses with timeouts, one-line errors, the table.
"""
