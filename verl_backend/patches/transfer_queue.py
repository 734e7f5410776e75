"""TransferQueue's copy-thread cap, where its modules already read it (:data:`PATCHES`, :func:`apply_num_threads`).

TransferQueue reads ``TQ_NUM_THREADS`` once, at import. With VeRL's TaskRunner in the ``verl train`` process it may
be imported before the driver sets the variable, and Ray ships its storage actor's methods with this process's
module globals, so the value is set where it was already read (else every put and get warns that 8 threads exceed
the cores).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from verl_backend.patches.record import Patch, searched

VERSIONS = "==0.1.11"
MODULES = ("transfer_queue.client", "transfer_queue.storage.simple_storage")


def _threads() -> int | None:
    value = os.environ.get("TQ_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() else None  # anything else: TransferQueue's own int() names it


def _set_from_environment(module: ModuleType) -> None:
    threads = _threads()
    if threads is not None and hasattr(module, "TQ_NUM_THREADS"):
        module.TQ_NUM_THREADS = threads


def _matches_environment(module: ModuleType) -> bool:
    threads = _threads()
    return threads is None or getattr(module, "TQ_NUM_THREADS", threads) == threads


PATCHES: tuple[Patch, ...] = tuple(
    Patch(
        target=f"{name}.TQ_NUM_THREADS",
        module=name,
        library="TransferQueue",
        versions=VERSIONS,
        why="read from $TQ_NUM_THREADS once at import, before verl train sets it",
        upstream=searched(
            "TransferQueue/TransferQueue",
            "TQ_NUM_THREADS environment variable read at import",
            "the variable came with https://github.com/TransferQueue/TransferQueue/pull/152",
        ),
        apply=_set_from_environment,
        applied=_matches_environment,
    )
    for name in MODULES
)


def apply_num_threads() -> None:
    """Set ``$TQ_NUM_THREADS`` (already in ``os.environ``) in the TransferQueue modules this process imported."""
    for patch in PATCHES:
        module = sys.modules.get(patch.module)
        if module is not None:
            patch.apply(module)
