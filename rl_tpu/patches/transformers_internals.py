"""The transformers names the sampler's lean decode step reads outside transformers' exports, in one place
(:data:`RECORDS`).

- ``apply_rotary_pos_emb`` of a model's modeling module (:data:`ROTARY`): each transformers model family defines its
  own RoPE function at the top of ``transformers/models/<family>/modeling_<family>.py``, beside its attention class,
  and the attention's forward calls it by that name; it is in no ``__all__``. The lean step
  (:class:`rl_tpu.sampler.lean.LeanDecoder`) calls the same function, found from the attention module's class, so it
  computes the model's own rotation (interleaved or half-split, partial rotary) rather than a copy of it.
- A config's ``_attn_implementation`` (:data:`ATTN_IMPL`): which attention function the model's modules call. The
  sampler swaps it for its own registered function while it runs and reads it to choose its fast paths; the trainer's
  shared-prefix rows and the TPU lowering read or set it. transformers sets it through ``attn_implementation=`` at
  load time and ``set_attn_implementation`` on a model; a config's own value has no public getter or setter.
- A model's ``_no_split_modules`` (:data:`NO_SPLIT_MODULES`): the class names of its blocks (the decoder layers Hugging
  Face's device map and FSDP keep whole). The CPU trainer's heap trim hooks each such block
  (:class:`verl_backend.host_memory.heap.BackwardHeapTrim`, through :func:`no_split_modules`), and the compiled
  trainer compiles each (:func:`rl_tpu.compiled_blocks.decoder_blocks`).
- A model class's ``_supports_sdpa`` (:data:`SUPPORTS_SDPA`): whether its attention has an sdpa implementation. The
  driver's model check refuses a family without one before Ray starts
  (:func:`verl_backend.driver.preflight.check_sdpa_attention`, through :func:`supports_sdpa`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from rl_tpu.patches.record import Patch, names_check, searched

VERSIONS = ">=5.5.3,<5.11,!=5.6.0"  # pyproject's transformers range, the versions the lean step was checked with

ROTARY = Patch(
    target="transformers.models.<family>.modeling_<family>.apply_rotary_pos_emb",
    module="transformers.models.llama.modeling_llama",
    library="transformers",
    versions=VERSIONS,
    why="the lean decode step applies the model's own RoPE function, a module-level name of each modeling file",
    upstream=searched(
        "huggingface/transformers", "apply_rotary_pos_emb module level function public API rotary embedding per model"
    ),
    apply=None,
    applied=names_check("apply_rotary_pos_emb"),
)

ATTN_IMPL = Patch(
    target="transformers.PretrainedConfig._attn_implementation",
    module="transformers",
    library="transformers",
    versions=VERSIONS,
    why="the sampler swaps in its own attention for a while and reads which one a model runs; no public accessor",
    upstream="https://github.com/huggingface/transformers/pull/32383 (reads config._attn_implementation; "
    "attn_implementation= at load time is the public way to set it)",
    apply=None,
    applied=lambda module: hasattr(module.PretrainedConfig(), "_attn_implementation"),
)

RECORDS: tuple[Patch, ...] = (ROTARY, ATTN_IMPL)


def attn_implementation(config) -> str | None:
    """The attention implementation ``config``'s model runs (``"sdpa"``, ``"eager"``, a registered name), or
    ``None``."""
    ATTN_IMPL.check()
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config, name: str) -> None:
    """Make ``config``'s model call attention implementation ``name`` (read by its attention modules per forward)."""
    ATTN_IMPL.check()
    config._attn_implementation = name


def rotary_function(attention: object) -> Callable | None:
    """The ``apply_rotary_pos_emb`` beside ``attention``'s class in its modeling module, or ``None`` (no RoPE there).

    Raises:
        rl_tpu.patches.record.UnsupportedVersionError: transformers outside :data:`VERSIONS`.
    """
    ROTARY.check()
    module = sys.modules.get(type(attention).__module__)
    return getattr(module, "apply_rotary_pos_emb", None) if module is not None else None


#: transformers' grouped experts (``grouped_mm``, its default) count each expert's tokens with ``torch.cumsum``, which
#: TorchTPU 0.2.0 lowers to ``chlo.scan``: libtpu 0.0.52 refuses it, XLA:CPU aborts on it. ``batched_mm`` gathers each
#: token's experts instead (no cumsum). A config's ``_experts_implementation`` is what the experts' forward reads per
#: call; VeRL's ``override_config`` sets config attributes, so the TPU profile sets the experts through this name.
EXPERTS_IMPL = Patch(
    target="transformers.PretrainedConfig._experts_implementation",
    module="transformers",
    library="transformers",
    versions=VERSIONS,
    why="the TPU job runs MoE experts as batched_mm (no cumsum); VeRL's override_config can set only attributes",
    upstream="https://github.com/huggingface/transformers/pull/42697 (the experts implementations; "
    "experts_implementation= at load time is the public way to set it)",
    apply=None,
    applied=lambda module: hasattr(module.PretrainedConfig(), "_experts_implementation"),
)

RECORDS = RECORDS + (EXPERTS_IMPL,)


def experts_implementation(config) -> str | None:
    """The experts implementation ``config``'s MoE blocks run (``"grouped_mm"``, ``"batched_mm"``, ``"eager"``), or
    ``None`` (not set yet: transformers picks ``grouped_mm`` when the model is built)."""
    EXPERTS_IMPL.check()
    return getattr(config, "_experts_implementation", None)


NO_SPLIT_MODULES = Patch(
    target="transformers.PreTrainedModel._no_split_modules",
    module="transformers",
    library="transformers",
    versions=VERSIONS,
    why="the CPU trainer's heap trim hooks each block a model names there (its decoder layers); no public accessor",
    upstream=searched("huggingface/transformers", "_no_split_modules public accessor decoder layer classes of a model"),
    apply=None,
    applied=lambda module: hasattr(module.PreTrainedModel, "_no_split_modules"),
)

RECORDS = RECORDS + (NO_SPLIT_MODULES,)


def no_split_modules(model) -> set[str]:
    """The class names of ``model``'s blocks (its ``_no_split_modules``, e.g. ``{"LlamaDecoderLayer"}``); empty when it
    names none (a model that is not a transformers model, or one without blocks).

    Raises:
        rl_tpu.patches.record.UnsupportedVersionError: transformers outside :data:`VERSIONS`.
    """
    NO_SPLIT_MODULES.check()
    return set(getattr(model, "_no_split_modules", None) or ())


SUPPORTS_SDPA = Patch(
    target="transformers.PreTrainedModel._supports_sdpa",
    module="transformers",
    library="transformers",
    versions=VERSIONS,
    why="the driver refuses, before Ray starts, a family whose attention has no sdpa implementation (the trainer and "
    "the sampler compute attention through sdpa); transformers says so only in this class attribute",
    upstream=searched("huggingface/transformers", "_supports_sdpa public accessor model class supports sdpa attention"),
    apply=None,
    applied=lambda module: hasattr(module.PreTrainedModel, "_supports_sdpa"),
)

RECORDS = RECORDS + (SUPPORTS_SDPA,)


def supports_sdpa(model_class: type) -> bool:
    """Whether ``model_class`` (a transformers model class) has an sdpa attention implementation; ``True`` when it
    does not say (a class from outside transformers).

    Raises:
        rl_tpu.patches.record.UnsupportedVersionError: transformers outside :data:`VERSIONS`.
    """
    SUPPORTS_SDPA.check()
    return bool(getattr(model_class, "_supports_sdpa", True))
