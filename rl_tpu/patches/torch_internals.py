"""The private torch names the sampler and the op counters use, in one place, with the torch versions they were
checked with (:data:`RECORDS`).

- oneDNN's packed linear (:data:`MKLDNN_LINEAR`): ``torch.ops.mkldnn._reorder_linear_weight`` packs a weight in
  oneDNN's blocked layout once, ``torch.ops.mkldnn._linear_pointwise`` multiplies by it (what TorchInductor's CPU
  weight prepacking emits); torch has no public op for either. The sampler's packed linear layers use them where its
  own AVX-512 kernel cannot run (:mod:`rl_tpu.sampler.panel_kernel`).
- ``torch.utils._python_dispatch``'s ``TorchDispatchMode`` and ``_disable_current_modes`` (:data:`DISPATCH_MODES`):
  the op counters (:mod:`rl_tpu.sampler.opcount`, :mod:`rl_tpu.train_opcount`) are a dispatch mode, count one launch
  per compiled graph and run the graph outside their own mode; torch has no public way to leave the modes in force.
- TorchDynamo's settings, errors and records (:data:`DYNAMO`): the compiled sampler and trainer blocks bound their
  recompiles (``torch._dynamo.config.patch(recompile_limit=...)``), fall back on ``torch._dynamo.exc``'s errors, name a
  string backend (``lookup_backend``) and read why a graph recompiled (``torch._dynamo.utils.guard_failures``).
- TorchInductor's compilers, cache switch and error (:data:`INDUCTOR`): the benchmarks count inductor's graphs through
  ``compile_fx(..., inner_compile=...)``, measure a fresh compile and name inductor's errors.
- AOT autograd as a backend (:data:`AOT_AUTOGRAD`): ``torch._dynamo.backends.common.aot_autograd`` and the boxed-call
  convention of its compilers (``fn._boxed_call = True``), for the counting backend and the TPU lowering.
- ``torch.utils._pytree`` (:data:`PYTREE`): ``tree_leaves`` / ``tree_flatten`` of nested outputs and arguments.
- A tensor's version counter and storage identity (:data:`TENSOR_IDENTITY`): ``tensor._version`` and
  ``untyped_storage()._cdata``, which tell the packed-weight caches that a weight changed in place or moved.
- FSDP1's wrapper attribute (:data:`FSDP1_WRAPPED`): ``FullyShardedDataParallel._fsdp_wrapped_module``, the module
  under VeRL's ``fsdp`` (FSDP1) strategy; read as VeRL itself reads it.

Every accessor checks torch's version first (:meth:`~rl_tpu.patches.record.Patch.check`): outside the range it
raises :class:`~rl_tpu.patches.record.UnsupportedVersionError` with one line.
"""

from __future__ import annotations

import contextlib

import torch

from rl_tpu.patches.record import Patch, names_check, searched

VERSIONS = ">=2.13,<2.14"  # the torch versions these names were checked with (pyproject pins torch==2.13.0)

MKLDNN_LINEAR = Patch(
    target="torch.ops.mkldnn._reorder_linear_weight + _linear_pointwise",
    module="torch",
    library="torch",
    versions=VERSIONS,
    why="oneDNN's packed linear (the sampler's fallback where its AVX-512 kernel cannot run) has no public op",
    upstream="https://github.com/pytorch/pytorch/pull/139387 (proposed a public pack_linear_weight; closed)",
    apply=None,
    applied=names_check("ops.mkldnn._reorder_linear_weight", "ops.mkldnn._linear_pointwise"),
)

DISPATCH_MODES = Patch(
    target="torch.utils._python_dispatch.{TorchDispatchMode,_disable_current_modes}",
    module="torch.utils._python_dispatch",
    library="torch",
    versions=VERSIONS,
    why="the op counters are a TorchDispatchMode and run a compiled graph outside it; neither is a public name",
    upstream="https://github.com/pytorch/pytorch/issues/105878 (no convenient API to disable a mode; "
    "_disable_current_modes named as the tool)",
    apply=None,
    applied=names_check("TorchDispatchMode", "_disable_current_modes"),
)

