"""Every touch point of another library in ``rl_tpu`` (:func:`records`), each a :class:`~.record.Patch` record with
its version range, reason and upstream; the record type itself (:mod:`.record`) is shared by ``verl_backend`` and
``edge_export``.

- :mod:`rl_tpu.patches.torch_internals`: oneDNN's packed linear ops, the dispatch-mode escape of the op counters;
- :mod:`rl_tpu.patches.transformers_internals`: the modeling modules' ``apply_rotary_pos_emb``.

Also here, though only ``verl_backend`` calls it: :mod:`rl_tpu.patches.ray_internals`, Ray's actor table, internal
key-value store and undecorated actor class. The shared :mod:`verl_backend.errors` reads the key-value store, and an
import may not go up a layer, so the module sits at the bottom; its records are checked with VeRL's
(:data:`verl_backend.patches.RECORDS`), not in :func:`records`.

Nothing here is replaced: these records only read names, and each accessor checks the installed version first.
Importing this package imports neither torch nor transformers (the VeRL plugin imports the record type from here).
"""

from __future__ import annotations

from rl_tpu.patches.record import Patch, UnsupportedVersionError

__all__ = ["Patch", "UnsupportedVersionError", "records"]


def records() -> tuple[Patch, ...]:
    """Every record of ``rl_tpu``'s touch points (imports torch)."""
    from rl_tpu.patches import torch_internals, transformers_internals

    return torch_internals.RECORDS + transformers_internals.RECORDS
