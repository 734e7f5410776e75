"""The transformers names the sampler's lean decode step reads outside transformers' exports, in one place
(:data:`RECORDS`).

- ``apply_rotary_pos_emb`` of a model's modeling module (:data:`ROTARY`): each transformers model family defines its
  own RoPE function at the top of ``transformers/models/<family>/modeling_<family>.py``, beside its attention class,
  and the attention's forward calls it by that name; it is in no ``__all__``. The lean step
  (:class:`rl_tpu.sampler.lean.LeanDecoder`) calls the same function, found from the attention module's class, so it
  computes the model's own rotation (interleaved or half-split, partial rotary) rather than a copy of it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from rl_tpu.patches.record import Patch, names_check, searched

VERSIONS = ">=5.5.3,<5.11,!=5.6.0"  # pyproject's transformers range, the versions the lean step was checked with

ROTARY = Patch(
    target="transformers.models.<family>.modeling_<family>.apply_rotary_pos_emb",
    module="transformers.models.llama.modeling_llama", library="transformers", versions=VERSIONS,
    why="the lean decode step applies the model's own RoPE function, a module-level name of each modeling file",
    upstream=searched("huggingface/transformers",
                      "apply_rotary_pos_emb module level function public API rotary embedding per model"),
    apply=None, applied=names_check("apply_rotary_pos_emb"))

RECORDS: tuple[Patch, ...] = (ROTARY,)


def rotary_function(attention: object) -> Callable | None:
    """The ``apply_rotary_pos_emb`` beside ``attention``'s class in its modeling module, or ``None`` (no RoPE there).

    Raises:
        rl_tpu.patches.record.UnsupportedVersionError: transformers outside :data:`VERSIONS`.
    """
    ROTARY.check()
    module = sys.modules.get(type(attention).__module__)
    return getattr(module, "apply_rotary_pos_emb", None) if module is not None else None
