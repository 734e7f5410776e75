"""LiteRT export: HF causal-LM checkpoints and ``nn.Module``s to verified ``.tflite`` / ``.litertlm`` files.

Stands alone: needs torch, transformers and the LiteRT packages (litert-torch, ai-edge-litert, ai-edge-quantizer),
never Ray or VeRL. Public API: ``export_checkpoint``, ``export_module``, ``ExportError``; CLI: ``litert``.
"""

from edge_export.errors import ExportError
from edge_export.export import ExportResult, export_checkpoint, export_module

__all__ = ["ExportError", "ExportResult", "export_checkpoint", "export_module"]