DYNAMO = Patch(
    target="torch._dynamo.{config.recompile_limit, exc.*, lookup_backend, utils.guard_failures}",
    module="torch._dynamo",
    library="torch",
    versions=VERSIONS,
    why="compiled sampling/training bound recompiles, catch Dynamo's errors and name why a graph recompiled; the "
    "CPU fork server preloads the module by name (verl_backend.host_memory.fork_server.PRELOAD)",
    upstream=searched(
        "pytorch/pytorch", "public API torch.compiler recompile_limit guard_failures TorchDynamoException"
    ),
    apply=None,
    applied=names_check(
        "config.recompile_limit",
        "config.accumulated_recompile_limit",
        "exc.RecompileError",
        "exc.TorchDynamoException",
        "exc.FailOnRecompileLimitHit",
        "lookup_backend",
        "utils.guard_failures",
    ),
)

AOT_AUTOGRAD = Patch(
    target="torch._dynamo.backends.common.aot_autograd + _boxed_call",
    module="torch._dynamo.backends.common",
    library="torch",
    versions=VERSIONS,
    why="the op-counting backend and the TPU lowering compile through AOT autograd, which torch exports privately",
    upstream=searched(
        "pytorch/pytorch", "aot_autograd public API custom backend torch._dynamo.backends.common _boxed_call"
    ),
    apply=None,
    applied=names_check("aot_autograd"),
)


def _inductor_names(module) -> bool:
    """``applied`` of :data:`INDUCTOR`: its submodules import and hold the names used."""
    import importlib

    for sub in ("compile_fx", "config", "exc"):
        importlib.import_module(f"{module.__name__}.{sub}")
    return names_check(
        "compile_fx.compile_fx", "compile_fx.compile_fx_inner", "config.force_disable_caches", "exc.InductorError"
    )(module)


INDUCTOR = Patch(
    target="torch._inductor.{compile_fx.compile_fx, compile_fx.compile_fx_inner, config.force_disable_caches, "
    "exc.InductorError}",
    module="torch._inductor",
    library="torch",
    versions=VERSIONS,
    why="the benchmarks count inductor's graphs, measure a fresh compile and report its errors; all private names",
    upstream=searched(
        "pytorch/pytorch", "public API compile_fx inner_compile count graphs inductor force_disable_caches"
    ),
    apply=None,
    applied=lambda module: _inductor_names(module),
)

PYTREE = Patch(
    target="torch.utils._pytree.{tree_leaves,tree_flatten}",
    module="torch.utils._pytree",
    library="torch",
    versions=VERSIONS,
    why="nested outputs and arguments are flattened with torch's own pytree, which is private",
    upstream="https://github.com/pytorch/pytorch/issues/65761 (torch.utils._pytree -> stable; open, "
    "https://github.com/pytorch/pytorch/pull/175082 proposes torch.utils.pytree)",
    apply=None,
    applied=names_check("tree_leaves", "tree_flatten"),
)

TENSOR_IDENTITY = Patch(
    target="torch.Tensor._version + UntypedStorage._cdata",
    module="torch",
    library="torch",
    versions=VERSIONS,
    why="packed-weight caches tell an in-place update (version counter) and a moved storage (its C pointer) apart",
    upstream=searched("pytorch/pytorch", "public API tensor version counter _version in-place modification"),
    apply=None,
    applied=lambda module: (
        hasattr(module.zeros(1), "_version") and hasattr(module.zeros(1).untyped_storage(), "_cdata")
    ),
)

FSDP1_WRAPPED = Patch(
    target="torch.distributed.fsdp.FullyShardedDataParallel._fsdp_wrapped_module",
    module="torch.distributed.fsdp._common_utils",
    library="torch",
    versions=VERSIONS,
    why="under VeRL's fsdp (FSDP1) strategy the trained module sits under this attribute; VeRL reads it the same way",
    upstream="https://github.com/pytorch/pytorch/issues/78607 (FSDP.module is public but also unwraps activation "
    "checkpointing; VeRL reads _fsdp_wrapped_module)",
    apply=None,
    applied=lambda module: getattr(module, "FSDP_WRAPPED_MODULE", None) == "_fsdp_wrapped_module",
)

