"""The one place ``edge_export`` patches litert-torch, each patch a :class:`~rl_tpu.patches.record.Patch` record
(:data:`PATCHES`: version range, reason, upstream or the search that found none, ``applied`` check), as the VeRL ones.

``install()`` runs before litert-torch's generative export (``edge_export.convert``); it first refuses a litert-torch
outside the tested range in one line (``litert export: error: litert-torch 0.11.0 is outside the tested range
==0.10.0 of rl-tpu's patch ...; install litert-torch==0.10.0``), then applies each patch:

- ``tensorflow.lite.python.schema_py_generated`` (:data:`TF_SCHEMA`): litert-torch 0.10.0 imports it without
  depending on TensorFlow; aliased onto ai-edge-litert's byte-identical copy (``edge_export._tf_alias``).
- ``LiteRTLMCacheMixin.get_max_length`` (:data:`CACHE`): litert-torch 0.10.0's export of a model with sliding-window
  layers (Gemma3, Mistral, windowed Qwen2) calls ``kv_cache.get_max_length()`` on its KV cache
  (``export_hf/core/exportable_module.py``, the sliding-window mask), which inherited that method from
  ``transformers.Cache`` until transformers 5 removed it (its replacement is ``get_max_cache_shape``). Every cache
  layer of litert-torch still defines it (its static cache length, in tokens), so the cache's own is the longest
  of its layers'. Without it every sliding-window model fails with ``AttributeError: 'LiteRTLMCache' object has
  no attribute 'get_max_length'``; with it they export and their bundles match PyTorch token for token through
  the LiteRT-LM runtime (``tests/edge_export/test_edge_families.py``). No upstream issue was found for it.
- ``transformers.integrations.use_kernel_forward_from_hub`` (:data:`KERNEL_HOOK`): importing litert-torch 0.10.0's
  generative export (``export_hf/core/patches.py``) replaces it for the whole process, so every transformers modeling
  module imported afterwards (and litert-torch's own export imports Qwen3, Gemma3 and others at once) gets
  litert-torch's ``RMSNorm``, whose forward calls the custom op ``litert_torch::mark_tensor``. A training or sampling
  model built later in the same process (``verl train --export`` exports in the driver; a test session runs both) then
  fails under ``torch.compile`` ("the output of this custom operator ... may not alias any inputs"). ``install()``
  imports that module first and puts transformers' own decorator back, so modeling classes stay transformers' own;
  litert-torch's scoped per-family patches (``model_ext/*/patch.py``, entered only during its export) still apply.
  Without the global one, the exported graph computes RMSNorm from plain ops instead of an ``odml.rms_norm`` composite:
  the same numbers with litert-torch's experimental mixed precision off (``edge_export`` never turns it on; it would
  keep only those composites in fp32), checked through the runtime by the export tests.

Within the range a patch applies only while it is needed: a cache that defines the method itself, or a litert-torch
without the module-level swap, is left alone, and the tests say so.
"""

from __future__ import annotations

import sys
from types import ModuleType

from rl_tpu.patches.record import Patch, UnsupportedVersionError, check_versions, installed_version, searched

VERSIONS = "==0.10.0"  # the litert-torch versions these patches were tested with (pyproject's export extra pins it)
_CACHE_MODULE = "litert_torch.generative.export_hf.core.cache_base"
_HOOK_MODULE = "litert_torch.generative.export_hf.core.patches"
_SCHEMA = "tensorflow.lite.python.schema_py_generated"


def _litert_torch_version() -> str | None:
    return installed_version("litert-torch")


def _cache_get_max_length(self) -> int:
    """``LiteRTLMCacheMixin.get_max_length``: the longest static cache length of the cache's layers (tokens)."""
    return max(layer.get_max_length() for layer in self.layers)


def _defined_upstream(mixin: type) -> bool:
    own = mixin.__dict__.get("get_max_length")
    return (own is not None and own is not _cache_get_max_length) or any(
        "get_max_length" in vars(base) for base in mixin.__mro__[1:]
    )


def _add_cache_method(module: ModuleType) -> None:
    mixin = module.LiteRTLMCacheMixin
    if mixin.__dict__.get("get_max_length") is None and not _defined_upstream(mixin):
        mixin.get_max_length = _cache_get_max_length


def _cache_method_in_place(module: ModuleType) -> bool:
    mixin = module.LiteRTLMCacheMixin
    return mixin.__dict__.get("get_max_length") is _cache_get_max_length or _defined_upstream(mixin)


def _restore_kernel_hook(module: ModuleType) -> None:
    original = getattr(module, "original_use_kernel_forward_from_hub", None)
    if original is not None:
        import transformers.integrations

        transformers.integrations.use_kernel_forward_from_hub = original


def _kernel_hook_restored(module: ModuleType) -> bool:
    import transformers.integrations

    original = getattr(module, "original_use_kernel_forward_from_hub", None)
    return original is None or transformers.integrations.use_kernel_forward_from_hub is original


