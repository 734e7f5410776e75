"""Every patch rl-tpu makes to a library, one module per library, each a :class:`~.record.Patch` record.

- :mod:`verl_backend.patches.verl`: VeRL 0.9.1 (platform, critic, metrics file, process group, preemption hook,
  rollout registration);
- :mod:`verl_backend.patches.transfer_queue`: TransferQueue 0.1.11's thread cap;
- :mod:`verl_backend.patches.fsdp2_internals`: not a patch but the private FSDP2 names (torch 2.13) the shared-memory
  weights read and rebind, with their version range; outside it that weight sync falls back to the object store.

The plugin calls :func:`apply` in every process that imports VeRL: it refuses a patched library outside its tested
range in one line (:class:`~.record.UnsupportedVersionError`, a :class:`~verl_backend.errors.BadInputError`), then
applies each patch when the process imports the patch's module (post-import hooks; a module already imported is
patched at once).
"""

from __future__ import annotations

from collections.abc import Mapping

from verl_backend.patches import transfer_queue as _transfer_queue
from verl_backend.patches import verl as _verl
from verl_backend.patches.record import Patch, UnsupportedVersionError

PATCHES: tuple[Patch, ...] = _verl.PATCHES + _transfer_queue.PATCHES

__all__ = ["PATCHES", "Patch", "UnsupportedVersionError", "apply", "check_versions"]

_applied = False
_checked = False  # the installed versions passed check_versions


def check_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """Refuse, in one line, a patched library installed outside its patches' tested range.

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

    check(PATCHES, installed)
    _checked = _checked or installed is None


def apply() -> None:
    """Check the versions (:func:`check_versions`), then apply every patch once its module is imported (idempotent).

    Uses post-import hooks (``wrapt.register_post_import_hook``): a module already imported is patched at once.
    """
    global _applied
    if _applied:
        return
    check_versions()
    import wrapt

    for patch in PATCHES:
        wrapt.register_post_import_hook(patch.apply, patch.module)
    _applied = True
