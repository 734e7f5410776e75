"""Checking a ``.litertlm`` bundle through the LiteRT-LM runtime itself (``litert_lm``, litert-lm-api 0.18.1).

For each chat (a list of ``{"role", "content"}`` messages ending with a user turn) the runtime is asked, on its
CPU backend with greedy sampling (``SamplerConfig(top_k=1)``), for ``steps`` answer tokens through
``Engine.create_conversation(messages=history).send_message(last)``. Two things are compared with PyTorch:

- the prompt: the runtime's own rendering (``render_message_to_string``) tokenized by the runtime's own tokenizer
  (``Engine.tokenize``) behind its own start token, and the prefill token count it reports
  (``BenchmarkInfo.last_prefill_token_count``), must both equal ``tokenizer.apply_chat_template`` ids;
- the answer: the runtime returns text, not ids, so PyTorch is teacher-forced along it. At each step the runtime's
  token is the most likely of PyTorch's top 64 whose decoding continues the runtime's text (a stop token where the
  text has ended); the step agrees when that is PyTorch's argmax. ``agreed_steps`` counts leading agreeing steps
  (all of them means PyTorch's greedy answer is the runtime's), ``top1_agreement`` is the share of agreeing steps.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

import torch

from edge_export.chat_template import hf_prompt_ids, text_content
from edge_export.errors import BAD_FILE, ExportError

SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}


def _user(text) -> dict:
    return {"role": "user", "content": text}


def _parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


# System + user, user only, two-turn, and content as a list of parts, on short factual questions.
DEFAULT_CHATS: list[list[dict]] = [
    [SYSTEM, _user("What is the capital of France?")],
    [_user("What is the capital of France?")],
    [_user("Name three primary colours.")],
    [SYSTEM, _user("How many days are there in a week?")],
    [_user("What is 12 plus 30?"), {"role": "assistant", "content": "12 plus 30 is 42."}, _user("And 42 plus 8?")],
    [
        SYSTEM,
        _user("Who wrote Hamlet?"),
        {"role": "assistant", "content": "William Shakespeare."},
        _user("When was he born?"),
    ],
    [_user(_parts("Translate to French: ", "good morning"))],
    [SYSTEM, _user(_parts("Give a synonym for 'happy'."))],
]

# Least share of agreeing steps over all chats, per quantization; fp32 must agree on every step of every chat.
MIN_AGREEMENT = {"none": 1.0, "weight-int8": 0.9, "dynamic-int8": 0.9, "dynamic-int4": 0.5, "dynamic-int4-block": 0.5}
_TOP_K = 64
_CAUSE_RE = re.compile(r"(Failed to .*|INVALID_ARGUMENT: .*|NOT_FOUND: .*|INTERNAL: .*)$")


@contextlib.contextmanager
def native_stderr(box: dict):
    """Send file descriptor 2 (the runtime's C++ log) to a temporary file; its text lands in ``box['text']``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode("utf-8", errors="replace")


def native_cause(log: str) -> str:
    """The runtime's own reason from its log: the last 'Failed to ...' (or status) line, else the last line.

    When that line only points at a source location (``INTERNAL: ERROR: [file.h:62]``), the innermost reason of the
    ``└ ...`` chain printed under it is added (e.g. ``TensorBuffer must have all static dimensions``).
    """
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    found = [(i, m.group(1).strip()) for i, line in enumerate(lines) if (m := _CAUSE_RE.search(line))]
    if not found:
        return lines[-1] if lines else "no message from the runtime"
    index, cause = found[-1]
    chain = []
    for line in lines[index + 1 :]:
        if not line.startswith("└"):
            break
        chain.append(line.lstrip("└ ").strip())
    reasons = [c for c in chain if not re.fullmatch(r"ERROR: \[[^\]]+\]", c)]
    if reasons and re.search(r"\[[^\]]+:\d+\]$", cause):
        cause = f"{cause}: {reasons[-1]}"
    return cause


def open_engine(path: str, cache_length: int, num_threads: int = 1):
    """A ``litert_lm.Engine`` on the CPU backend with benchmark counters on.

    The runtime writes an XNNPACK weight cache (``<bundle>_<time>_<size>.xnnpack_cache``, as large as the float
    weights) beside the bundle unless given a ``cache_dir``: it gets a temporary folder, removed with the engine.
    Raises:
        ExportError(BAD_FILE): the runtime cannot load the bundle (its own reason in the message).
    """
    import litert_lm

    box: dict = {}
    engine, error = None, None
    cache = tempfile.TemporaryDirectory(prefix="litertlm-xnnpack-")
    with native_stderr(box):
        try:
            engine = litert_lm.Engine(
                path,
                backend=litert_lm.Backend.CPU(thread_count=num_threads),
                max_num_tokens=cache_length,
                enable_benchmark=True,
                cache_dir=cache.name,
            )
        except (RuntimeError, ValueError) as exc:
            error = exc
    if engine is None:
        cache.cleanup()
        raise ExportError(BAD_FILE, f"the LiteRT-LM runtime cannot load {path}: {native_cause(box['text']) or error}")
    engine.edge_export_cache = cache  # removed when the engine is collected
    return engine


def _message_text(message) -> str:
    content = message.to_json().get("content", "")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def runtime_turn(engine, chat: list[dict], steps: int) -> dict:
    """Run ``chat`` through the runtime: its prompt ids, prefill count, answer text and speed.

    Returns:
        dict with ``prompt_ids`` (start token + runtime tokenization of its own rendering), ``prefill_tokens``,
        ``decode_tokens``, ``text``, ``prefill_tokens_per_s``, ``decode_tokens_per_s``; or ``error`` (the
        runtime's reason) when it cannot render or answer.
    """
    import litert_lm

    box: dict = {}
    result: dict = {}
    with native_stderr(box):
        try:
            conversation = engine.create_conversation(
                messages=chat[:-1], sampler_config=litert_lm.SamplerConfig(top_k=1), max_output_tokens=steps
            )
            rendered = conversation.render_message_to_string(chat[-1])
            if rendered:
                start = engine.bos_token_id
                result["prompt_ids"] = ([start] if start is not None else []) + engine.tokenize(rendered)
                answer = conversation.send_message(chat[-1])
                info = conversation.get_benchmark_info()
                result.update(
                    text=_message_text(answer),
                    prefill_tokens=info.last_prefill_token_count,
                    decode_tokens=info.last_decode_token_count,
                    prefill_tokens_per_s=info.last_prefill_tokens_per_second,
                    decode_tokens_per_s=info.last_decode_tokens_per_second,
                )
        except RuntimeError as exc:
            result["error"] = str(exc)
    if "text" not in result:
        result["error"] = native_cause(box["text"]) if box["text"].strip() else result.get("error", "empty rendering")
    return result


class _Decoder:
    """Incremental PyTorch forward with the KV cache: ``step(ids)`` returns the next-token logits (vocab,)."""

    def __init__(self, model):
        self.model, self.past = model, None

    @torch.no_grad()
    def step(self, ids: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].float()


def torch_greedy(model, prompt_ids: list[int], steps: int, stop_ids: tuple[int, ...]) -> list[int]:
    """PyTorch greedy answer ids after ``prompt_ids`` (the stop token included when reached)."""
    decoder, tokens = _Decoder(model), []
    logits = decoder.step(prompt_ids)
    for _ in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        if token in stop_ids:
            break
        logits = decoder.step([token])
    return tokens


def agreement_along(
    model, tokenizer, prompt_ids: list[int], text: str, runtime_steps: int, steps: int, stop_ids: tuple[int, ...]
) -> dict:
    """Teacher-force PyTorch along the runtime's answer ``text`` (see the module docstring).

    Returns:
        dict with ``steps`` compared, ``agreed_steps`` (leading), ``agreeing`` (all), ``recovered_ids``.
    """
    decoder, recovered, agree = _Decoder(model), [], []
    total = min(steps, runtime_steps)
    logits = decoder.step(prompt_ids)
    for _ in range(total):
        done = tokenizer.decode(recovered)
        order = logits.topk(min(_TOP_K, logits.numel())).indices.tolist()
        pick = None
        for candidate in order:
            if candidate in stop_ids:
                if done == text:
                    pick = candidate
                    break
                continue
            piece = tokenizer.decode(recovered + [candidate]).rstrip("\ufffd")
            if text.startswith(piece) and not (done == text and piece == done):
                pick = candidate
                break
        if pick is None:  # outside PyTorch's top 64: count the rest as disagreeing
            agree += [False] * (total - len(agree))
            break
        agree.append(pick == order[0])
        recovered.append(pick)
        if pick in stop_ids:
            break
        logits = decoder.step([pick])
    leading = next((i for i, ok in enumerate(agree) if not ok), len(agree))
    return {"steps": len(agree), "agreed_steps": leading, "agreeing": sum(agree), "recovered_ids": recovered}


def verify_bundle(
    path: str,
    model,
    tokenizer,
    *,
    quantization: str,
    stop_ids: tuple[int, ...],
    chats: list[list[dict]] | None = None,
    steps: int = 32,
    cache_length: int = 256,
    num_threads: int = 1,
    min_agreement: float | None = None,
) -> dict:
    """Run ``chats`` through the runtime and compare prompts and greedy answers with PyTorch.

    Args:
        path: the ``.litertlm`` bundle.
        model: the HF ``*ForCausalLM`` in float32 eval mode; tokenizer: its tokenizer.
        quantization: the bundle's ``--quantize`` name; picks the bound in ``MIN_AGREEMENT``.
        stop_ids: the bundle's stop token ids (PyTorch stops there too).
        chats: message lists ending with a user turn (default ``DEFAULT_CHATS``).
        steps: answer tokens compared per chat.
        min_agreement: overrides the bound (share of agreeing steps over all chats).
    Returns:
        dict with ``chats`` (per chat: messages, PyTorch and runtime prompt token counts, both answers, agreement),
        ``top1_agreement``, ``prefill_tokens_per_s`` / ``decode_tokens_per_s`` (runtime means), ``passed`` and
        ``failures`` (one phrase each).
    Raises:
        ExportError(BAD_FILE): the runtime cannot load the bundle.
    """
    chats = chats or DEFAULT_CHATS
    bound = MIN_AGREEMENT.get(quantization, 0.0) if min_agreement is None else min_agreement
    try:
        engine = open_engine(path, cache_length, num_threads)
    except ExportError as err:
        hint = "the bundle is not usable on a device; keep the report for a bug"
        return _bundle_verification(num_threads, [], steps, 0, 0.0, bound, [str(err)], hint)
    entries, failures = [], []
    for index, chat in enumerate(chats):
        entry, chat_failures = _compare_chat(engine, model, tokenizer, index, chat, steps, stop_ids, bound)
        entries.append(entry)
        failures += chat_failures
    compared = sum(e.get("steps", 0) for e in entries)
    agreement = sum(e.get("agreeing_steps", 0) for e in entries) / compared if compared else 0.0
    if compared and agreement < bound and bound < 1.0:
        failures.append(
            f"top-1 agreement {agreement:.1%} over {compared} steps is below {bound:.0%} by {bound - agreement:.1%}"
        )
    hint = _failure_hint(failures, bound)
    return _bundle_verification(num_threads, entries, steps, compared, agreement, bound, failures, hint)


def _compare_chat(
    engine, model, tokenizer, index: int, chat: list[dict], steps: int, stop_ids: tuple[int, ...], bound: float
) -> tuple[dict, list[str]]:
    """One chat through the LiteRT-LM runtime against PyTorch: its prefilled prompt, then its greedy answer.

    Returns:
        (the chat's report entry, its failure phrases in the order found; empty when it passes).
    """
    reference = hf_prompt_ids(tokenizer, chat)
    turn = runtime_turn(engine, chat, steps)
    entry = {"messages": [text_content(m) for m in chat], "torch_prompt_tokens": len(reference)}
    if "error" in turn:
        entry["runtime_error"] = turn["error"]
        return entry, [f"chat {index}: the runtime cannot render or answer it: {turn['error']}"]
    entry.update(
        runtime_prompt_tokens=turn["prefill_tokens"],
        runtime_answer=turn["text"],
        runtime_decode_tokens=turn["decode_tokens"],
        prefill_tokens_per_s=turn["prefill_tokens_per_s"],
        decode_tokens_per_s=turn["decode_tokens_per_s"],
    )
    failures = []
    if turn["prompt_ids"] != reference or turn["prefill_tokens"] != len(reference):
        entry["runtime_prompt_ids"], entry["torch_prompt_ids"] = turn["prompt_ids"], reference
        failures.append(_prefill_difference(index, turn, reference, tokenizer))
    failure = _compare_greedy_answer(entry, model, tokenizer, index, reference, turn, steps, stop_ids, bound)
    if failure:
        failures.append(failure)
    return entry, failures


def _prefill_difference(index: int, turn: dict, reference: list[int], tokenizer) -> str:
    """The failure phrase for a chat whose runtime prefill differs from ``apply_chat_template`` ids ``reference``.

    Names both token counts, the first differing token position and three tokens of each prompt from there.
    """
    at = next(
        (i for i, (a, b) in enumerate(zip(turn["prompt_ids"], reference)) if a != b),
        min(len(reference), len(turn["prompt_ids"])),
    )
    return (
        f"chat {index}: the runtime prefills {turn['prefill_tokens']} tokens, apply_chat_template gives "
        f"{len(reference)}; first difference at token {at} (runtime "
        f"{tokenizer.decode(turn['prompt_ids'][at : at + 3])!r} vs {tokenizer.decode(reference[at : at + 3])!r})"
    )


def _compare_greedy_answer(
    entry: dict,
    model,
    tokenizer,
    index: int,
    reference: list[int],
    turn: dict,
    steps: int,
    stop_ids: tuple[int, ...],
    bound: float,
) -> str | None:
    """Teacher-force PyTorch along the runtime's answer; record steps, agreement and PyTorch's answer in ``entry``.

    Returns:
        the failure phrase when the bound is every step (``bound >= 1.0``) and a step differs, else None (a lower
        bound is checked over all chats by the caller).
    """
    check = agreement_along(model, tokenizer, reference, turn["text"], turn["decode_tokens"], steps, stop_ids)
    entry.update(steps=check["steps"], agreed_steps=check["agreed_steps"], agreeing_steps=check["agreeing"])
    if check["agreed_steps"] == check["steps"]:
        entry["torch_answer"] = tokenizer.decode([t for t in check["recovered_ids"] if t not in stop_ids])
    else:
        greedy = torch_greedy(model, reference, steps, stop_ids)
        entry["torch_answer"] = tokenizer.decode([t for t in greedy if t not in stop_ids])
    if bound >= 1.0 and check["agreed_steps"] < check["steps"]:
        return (
            f"chat {index}: greedy tokens differ from PyTorch at step {check['agreed_steps']} of "
            f"{check['steps']} (runtime {turn['text'][:40]!r}, PyTorch {entry['torch_answer'][:40]!r})"
        )
    return None


def _failure_hint(failures: list[str], bound: float) -> str:
    """What to do about ``failures`` in one phrase ("" when there are none): template, conversion or quantization."""
    if any("render" in f or "prefills" in f for f in failures):
        return (
            "the bundle's chat template or start token makes the runtime answer another prompt than "
            "apply_chat_template; the report has both prompts' token counts"
        )
    if failures and bound >= 1.0:
        return "the float bundle computes other tokens than PyTorch: a conversion fault; keep the report for a bug"
    return "lower --min-agreement or use a milder --quantize" if failures else ""


def _bundle_verification(
    num_threads: int,
    entries: list[dict],
    steps: int,
    compared: int,
    agreement: float,
    bound: float,
    failures: list[str],
    hint: str,
) -> dict:
    """The ``verify_bundle`` result (keys in report order); tokens/s are the runtime's means over ``entries``.

    ``passed`` is ``not failures``; the tokens/s are None where no chat reported them.
    """

    def mean(key):
        values = [e[key] for e in entries if key in e]
        return sum(values) / len(values) if values else None

    return {
        "runtime": "litert_lm",
        "backend": "cpu",
        "threads": num_threads,
        "chats": entries,
        "steps": steps,
        "compared_steps": compared,
        "top1_agreement": agreement,
        "min_agreement": bound,
        "prefill_tokens_per_s": mean("prefill_tokens_per_s"),
        "decode_tokens_per_s": mean("decode_tokens_per_s"),
        "passed": not failures,
        "failures": failures,
        "hint": hint,
    }


def verification_rows(result: dict) -> list[tuple[str, str]]:
    """(label, value) rows of a ``verify_bundle`` result for a two-column table."""
    rows = [
        (
            f"chat {i}",
            f"prompt {c['torch_prompt_tokens']} tokens, "
            + (
                f"runtime error: {c['runtime_error']}"
                if "runtime_error" in c
                else f"runtime prefilled {c['runtime_prompt_tokens']}, greedy {c['agreed_steps']}/{c['steps']}: "
                f"{c['runtime_answer'][:48]!r}"
            ),
        )
        for i, c in enumerate(result["chats"])
    ]
    agreement = (
        f"{result['top1_agreement']:.1%} of {result['compared_steps']} steps (bound {result['min_agreement']:.0%})"
    )
    rows.append(("top-1 agreement", agreement))
    if result["decode_tokens_per_s"]:
        speed = f"prefill {result['prefill_tokens_per_s']:.0f}, decode {result['decode_tokens_per_s']:.1f}"
        rows.append(("runtime tokens/s", speed + " (this CPU, XNNPACK)"))
    rows.append(("result", "PASS" if result["passed"] else "FAIL: " + "; ".join(result["failures"])))
    return rows