def _alias_schema(module: ModuleType) -> None:
    from edge_export import _tf_alias

    _tf_alias.install()


def _schema_aliased(module: ModuleType) -> bool:
    import importlib.util

    real_tensorflow = "tensorflow" not in sys.modules and importlib.util.find_spec("tensorflow") is not None
    return real_tensorflow or sys.modules.get(_SCHEMA) is module


TF_SCHEMA = Patch(
    target=f"{_SCHEMA} (a sys.modules alias)",
    module="ai_edge_litert.schema_py_generated",
    library="litert-torch",
    versions=VERSIONS,
    why="litert-torch imports TensorFlow's TFLite schema without depending on TensorFlow; ai-edge-litert ships it",
    upstream=searched(
        "google-ai-edge/litert-torch",
        "ai-edge-torch litert-torch imports tensorflow schema_py_generated without tensorflow dependency",
    ),
    apply=_alias_schema,
    applied=_schema_aliased,
)

KERNEL_HOOK = Patch(
    target="transformers.integrations.use_kernel_forward_from_hub (litert-torch's swap undone)",
    module=_HOOK_MODULE,
    library="litert-torch",
    versions=VERSIONS,
    why="importing litert-torch's export swaps transformers' kernel hook for the process: later models get its RMSNorm",
    upstream=searched(
        "google-ai-edge/litert-torch", "litert-torch use_kernel_forward_from_hub replaced globally RMSNorm mark_tensor"
    ),
    apply=_restore_kernel_hook,
    applied=_kernel_hook_restored,
)

CACHE = Patch(
    target=f"{_CACHE_MODULE}.LiteRTLMCacheMixin.get_max_length",
    module=_CACHE_MODULE,
    library="litert-torch",
    versions=VERSIONS,
    why="the sliding-window export calls the cache's get_max_length, which transformers 5's Cache no longer has",
    upstream=searched(
        "google-ai-edge/litert-torch",
        "litert-torch LiteRTLMCache get_max_length AttributeError transformers 5 sliding window",
    ),
    apply=_add_cache_method,
    applied=_cache_method_in_place,
)

PATCHES: tuple[Patch, ...] = (TF_SCHEMA, KERNEL_HOOK, CACHE)


def _check(*patches: Patch) -> None:
    """Raise :class:`~rl_tpu.patches.record.UnsupportedVersionError` for a litert-torch outside the range."""
    check_versions(patches, {"litert-torch": _litert_torch_version()})


def patch_cache_get_max_length() -> bool:
    """Give litert-torch's KV cache the ``get_max_length`` its sliding-window mask calls (:data:`CACHE`).

    Returns:
        True when rl-tpu's method is in place after the call (patched now or before), False when litert-torch is
        not installed or its cache defines the method itself.
    Raises:
        rl_tpu.patches.record.UnsupportedVersionError: litert-torch outside :data:`VERSIONS`.
    """
    _check(CACHE)
    if _litert_torch_version() is None:
        return False
    import importlib

    module = importlib.import_module(_CACHE_MODULE)
    CACHE.apply(module)
    return module.LiteRTLMCacheMixin.__dict__.get("get_max_length") is _cache_get_max_length


def keep_transformers_kernel_hook() -> bool:
    """Undo litert-torch's process-wide swap of ``use_kernel_forward_from_hub`` (:data:`KERNEL_HOOK`).

    Must run before ``litert_torch.generative.export_hf`` is first imported: that import loads modeling modules.

    Returns:
        True when transformers' own decorator is in place after the call, False when litert-torch is not installed
        or does not swap it.
    Raises:
        rl_tpu.patches.record.UnsupportedVersionError: litert-torch outside :data:`VERSIONS`.
    """
    _check(KERNEL_HOOK)
    if _litert_torch_version() is None:
        return False
    import importlib

    module = importlib.import_module(_HOOK_MODULE)
    if getattr(module, "original_use_kernel_forward_from_hub", None) is None:
        return False  # litert-torch no longer swaps it
    KERNEL_HOOK.apply(module)
    return True


def install() -> None:
    """Refuse a litert-torch outside :data:`VERSIONS` in one line, then apply every patch (idempotent); call before
    importing its generative export.

    Raises:
        edge_export.errors.ExportError: kind ``UNSUPPORTED_LIBRARY``, the one line of the refusal.
    """
    try:
        _check(*PATCHES)
    except UnsupportedVersionError as exc:
        from edge_export.errors import UNSUPPORTED_LIBRARY, ExportError

        raise ExportError(UNSUPPORTED_LIBRARY, str(exc)) from None
    import importlib

    TF_SCHEMA.apply(importlib.import_module(TF_SCHEMA.module))
    keep_transformers_kernel_hook()
    patch_cache_get_max_length()
