"""The chat format a ``.litertlm`` bundle carries: Jinja template, start token and stop tokens.

The LiteRT-LM runtime (``litert_lm``, checked with litert-lm-api 0.18.1) renders a conversation with the bundle's
``jinja_prompt_template`` in its own Jinja dialect (MiniJinja), tokenizes the result with the bundle's tokenizer
without special tokens, and puts the bundle's ``start_token`` in front. Three facts make Hugging Face templates fail
there unchanged (litert-torch#1194, LiteRT-LM#3021):

- every message's ``content`` reaches the template as a list of parts (``[{"type": "text", "text": ...}]``), even
  when the caller passed a string, so ``'<|im_start|>' + message['content']`` raises "tried to use + operator on
  unsupported types string and sequence";
- ``bos_token`` and ``eos_token`` render empty;
- litert-torch 0.10.0 writes the BOS as start token whenever the rendered chat begins with it, so a ChatML model
  whose BOS is ``<|im_start|>`` (SmolLM2) gets it twice.

``chat_format_for`` builds the format that makes the runtime prefill exactly the token ids of
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``: a prelude that joins the text parts of
each message into a string (and defines ``bos_token`` / ``eos_token``) in front of the model's own template; a start
token only when the tokenizer itself prepends BOS to plain text and the chat begins with it (then the template
renders ``bos_token`` empty so it is not there twice); and stop tokens by id.
"""

from __future__ import annotations

import dataclasses

from edge_export.errors import BAD_CHECKPOINT, ExportError

# MiniJinja and Jinja2 both run this: namespaces, list concatenation and dict literals are common to the two.
_NORMALIZE_MESSAGES = (
    "{%- set _ns = namespace(messages=[]) -%}"
    "{%- for _m in messages -%}"
    "{%- if _m['content'] is string -%}{%- set _text = _m['content'] -%}"
    "{%- else -%}{%- set _parts = namespace(text='') -%}"
    "{%- for _p in _m['content'] -%}{%- if _p['type'] == 'text' -%}{%- set _parts.text = _parts.text + _p['text'] -%}"
    "{%- endif -%}{%- endfor -%}{%- set _text = _parts.text -%}{%- endif -%}"
    "{%- set _ns.messages = _ns.messages + [{'role': _m['role'], 'content': _text}] -%}"
    "{%- endfor -%}"
    "{%- set messages = _ns.messages -%}"
)
_PLACEHOLDER = "LITERTPLACEHOLDER"


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """What a bundle tells the runtime about chats.

    Attributes:
        template: Jinja template for ``jinja_prompt_template``.
        start_token: token text the runtime prepends to every conversation, or None for none.
        stop_token_ids: token ids that end an answer (each a one-token stop sequence).
    """

    template: str
    start_token: str | None
    stop_token_ids: tuple[int, ...]


def _jinja_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def text_content(message: dict) -> dict:
    """``message`` with list-of-parts content joined into one string (what HF templates expect)."""
    content = message["content"]
    if isinstance(content, str):
        return message
    text = "".join(part["text"] for part in content if part.get("type") == "text")
    return {**message, "content": text}


def hf_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's own template with the generation prompt.

    Content given as a list of text parts is joined into a string first (stock templates expect strings).
    """
    ids = tokenizer.apply_chat_template([text_content(m) for m in messages], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def tokenizer_prepends_bos(tokenizer) -> bool:
    """Whether ``tokenizer(text)`` puts the BOS token in front (its post-processor or ``add_bos_token``)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("x")["input_ids"][:1] == [bos]


def _end_of_turn_id(tokenizer) -> int | None:
    """The special token that closes an assistant turn in the template (``<|im_end|>``, ``<end_of_turn>``), if any."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PLACEHOLDER}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that refuses this exchange has no end-of-turn we can find
        return None
    if _PLACEHOLDER not in rendered:
        return None
    tail = rendered.rsplit(_PLACEHOLDER, 1)[1]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return ids[0] if ids and ids[0] in special else None


def stop_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """Ids that end an answer: the generation config's ``eos_token_id``, the tokenizer's EOS, the end of turn."""
    found: list[int] = []
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for value in (eos if isinstance(eos, (list, tuple)) else [eos]) + [
        tokenizer.eos_token_id,
        _end_of_turn_id(tokenizer),
    ]:
        if isinstance(value, int) and value not in found:
            found.append(value)
    return tuple(found)


def chat_format_for(tokenizer, generation_config=None, source: str = "the checkpoint") -> ChatFormat:
    """The runtime chat format for a Hugging Face tokenizer (see the module docstring).

    Args:
        tokenizer: the checkpoint's tokenizer, with ``chat_template``.
        generation_config: the model's ``GenerationConfig`` (its ``eos_token_id`` become stop tokens), or None.
        source: the checkpoint's name, for error messages.
    Raises:
        ExportError(BAD_CHECKPOINT): the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None) or not isinstance(tokenizer.chat_template, str):
        raise ExportError(
            BAD_CHECKPOINT,
            f"{source}: the tokenizer has no chat_template (or several); a .litertlm bundle needs one for the "
            "runtime's conversations: add chat_template to tokenizer_config.json (or chat_template.jinja), or "
            "export to .tflite",
        )
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )
    # The runtime's start token stands for the BOS a chat begins with: only where the tokenizer puts it before
    # plain text too (else `litert-lm run --no-template` would get a BOS that tokenizer(text) never has).
    begins_with_bos = bool(tokenizer.bos_token) and probe.startswith(tokenizer.bos_token)
    start = tokenizer.bos_token if begins_with_bos and tokenizer_prepends_bos(tokenizer) else None
    # With a start token the runtime supplies the BOS, so the template must not render it a second time.
    bos_text = "" if start is not None else (tokenizer.bos_token or "")
    prelude = (
        _NORMALIZE_MESSAGES
        + "{%- set bos_token = "
        + _jinja_string(bos_text)
        + " -%}"
        + "{%- set eos_token = "
        + _jinja_string(tokenizer.eos_token or "")
        + " -%}"
    )
    return ChatFormat(
        template=prelude + tokenizer.chat_template,
        start_token=start,
        stop_token_ids=stop_token_ids(tokenizer, generation_config),
    )
