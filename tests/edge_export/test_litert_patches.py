"""litert-torch's patches (``edge_export/litert_patches.py``) are records of the shared type, and a litert-torch
outside their tested range is refused in one line before anything of it is imported (the patches' effects are
checked by ``test_edge_families.py``)."""

from __future__ import annotations

import pytest

from rl_tpu.patches.record import UnsupportedVersionError, problems


def test_litert_patches_are_complete_records():
    from edge_export import litert_patches

    assert [p.library for p in litert_patches.PATCHES] == ["litert-torch"] * 3
    for patch in litert_patches.PATCHES:
        assert problems(patch) == [], (patch.target, problems(patch))
        assert patch.replaces


def test_untested_litert_torch_is_refused_in_one_line(monkeypatch):
    from edge_export import litert_patches
    from edge_export.errors import UNSUPPORTED_LIBRARY, ExportError

    monkeypatch.setattr(litert_patches, "_litert_torch_version", lambda: "0.11.0")
    with pytest.raises(ExportError) as info:
        litert_patches.install()
    assert info.value.kind == UNSUPPORTED_LIBRARY
    assert str(info.value) == (
        "litert-torch 0.11.0 is outside the tested range ==0.10.0 of rl-tpu's patch "
        "tensorflow.lite.python.schema_py_generated (a sys.modules alias); install "
        "litert-torch==0.10.0"
    )
    for apply in (litert_patches.patch_cache_get_max_length, litert_patches.keep_transformers_kernel_hook):
        with pytest.raises(UnsupportedVersionError):
            apply()
