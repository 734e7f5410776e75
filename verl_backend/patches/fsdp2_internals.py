"""The private FSDP2 names rl-tpu reads and rebinds, in one place, for the torch versions they were checked with.

Shared-memory weights (:func:`verl_backend.workers.engine.share_fsdp_parameters`) move every ``FSDPParam``'s sharded
storage into one shared-memory file in place, so the rollout server reads each optimizer step with no copy. torch
exposes no public way to do that (torch 2.13's ``FSDPModule`` offers ``unshard``/``reshard``/``set_*`` only), so these
private names of ``torch.distributed.fsdp._fully_shard`` are used, and only here:

- ``FSDPModule._get_fsdp_state()._fsdp_param_groups[i].fsdp_params``: the module's ``FSDPParam`` objects;
- ``FSDPParam._sharded_param_data``: the flat, padded local storage the all-gather reads;
- ``FSDPParam.sharded_param``: the ``DTensor`` ``Parameter`` the optimizer holds, and its ``_local_tensor``;
- ``FSDPParam._orig_size`` and ``padded_sharded_param_size``: the parameter's shape and its padded shard's.

Rebinding keeps the ``Parameter`` objects (the optimizer's references stay valid); FSDP2's lazy init keeps storage
that is already padded (``FSDPParam.reset_sharded_param``, torch 2.13). Outside :data:`TORCH_VERSIONS`, or when a
name is gone, :func:`fsdp_params` raises :class:`~rl_tpu.shared_weights.SharedWeightsError` with one line and the
engine falls back to the object-store sync, saying why (``[rl-tpu] weight sync route: ...``): never a silent wrong
weight. ``tests/verl_backend/patches/test_fsdp2_internals.py`` checks every name on a real ``fully_shard`` module.
"""

from __future__ import annotations

from importlib.metadata import version

import torch
from packaging.version import Version

from verl_backend.patches.record import Patch, searched

PARAM_NAMES = ("_sharded_param_data", "sharded_param", "_orig_size", "padded_sharded_param_size")


def _names_present(module) -> bool:
    """``applied`` of :data:`RECORD`: ``FSDPParam`` still declares the names read and ``FSDPModule`` the state
    getter (the tests also run :func:`fsdp_params` on a real ``fully_shard`` module)."""
    from torch.distributed.fsdp import FSDPModule

    declared = getattr(module.FSDPParam, "__annotations__", {})
    return (
        all(n in declared for n in PARAM_NAMES)
        and callable(getattr(FSDPModule, "_get_fsdp_state", None))
        and callable(getattr(module.FSDPParam, "reset_sharded_param", None))
    )


RECORD = Patch(
    target="torch.distributed.fsdp._fully_shard FSDPParam._sharded_param_data/sharded_param/_orig_size/"
    "padded_sharded_param_size, FSDPModule._get_fsdp_state()._fsdp_param_groups",
    module="torch.distributed.fsdp._fully_shard._fsdp_param",
    library="torch",
    versions=">=2.13,<2.14",
    why="shared-memory weights rebind each FSDPParam's sharded storage in place; FSDP2 has no public call for it",
    upstream=searched(
        "pytorch/pytorch", "FSDP2 public API access FSDPParam sharded parameter storage _sharded_param_data"
    ),
    apply=None,
    applied=_names_present,
)
RECORDS = (RECORD,)
TORCH_VERSIONS = RECORD.versions  # torch versions these names were checked with


def _refuse(why: str):
    from rl_tpu.shared_weights import SharedWeightsError

    return SharedWeightsError(
        f"shared-memory weights read FSDP2's private storage, {why}; the weights go through the object store instead"
    )


def check_torch(installed: str | None = None) -> None:
    """Raise :class:`~rl_tpu.shared_weights.SharedWeightsError` when torch is outside :data:`TORCH_VERSIONS`.

    Args:
        installed: the torch version to check instead of the installed one (a test's).
    """
    found = installed or version("torch")
    if not RECORD.supports(Version(found).base_version):
        raise _refuse(f"checked with torch {TORCH_VERSIONS} only, and torch {found} is installed")


def fsdp_params(module: torch.nn.Module) -> dict[int, object]:
    """Every ``FSDPParam`` of ``module``'s ``fully_shard`` modules, keyed by ``id()`` of its sharded ``Parameter``.

    Returns:
        ``{}`` for a module without ``fully_shard`` (the unwrapped one-rank module).
    Raises:
        rl_tpu.shared_weights.SharedWeightsError: torch outside :data:`TORCH_VERSIONS`, or a private name missing.
    """
    from torch.distributed.fsdp import FSDPModule

    wrapped = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not wrapped:
        return {}
    check_torch()
    found = {}
    try:
        for m in wrapped:
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    missing = [n for n in PARAM_NAMES if not hasattr(fp, n)]
                    if missing:
                        raise _refuse(f"and FSDPParam lacks {', '.join(missing)} in this torch")
                    found[id(fp.sharded_param)] = fp
    except AttributeError as exc:
        raise _refuse(f"and this torch lacks one of its names ({exc})") from None
    return found


def is_whole(fp) -> bool:
    """Whether ``fp``'s local shard is the whole parameter, unpadded (one rank)."""
    return tuple(fp.padded_sharded_param_size) == tuple(fp._orig_size)


def shapes(fp) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(parameter shape, padded local shard shape)`` of ``fp``."""
    return tuple(fp._orig_size), tuple(fp.padded_sharded_param_size)


def local_storage(fp) -> torch.Tensor:
    """``fp``'s local storage viewed in the parameter's shape (a whole, unpadded shard: see :func:`is_whole`)."""
    return fp._sharded_param_data.view(fp._orig_size)


def rebind(fp, view: torch.Tensor) -> None:
    """Make ``view`` (the parameter's shape, same dtype) the storage of ``fp``: what the optimizer updates and the
    all-gather reads. The caller has copied the values in."""
    fp._sharded_param_data = view.view(-1)
    fp.sharded_param._local_tensor = view
