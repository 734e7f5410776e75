"""The patch record and its version check, defined in :mod:`rl_tpu.patches.record` (below every layer, so
``edge_export`` and ``rl_tpu`` use the same one) and re-exported here for the worker side's patches."""

from __future__ import annotations

from rl_tpu.patches.record import (  # noqa: F401
    MARK,
    Patch,
    UnsupportedVersionError,
    attribute_check,
    check_versions,
    installed_version,
    is_marked,
    mark,
    names_check,
    problems,
    resolve,
    searched,
    wrap,
)