RECORDS: tuple[Patch, ...] = (
    MKLDNN_LINEAR,
    DISPATCH_MODES,
    DYNAMO,
    AOT_AUTOGRAD,
    INDUCTOR,
    PYTREE,
    TENSOR_IDENTITY,
    FSDP1_WRAPPED,
)


def packed_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (a CPU build with mkldnn, the two ops present)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and MKLDNN_LINEAR.applied(torch)
    except (AttributeError, RuntimeError):
        return False


def reorder_linear_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight`` ``(out, in)`` float32 packed in oneDNN's layout for ``batch_hint`` rows
    (``torch.ops.mkldnn._reorder_linear_weight``)."""
    MKLDNN_LINEAR.check()
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``packed = reorder_linear_weight(weight, ...)``
    (``torch.ops.mkldnn._linear_pointwise`` with no fused activation). The packing checked torch's version."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``, the base class of a mode that sees every aten op below autograd."""
    DISPATCH_MODES.check()
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def disable_current_modes() -> contextlib.AbstractContextManager:
    """A context in which no ``TorchDispatchMode`` is in force (``_disable_current_modes``)."""
    DISPATCH_MODES.check()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def recompile_limits(limit: int) -> contextlib.AbstractContextManager:
    """A context in which Dynamo compiles a function at most ``limit`` times (``2 * limit`` in all)."""
    DYNAMO.check()
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=2 * limit)


def dynamo_errors():
    """Dynamo's errors: ``(RecompileError, TorchDynamoException, FailOnRecompileLimitHit)`` (``torch._dynamo.exc``)."""
    DYNAMO.check()
    from torch._dynamo import exc

    return exc.RecompileError, exc.TorchDynamoException, exc.FailOnRecompileLimitHit


def lookup_backend(name):
    """The compiler function of a ``torch.compile`` backend named ``name`` (``torch._dynamo.lookup_backend``)."""
    DYNAMO.check()
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


def guard_failures(code) -> list:
    """Why Dynamo recompiled ``code`` (its guard-failure reasons, newest last; ``[]`` when none)."""
    DYNAMO.check()
    from torch._dynamo.utils import guard_failures as failures

    return list(failures.get(code, []))


def aot_autograd(**kwargs):
    """A ``torch.compile`` backend through AOT autograd with ``kwargs`` (``fw_compiler``, ``bw_compiler``, ...)."""
    AOT_AUTOGRAD.check()
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def boxed(fn):
    """Mark a compiled graph's callable as taking its arguments as one list (AOT autograd's boxed convention)."""
    fn._boxed_call = True
    return fn


def inductor_compilers():
    """``(compile_fx, compile_fx_inner)``: inductor's whole-graph compiler and the per-graph one it calls
    (``torch._inductor.compile_fx``)."""
    INDUCTOR.check()
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def disable_inductor_caches() -> None:
    """Make inductor compile every graph afresh in this process (``torch._inductor.config.force_disable_caches``)."""
    INDUCTOR.check()
    from torch._inductor import config

    config.force_disable_caches = True


def compile_errors() -> tuple[type, ...]:
    """The errors a failed ``torch.compile`` raises: Dynamo's ``TorchDynamoException`` and inductor's
    ``InductorError``."""
    INDUCTOR.check()
    from torch._inductor.exc import InductorError

    return dynamo_errors()[1], InductorError


def tree_leaves(tree) -> list:
    """The leaves of a nested structure of lists, tuples and dicts (``torch.utils._pytree.tree_leaves``)."""
    PYTREE.check()
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def tree_flatten(tree):
    """``(leaves, spec)`` of a nested structure (``torch.utils._pytree.tree_flatten``)."""
    PYTREE.check()
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it grows with every in-place change (``tensor._version``)."""
    return tensor._version


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage object (``untyped_storage()._cdata``): it changes when ``.data`` is
    rebound to another storage."""
    return tensor.untyped_storage()._cdata


def unwrap_fsdp(module: torch.nn.Module) -> torch.nn.Module:
    """The module under an FSDP1 wrapper (``_fsdp_wrapped_module``), or ``module`` itself (FSDP2, none)."""
    return getattr(module, "_fsdp_wrapped_module", module)
