"""The exception type for input a user can fix, shared by every layer (``verl``, ``litert``, ``rl-tpu`` print it as
one line).

It lives here, at the bottom of the import order, so that :mod:`rl_tpu.patches.record` (whose
:class:`~rl_tpu.patches.record.UnsupportedVersionError` is one) can be used by ``verl_backend``, ``edge_export`` and
``ray_cluster`` alike; :mod:`verl_backend.errors` re-exports it.
"""

from __future__ import annotations


class BadInputError(ValueError):
    """Input a user can fix. The message names the input, where it is (file/row, config key) and the fix."""
