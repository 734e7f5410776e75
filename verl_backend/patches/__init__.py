"""Every touch point of another library on the worker side, one module per library, each a
:class:`~rl_tpu.patches.record.Patch` record (range, reason, upstream or the search that found none, check).

Patches (:data:`PATCHES`, names replaced):

- :mod:`verl_backend.patches.verl`: VeRL 0.9.1 (platform, critic, metrics file, process group, preemption hook,
  rollout registration);
- :mod:`verl_backend.patches.transfer_queue`: TransferQueue 0.1.11's thread cap.

Names read, overridden or re-run, not replaced (:data:`RECORDS` adds them):

- :mod:`verl_backend.patches.verl_internals`: ``main_ppo.main``'s body, ``FSDPEngine``'s protected methods and flags;
- :mod:`rl_tpu.patches.ray_internals`: Ray's actor table, internal key-value store and undecorated actor class (in
  ``rl_tpu/patches/``, below the shared :mod:`verl_backend.errors` that reads the key-value store through it);
- :mod:`verl_backend.patches.fsdp2_internals`: the private FSDP2 names (torch 2.13) the shared-memory weights read and
  rebind; outside its range that weight sync falls back to the object store (checked there, not at start);
- :mod:`verl_backend.patches.torch_tpu_aot`: TorchTPU 0.2.0's lowering, in the ``--aot-only`` subprocess only.

The plugin calls :func:`apply` in every process that imports VeRL: it refuses a library of :data:`RECORDS` outside
its tested range in one line (:class:`~.record.UnsupportedVersionError`, a :class:`~verl_backend.errors.BadInputError`),
then applies each patch when the process imports the patch's module (post-import hooks; a module already imported is
patched at once).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rl_tpu.patches import ray_internals as _ray
from verl_backend.patches import transfer_queue as _transfer_queue
from verl_backend.patches import verl as _verl
from verl_backend.patches import verl_internals as _verl_internals
from verl_backend.patches.record import Patch, UnsupportedVersionError

PATCHES: tuple[Patch, ...] = _verl.PATCHES + _transfer_queue.PATCHES
RECORDS: tuple[Patch, ...] = PATCHES + _verl_internals.RECORDS + _ray.RECORDS  # checked when a VeRL process starts

__all__ = ["PATCHES", "RECORDS", "Patch", "UnsupportedVersionError", "apply", "check_versions"]

_applied = False
_checked = False  # the installed versions passed check_versions


def check_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """Refuse, in one line, a library of :data:`RECORDS` installed outside its records' tested range.

    Args:
        installed: library -> version to check instead of the installed versions (a test's fake one).

    Raises:
        UnsupportedVersionError: e.g. ``verl 0.9.2 is outside the tested range ==0.9.1 of rl-tpu's patch …;
            install verl==0.9.1``.
    """
    global _checked
    if installed is None and _checked:
        return
    from verl_backend.patches.record import check_versions as check

    check(RECORDS, installed)
    _checked = _checked or installed is None


def apply(features: Mapping[str, Callable] | None = None) -> None:
    """Check the versions (:func:`check_versions`), then apply every patch once its module is imported (idempotent).

    Uses post-import hooks (``wrapt.register_post_import_hook``): a module already imported is patched at once.

    Args:
        features: the rl-tpu features two patched VeRL methods run, by name
            (:data:`verl_backend.patches.verl.FEATURES`: ``resource_pools``, ``step_begin``), handed over by the
            plugin that owns them; given again, they replace the earlier ones.
    """
    global _applied
    _verl.FEATURES.update(features or {})
    if _applied:
        return
    check_versions()
    import wrapt

    for patch in PATCHES:
        wrapt.register_post_import_hook(patch.apply, patch.module)
    _applied = True
