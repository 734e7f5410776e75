"""Finishing a ``.litertlm`` bundle: quantize its model section and write the chat format into its metadata.

litert-torch's generative export writes the bundle (``LlmMetadata``, executor metadata, tokenizer, the
``prefill_decode`` model). ``finish_bundle`` unpacks it with ``litert_lm_builder.unpack`` (a ``model.toml`` and one
file per section), replaces the model section by its quantized form and the metadata's start token, stop tokens
and Jinja template by ``edge_export.chat_template.ChatFormat``, and packs it again with ``litert_lm_builder.pack``.
"""

from __future__ import annotations

import os
import tomllib

from edge_export.chat_template import ChatFormat
from edge_export.errors import BAD_FILE, ExportError


def _unpack(path: str, workdir: str) -> tuple[str, dict]:
    import litert_lm_builder

    toml_path = litert_lm_builder.unpack(path, workdir)
    with open(toml_path, "rb") as f:
        return toml_path, tomllib.load(f)


def _section_path(workdir: str, toml: dict, section_type: str, model_type: str | None = None) -> str:
    for section in toml.get("section", []):
        if section.get("section_type") == section_type and (
            model_type is None or section.get("model_type") == model_type
        ):
            return os.path.join(workdir, section["data_path"])
    raise ExportError(BAD_FILE, f"the bundle has no {section_type} section{f' ({model_type})' if model_type else ''}")


def _load_metadata(path: str):
    from google.protobuf import text_format
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    message = llm_metadata_pb2.LlmMetadata()
    with open(path, "rb") as f:
        data = f.read()
    try:
        text_format.Parse(data.decode("utf-8"), message)
    except (UnicodeDecodeError, text_format.ParseError):
        message.ParseFromString(data)
    return message


def read_chat_format(path: str, workdir: str) -> dict:
    """The start token, stop tokens and template stored in a bundle, as plain data (for reports and tests).

    Returns:
        dict with ``start_token`` (str, list of ids, or None), ``stop_tokens`` (list of str or id lists),
        ``template`` (str) and ``max_num_tokens`` (int).
    """
    _, toml = _unpack(path, workdir)
    meta = _load_metadata(_section_path(workdir, toml, "LlmMetadata"))

    def token(union):
        return union.token_str if union.HasField("token_str") else list(union.token_ids.ids)

    return {
        "start_token": token(meta.start_token) if meta.HasField("start_token") else None,
        "stop_tokens": [token(t) for t in meta.stop_tokens],
        "template": meta.jinja_prompt_template,
        "max_num_tokens": meta.max_num_tokens,
    }


def finish_bundle(
    src: str, dst: str, chat: ChatFormat, workdir: str, quantization: str = "none", block_size: int = 32
) -> None:
    """Write ``src`` to ``dst`` with ``chat`` in its metadata and its model quantized by ``quantization``.

    Args:
        src: a ``.litertlm`` from litert-torch's generative export (float model).
        dst: where to write the finished bundle (may equal ``src``).
        chat: the chat format; ``start_token=None`` removes the start token, ``stop_token_ids`` replace all stops.
        workdir: empty scratch folder (removed by the caller).
        quantization: a ``--quantize`` name (``edge_export.quantize.RECIPES``).
        block_size: input weights per scale for ``dynamic-int4-block``.
    Raises:
        ExportError(BAD_FILE): the bundle lacks its metadata or model section.
    """
    import litert_lm_builder
    from google.protobuf import text_format

    from edge_export.quantize import quantize_tflite, recipe_name

    toml_path, toml = _unpack(src, workdir)
    meta_path = _section_path(workdir, toml, "LlmMetadata")
    meta = _load_metadata(meta_path)
    meta.ClearField("start_token")
    if chat.start_token is not None:
        meta.start_token.token_str = chat.start_token
    del meta.stop_tokens[:]
    for token_id in chat.stop_token_ids:
        meta.stop_tokens.add().token_ids.ids.append(token_id)
    meta.ClearField("prompt_templates")
    meta.jinja_prompt_template = chat.template
    with open(meta_path, "w") as f:
        f.write(text_format.MessageToString(meta))
    if recipe_name(quantization) is not None:
        model_path = _section_path(workdir, toml, "TFLiteModel", "prefill_decode")
        quantized = model_path + ".quantized"
        quantize_tflite(model_path, quantized, quantization, block_size)
        os.replace(quantized, model_path)
    litert_lm_builder.pack(toml_path, dst)
