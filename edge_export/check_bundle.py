"""``litert verify FILE --source CKPT``: an existing ``.litertlm`` bundle checked against the checkpoint it came from.

The check itself is :func:`edge_export.runtime_chat.verify_bundle` (greedy answers through the LiteRT-LM runtime
against PyTorch); with ``eval_file`` the bundle is also scored on task items by :mod:`edge_export.evaluate`. This
module sits above both, so neither imports the other's caller.
"""

from __future__ import annotations

import os
import tempfile

import torch

from edge_export import evaluate
from edge_export.bundle import read_chat_format
from edge_export.errors import BAD_FILE, BAD_SOURCE, VERIFICATION_FAILED, ExportError
from edge_export.runtime_chat import verification_rows, verify_bundle
from edge_export.sources import is_checkpoint_dir
from edge_export.verify import format_table


def verify_litertlm(
    path: str,
    source: str,
    *,
    quantize: str = "none",
    steps: int = 32,
    min_agreement: float | None = None,
    chats: list[list[dict]] | None = None,
    num_threads: int = 1,
    eval_file: str | None = None,
    scorer: str = "number",
    eval_max_tokens: int = 128,
    max_drop: float = 5.0,
    quiet: bool = False,
) -> dict:
    """Check an existing ``.litertlm`` through the LiteRT-LM runtime against the checkpoint it came from.

    The bundle's own stop tokens (ids) and ``max_num_tokens`` are used; ``quantize`` only picks the default bound.
    With ``eval_file`` the items are scored too (as in ``export_checkpoint``), under the key ``eval``.
    Returns:
        the verification dict of ``runtime_chat.verify_bundle`` (plus ``eval``).
    Raises:
        ExportError: BAD_FILE (no such bundle), BAD_SOURCE (not a model folder), VERIFICATION_FAILED (outside
            the bound; the first failure and what to do in one line).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_bundle_and_source(path, source)
    stored = _read_bundle_chat_format(path)
    stop_ids = tuple(t[0] for t in stored["stop_tokens"] if isinstance(t, list) and len(t) == 1)
    if eval_file is not None:
        eval_items = evaluate.read_items(eval_file)
        evaluate.load_scorer(scorer)
    torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    result = verify_bundle(
        path,
        model,
        tokenizer,
        quantization=quantize,
        stop_ids=stop_ids,
        chats=chats,
        steps=steps,
        cache_length=stored["max_num_tokens"] or 256,
        num_threads=num_threads,
        min_agreement=min_agreement,
    )
    if not quiet:
        print("[litert] verification\n" + format_table(verification_rows(result)), flush=True)
    if not result["passed"]:
        more = f" (and {len(result['failures']) - 1} more)" if len(result["failures"]) > 1 else ""
        raise ExportError(
            VERIFICATION_FAILED,
            f"{path} fails in the LiteRT-LM runtime: {result['failures'][0]}{more}; {result['hint']}",
        )
    if eval_file is not None:
        result["eval"] = evaluate.evaluate_bundle(
            path,
            model,
            tokenizer,
            eval_items,
            stop_ids=stop_ids,
            scorer=scorer,
            max_tokens=eval_max_tokens,
            cache_length=stored["max_num_tokens"] or 256,
            num_threads=num_threads,
            max_drop_points=max_drop,
        )
        if not result["eval"]["passed"]:
            raise ExportError(
                VERIFICATION_FAILED,
                f"{path}: {result['eval']['failures'][0]}; use a milder --quantize, or raise --max-drop",
            )
    return result


def _check_bundle_and_source(path: str, source: str) -> None:
    """Raise unless ``path`` is an existing ``.litertlm`` file and ``source`` a model folder with config.json.

    Raises:
        ExportError: BAD_FILE (no such bundle), BAD_SOURCE (not a model folder).
    """
    if not path.endswith(".litertlm") or not os.path.isfile(path):
        raise ExportError(BAD_FILE, f"FILE '{path}' is not an existing .litertlm bundle; give one litert export wrote")
    if not is_checkpoint_dir(source):
        raise ExportError(
            BAD_SOURCE,
            f"--source '{source}' is not a model folder with config.json; give the "
            "checkpoint the bundle was exported from",
        )


def _read_bundle_chat_format(path: str) -> dict:
    """The bundle's LlmMetadata as ``bundle.read_chat_format`` gives it (start and stop tokens, max_num_tokens).

    The bundle is unpacked into a temporary folder beside it, removed on return.
    Raises:
        ExportError: BAD_FILE when litert-lm-builder cannot read the bundle (its own ExportErrors pass through).
    """
    with tempfile.TemporaryDirectory(prefix=".litertlm-read-", dir=os.path.dirname(os.path.abspath(path))) as tmp:
        try:
            return read_chat_format(path, tmp)
        except ExportError:
            raise
        except Exception as exc:  # noqa: BLE001 -- litert-lm-builder's reader raises whatever the bytes provoke
            raise ExportError(
                BAD_FILE,
                f"FILE '{path}' is not a .litertlm bundle that litert-lm-builder can read "
                f"({type(exc).__name__}: {str(exc)[:120]}); give one litert export wrote",
            )
