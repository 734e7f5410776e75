"""The one place ``edge_export`` patches litert-torch, each patch narrow, version-ranged and tested.

``install()`` runs before litert-torch's generative export (``edge_export.convert``):

- ``tensorflow.lite.python.schema_py_generated``: litert-torch 0.10.0 imports it without depending on TensorFlow;
  aliased onto ai-edge-litert's byte-identical copy (``edge_export._tf_alias``).
- ``LiteRTLMCacheMixin.get_max_length``: litert-torch 0.10.0's export of a model with sliding-window layers
  (Gemma3, Mistral, windowed Qwen2) calls ``kv_cache.get_max_length()`` on its KV cache
  (``export_hf/core/exportable_module.py``, the sliding-window mask), which inherited that method from
  ``transformers.Cache`` until transformers 5 removed it (its replacement is ``get_max_cache_shape``). Every cache
  layer of litert-torch still defines it (its static cache length, in tokens), so the cache's own is the longest
  of its layers'. Without it every sliding-window model fails with ``AttributeError: 'LiteRTLMCache' object has
  no attribute 'get_max_length'``; with it they export and their bundles match PyTorch token for token through
  the LiteRT-LM runtime (``tests/edge_export/test_edge_families.py``). No upstream issue was found for it.
- ``transformers.integrations.use_kernel_forward_from_hub``: importing litert-torch 0.10.0's generative export
  (``export_hf/core/patches.py``) replaces it for the whole process, so every transformers modeling module imported
  afterwards (and litert-torch's own export imports Qwen3, Gemma3 and others at once) gets litert-torch's ``RMSNorm``,
  whose forward calls the custom op ``litert_torch::mark_tensor``. A training or sampling model built later in the
  same process (``verl train --export`` exports in the driver; a test session runs both) then fails under
  ``torch.compile`` ("the output of this custom operator ... may not alias any inputs"). ``install()`` imports that
  module first and puts transformers' own decorator back, so modeling classes stay transformers' own; litert-torch's
  scoped per-family patches (``model_ext/*/patch.py``, entered only during its export) still apply. Without the
  global one, the exported graph computes RMSNorm from plain ops instead of an ``odml.rms_norm`` composite: the same
  numbers with litert-torch's experimental mixed precision off (``edge_export`` never turns it on; it would keep only
  those composites in fp32), checked through the runtime by the export tests.

A patch applies only to the litert-torch versions in its range, and only while the attribute is missing: a release
that fixes it upstream (or moves the class) is left alone, and the tests say so.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

CACHE_PATCH_RANGE = SpecifierSet("==0.10.0")  # litert-torch versions the get_max_length patch is tested with
HOOK_PATCH_RANGE = SpecifierSet("==0.10.0")  # ... and the use_kernel_forward_from_hub restore


def _litert_torch_version() -> Version | None:
    try:
        return Version(version("litert-torch"))
    except PackageNotFoundError:
        return None


def _cache_get_max_length(self) -> int:
    """``LiteRTLMCacheMixin.get_max_length``: the longest static cache length of the cache's layers (tokens)."""
    return max(layer.get_max_length() for layer in self.layers)


def patch_cache_get_max_length() -> bool:
    """Give litert-torch's KV cache the ``get_max_length`` its sliding-window mask calls (see the module docstring).

    Returns:
        True when the method is in place after the call (patched now or before), False when left alone: a
        litert-torch outside :data:`CACHE_PATCH_RANGE`, or one whose cache defines the method itself.
    """
    found = _litert_torch_version()
    if found is None or found not in CACHE_PATCH_RANGE:
        return False
    from litert_torch.generative.export_hf.core import cache_base

    mixin = cache_base.LiteRTLMCacheMixin
    current = mixin.__dict__.get("get_max_length")
    if current is _cache_get_max_length:
        return True
    if current is not None or any("get_max_length" in vars(base) for base in mixin.__mro__[1:]):
        return False  # defined upstream again: nothing to patch
    mixin.get_max_length = _cache_get_max_length
    return True


def keep_transformers_kernel_hook() -> bool:
    """Undo litert-torch's process-wide swap of ``use_kernel_forward_from_hub`` (see the module docstring).

    Must run before ``litert_torch.generative.export_hf`` is first imported: that import loads modeling modules.

    Returns:
        True when transformers' own decorator is in place after the call, False when left alone (a litert-torch
        outside :data:`HOOK_PATCH_RANGE`, or one without the module-level swap).
    """
    found = _litert_torch_version()
    if found is None or found not in HOOK_PATCH_RANGE:
        return False
    import transformers.integrations
    from litert_torch.generative.export_hf.core import patches as litert_hf_patches

    original = getattr(litert_hf_patches, "original_use_kernel_forward_from_hub", None)
    if original is None:
        return False  # litert-torch no longer swaps it
    transformers.integrations.use_kernel_forward_from_hub = original
    return True


def install() -> None:
    """Apply every litert-torch patch (idempotent); call before importing its generative export."""
    from edge_export import _tf_alias

    _tf_alias.install()
    keep_transformers_kernel_hook()
    patch_cache_get_max_length()
