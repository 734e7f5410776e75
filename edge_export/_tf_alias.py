"""Stand-in for the one TensorFlow module litert-torch's generative export imports.

litert-torch 0.10.0 imports ``tensorflow.lite.python.schema_py_generated`` at module level in
``generative/export_hf/model_ext/bonsai_flux2/bonsai_flux2.py`` (reached from ``export_hf.export``) and in
``generative/layers/lora.py``, but does not declare TensorFlow as a dependency. That module is the generated
FlatBuffers schema of the ``.tflite`` format, which ``ai_edge_litert.schema_py_generated`` ships byte-for-byte.

``install()`` registers ``tensorflow``, ``tensorflow.lite`` and ``tensorflow.lite.python`` as empty packages in
``sys.modules`` and maps the schema module onto ai-edge-litert's copy. Any other ``tensorflow.*`` import still
raises ``ModuleNotFoundError``, so a code path that truly needs TensorFlow fails loudly instead of silently.
Nothing is installed when a real TensorFlow is importable.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

_SCHEMA = "tensorflow.lite.python.schema_py_generated"
_PACKAGES = ("tensorflow", "tensorflow.lite", "tensorflow.lite.python")


def install() -> bool:
    """Alias the TF Lite schema module onto ai-edge-litert's copy.

    Returns:
        True when the alias was installed (or already present), False when a real TensorFlow is importable and
        nothing was done.
    """
    if _SCHEMA in sys.modules:
        return True
    if "tensorflow" not in sys.modules and importlib.util.find_spec("tensorflow") is not None:
        return False
    from ai_edge_litert import schema_py_generated

    for name in _PACKAGES:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []  # a package with no files: other submodules are not found
            # origin=None: torch._dynamo's skip-list builder calls find_spec() on "tensorflow" and ignores
            # modules without an origin; a missing __spec__ would make it raise ValueError.
            package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            sys.modules[name] = package
    sys.modules[_SCHEMA] = schema_py_generated
    sys.modules["tensorflow.lite.python"].schema_py_generated = schema_py_generated
    sys.modules["tensorflow.lite"].python = sys.modules["tensorflow.lite.python"]
    sys.modules["tensorflow"].lite = sys.modules["tensorflow.lite"]
    return True
