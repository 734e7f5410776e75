"""Export pipeline: convert into a temporary file beside the output, verify it, then move it into place.

An existing output is never left half-written: the file is built as ``.<name>.tmp-<pid><suffix>`` in the output's
folder, verified there, and ``os.replace``d onto the output only when verification passes (or is switched off).
The JSON report is written beside the output as ``<output>.report.json`` in every case, including failures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

from edge_export import bench as bench_lib
from edge_export import convert, verify as verify_lib
from edge_export.bundle import finish_bundle
from edge_export.chat_template import ChatFormat, chat_format_for
from edge_export.errors import BAD_SOURCE, VERIFICATION_FAILED, ExportError
from edge_export.quantize import check_block_size, recipe_name
from edge_export.runtime_chat import DEFAULT_CHATS, verification_rows, verify_bundle
from edge_export.sources import inspect_checkpoint, run_on_sample

DEFAULT_PROMPT = "The capital of France is"
LM_SUFFIXES = (".tflite", ".litertlm")


@dataclasses.dataclass
class ExportResult:
    """What an export produced: the installed file, its report path and the report itself."""

    output: str
    report_path: str
    report: dict


def _recipe_label(quantization: str, block_size: int) -> str | None:
    name = recipe_name(quantization)
    return name.replace("<N>", str(block_size)) if name else None


def report_path_for(output: str) -> str:
    return f"{output}.report.json"


def _versions() -> dict:
    names = ("litert-torch", "ai-edge-litert", "ai-edge-quantizer", "torch", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def _write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)


def _check_output(output: str, suffixes: tuple[str, ...]) -> Path:
    path = Path(output)
    if path.suffix not in suffixes:
        raise ExportError(
            BAD_SOURCE, f"output '{output}' must end in {' or '.join(suffixes)} (the file format is chosen by it)"
        )
    if path.is_dir():
        raise ExportError(BAD_SOURCE, f"output '{output}' is a folder; give a file path such as {output}/model.tflite")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[litert] {message}", flush=True)


def _finish(report: dict, tmp_file: str, output: Path, quiet: bool) -> ExportResult:
    """Write the report; install the file if verification passed or was skipped, else raise."""
    report_path = report_path_for(str(output))
    verification = report.get("verification")
    evaluation = report.get("eval")
    if verification is not None and verification["passed"] and evaluation is not None and not evaluation["passed"]:
        verification = {**evaluation, "hint": "use a milder --quantize, or raise --max-drop"}
    if verification is not None and not verification["passed"]:
        report["installed"] = False
        _write_json(report_path, report)
        os.unlink(tmp_file)
        failures = verification["failures"]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 and "hint" in verification else ""
        shown = failures[0] if "hint" in verification else "; ".join(failures)
        raise ExportError(
            VERIFICATION_FAILED,
            f"verification failed for {output} ({report['quantization']}): {shown}{more}; the file was not written "
            f"(report: {report_path}); {verification.get('hint', 'raise --tolerance or try a milder --quantize')}",
        )
    os.replace(tmp_file, output)
    report["installed"] = True
    _write_json(report_path, report)
    _say(f"wrote {output} ({report['file_bytes'] / 2**20:.2f} MiB) and {report_path}", quiet)
    return ExportResult(str(output), report_path, report)


def export_checkpoint(
    checkpoint_dir: str,
    output: str,
    *,
    quantize: str = "none",
    prefill_lengths: tuple[int, ...] = (32,),
    cache_length: int = 256,
    verify: bool = True,
    prompt: str = DEFAULT_PROMPT,
    verify_steps: int | None = None,
    tolerance: float | None = None,
    min_agreement: float | None = None,
    chats: list[list[dict]] | None = None,
    block_size: int = 32,
    eval_file: str | None = None,
    scorer: str = "number",
    eval_max_tokens: int = 128,
    max_drop: float = 5.0,
    num_threads: int = 1,
    benchmark: bool = False,
    quiet: bool = False,
) -> ExportResult:
    """Export an HF causal-LM folder (e.g. a ``verl train`` checkpoint) to ``.litertlm`` or ``.tflite``.

    Args:
        checkpoint_dir: folder with config.json, safetensors weights and tokenizer files (a chat template too for
            ``.litertlm``).
        output: ``*.litertlm`` (bundle with tokenizer and chat format, ``edge_export.chat_template``) or
            ``*.tflite`` (``prefill_<N>`` + ``decode``, external KV).
        quantize: ``none|dynamic-int8|weight-int8|dynamic-int4|dynamic-int4-block`` (``quantize.RECIPES``).
        block_size: input weights per int4 scale for ``dynamic-int4-block`` (32, 64, 128 or 256).
        prefill_lengths: token counts of the ``prefill_<N>`` signatures.
        cache_length: KV-cache length in tokens (prompt + generated).
        verify: check the written file against PyTorch before installing it; on failure nothing is installed and
            ``ExportError(VERIFICATION_FAILED)`` says by how much. ``.litertlm``: ``chats`` through the LiteRT-LM
            runtime (``edge_export.runtime_chat.verify_bundle``: prompt ids as the runtime prefills them, greedy
            answers, ``verify_steps`` tokens each, default 32). ``.tflite``: greedy-decode ``verify_steps``
            (default 8) tokens after ``prompt`` with our own driver, comparing logits and tokens.
        tolerance: ``.tflite``: relative logits error bound overriding ``verify.TOLERANCES[quantize]``.
        min_agreement: ``.litertlm``: least top-1 agreement over all chats' steps, overriding
            ``runtime_chat.MIN_AGREEMENT[quantize]`` (fp32 default: every step of every chat).
        chats: ``.litertlm``: message lists ending with a user turn (default ``runtime_chat.DEFAULT_CHATS``).
        eval_file: ``.litertlm``: JSONL of ``{"prompt", "answer"}`` scored through the runtime and in PyTorch
            with ``scorer`` (``edge_export.evaluate``), answers of at most ``eval_max_tokens`` tokens; the runtime
            may lose at most ``max_drop`` accuracy points, else nothing is installed (VERIFICATION_FAILED).
        num_threads: CPU threads for the LiteRT runtime and PyTorch during verification/benchmark.
        benchmark: also time prefill and decode ms/token, LiteRT vs PyTorch eager.
    Returns:
        ExportResult with the installed path and the report (also saved as ``<output>.report.json``).
    Raises:
        ExportError: bad folder, unknown quantization, conversion failure kinds, missing runtime op, failed check.

    Long for its options only: the body orders the steps (check options, convert, load PyTorch, verify, score,
    benchmark, install), each done by a helper below.
    """
    eval_items = _check_checkpoint_options(
        output, quantize, block_size, eval_file, scorer, prefill_lengths, cache_length
    )
    out = _check_output(output, LM_SUFFIXES)
    is_bundle = out.suffix == ".litertlm"
    steps = verify_steps or (32 if is_bundle else 8)
    workdir = tempfile.mkdtemp(prefix=f".{out.name}.work-", dir=out.parent)
    tmp_file = str(out.parent / f".{out.name}.tmp-{os.getpid()}{out.suffix}")
    try:
        checkpoint = inspect_checkpoint(checkpoint_dir, os.path.join(workdir, "staged"))
        for note in checkpoint.notes:
            _say(f"note: {note}", quiet)
        chat = _bundle_chat_format(checkpoint, checkpoint_dir) if is_bundle else None
        report = _convert_checkpoint(
            checkpoint,
            checkpoint_dir,
            out,
            tmp_file,
            workdir,
            chat=chat,
            quantize=quantize,
            prefill_lengths=prefill_lengths,
            cache_length=cache_length,
            block_size=block_size,
            quiet=quiet,
        )
        if verify or benchmark or eval_file is not None:
            model, tokenizer, steps, prompt_ids = _load_torch_reference(
                checkpoint, prompt, steps, cache_length, num_threads
            )
        if verify and is_bundle:
            report["verification"] = _verify_bundle_chats(
                tmp_file,
                model,
                tokenizer,
                stop_ids=chat.stop_token_ids,
                chats=chats,
                steps=steps,
                quantize=quantize,
                min_agreement=min_agreement,
                cache_length=cache_length,
                num_threads=num_threads,
                quiet=quiet,
            )
        elif verify:
            report["verification"] = _verify_tflite_decode(
                tmp_file,
                model,
                tokenizer,
                prompt=prompt,
                prompt_ids=prompt_ids,
                steps=steps,
                quantize=quantize,
                tolerance=tolerance,
                num_threads=num_threads,
                quiet=quiet,
            )
        passed = report["verification"] is None or report["verification"]["passed"]
        if eval_file is not None and passed:
            report["eval"] = _score_eval_items(
                tmp_file,
                model,
                tokenizer,
                eval_file=eval_file,
                eval_items=eval_items,
                stop_ids=chat.stop_token_ids,
                scorer=scorer,
                eval_max_tokens=eval_max_tokens,
                cache_length=cache_length,
                num_threads=num_threads,
                max_drop=max_drop,
                quiet=quiet,
            )
        if benchmark and passed:
            _say("benchmarking LiteRT vs PyTorch eager ...", quiet)
            report["benchmark"] = bench_lib.bench_causal_lm(tmp_file, prompt_ids, model, num_threads=num_threads)
            _say("benchmark\n" + verify_lib.format_table(bench_rows(report["benchmark"])), quiet)
        return _finish(report, tmp_file, out, quiet)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if os.path.exists(tmp_file):
            os.unlink(tmp_file)


def _check_checkpoint_options(
    output: str,
    quantize: str,
    block_size: int,
    eval_file: str | None,
    scorer: str,
    prefill_lengths: tuple[int, ...],
    cache_length: int,
) -> list[dict] | None:
    """Check ``export_checkpoint``'s options before minutes of conversion; read the ``--eval`` items if any.

    Returns:
        the items of ``eval_file`` (``evaluate.read_items``), or None without one.
    Raises:
        ExportError: unknown quantization or block size, ``--eval`` with a non-``.litertlm`` output, an unreadable
            eval file or scorer, prefill lengths not positive or not below ``cache_length`` (BAD_SOURCE).
    """
    recipe_name(quantize)  # fail on a bad name before minutes of conversion
    if quantize == "dynamic-int4-block":
        check_block_size(block_size)
    eval_items = None
    if eval_file is not None:
        from edge_export import evaluate

        if not output.endswith(".litertlm"):
            raise ExportError(
                BAD_SOURCE, f"--eval scores through the LiteRT-LM runtime: give a .litertlm output, not '{output}'"
            )
        eval_items = evaluate.read_items(eval_file)
        evaluate.load_scorer(scorer)
    if min(prefill_lengths, default=0) < 1 or cache_length <= max(prefill_lengths):
        raise ExportError(
            BAD_SOURCE,
            f"--prefill-lengths {list(prefill_lengths)} must be positive and below --cache-length {cache_length}",
        )
    return eval_items


def _bundle_chat_format(checkpoint, checkpoint_dir: str) -> ChatFormat:
    """The ``.litertlm`` bundle's chat format from the checkpoint's tokenizer and generation config.

    Called before conversion, since a bundle needs a chat template.
    Returns:
        the ``chat_template.ChatFormat`` (start token, stop token ids, template).
    Raises:
        ExportError: the checkpoint has no usable chat template (``chat_template.chat_format_for``).
    """
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    try:
        generation_config = GenerationConfig.from_pretrained(checkpoint.path)
    except OSError:
        generation_config = None
    return chat_format_for(tokenizer, generation_config, source=str(checkpoint_dir))


def _convert_checkpoint(
    checkpoint,
    checkpoint_dir: str,
    out: Path,
    tmp_file: str,
    workdir: str,
    *,
    chat: ChatFormat | None,
    quantize: str,
    prefill_lengths: tuple[int, ...],
    cache_length: int,
    block_size: int,
    quiet: bool,
) -> dict:
    """Convert with litert-torch ``export_hf`` into ``tmp_file``; a bundle (``chat`` given) also gets its metadata.

    Returns:
        the report without checks: source, format, quantization recipe, signatures' lengths, ``export_seconds``
        (conversion wall time, seconds), ``file_bytes``, versions; ``verification``/``eval``/``benchmark`` None.
    Raises:
        ExportError: the conversion failure kinds of ``convert.export_causal_lm``.
    """
    is_bundle = chat is not None
    _say(f"exporting {checkpoint.model_type} from {checkpoint_dir} with litert-torch export_hf ...", quiet)
    start = time.perf_counter()
    with convert.quiet_stdout(quiet):
        convert.export_causal_lm(
            checkpoint,
            tmp_file,
            workdir,
            bundle=is_bundle,
            quantization=quantize,
            prefill_lengths=list(prefill_lengths),
            cache_length=cache_length,
            block_size=block_size,
        )
        if is_bundle:
            finish_bundle(tmp_file, tmp_file, chat, os.path.join(workdir, "bundle"), quantize, block_size)
    report = {
        "source": str(checkpoint_dir),
        "output": str(out),
        "kind": "causal-lm",
        "format": out.suffix[1:],
        "model_type": checkpoint.model_type,
        "quantization": quantize,
        "recipe": _recipe_label(quantize, block_size),
        "prefill_lengths": list(prefill_lengths),
        "cache_length": cache_length,
        "export_seconds": round(time.perf_counter() - start, 2),
        "file_bytes": os.path.getsize(tmp_file),
        "notes": checkpoint.notes,
        "versions": _versions(),
        "verification": None,
        "eval": None,
        "benchmark": None,
    }
    if is_bundle:
        report["chat_format"] = {"start_token": chat.start_token, "stop_token_ids": list(chat.stop_token_ids)}
    return report


def _load_torch_reference(checkpoint, prompt: str, steps: int, cache_length: int, num_threads: int) -> tuple:
    """The PyTorch side of the checks: the float32 model in eval mode on ``num_threads`` CPU threads.

    Returns:
        (model, tokenizer, steps clipped to 1..cache_length-1, ``prompt``'s ids cut to leave ``steps`` KV slots).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    steps = max(1, min(steps, cache_length - 1))
    prompt_ids = tokenizer(prompt)["input_ids"][-(cache_length - steps) :] or [0]
    return model, tokenizer, steps, prompt_ids


def _verify_bundle_chats(
    tmp_file: str,
    model,
    tokenizer,
    *,
    stop_ids: tuple[int, ...],
    chats: list[list[dict]] | None,
    steps: int,
    quantize: str,
    min_agreement: float | None,
    cache_length: int,
    num_threads: int,
    quiet: bool,
) -> dict:
    """Run ``chats`` through the LiteRT-LM runtime against PyTorch (``runtime_chat.verify_bundle``), ``steps`` each.

    Returns:
        the ``verify_bundle`` result (its ``passed``/``failures``; a bundle the runtime cannot load fails there).
    """
    _say(
        f"verifying {len(chats or DEFAULT_CHATS)} chats x {steps} greedy steps through the LiteRT-LM "
        "runtime against PyTorch ...",
        quiet,
    )
    result = verify_bundle(
        tmp_file,
        model,
        tokenizer,
        quantization=quantize,
        stop_ids=stop_ids,
        chats=chats,
        steps=steps,
        cache_length=cache_length,
        num_threads=num_threads,
        min_agreement=min_agreement,
    )
    _say("verification\n" + verify_lib.format_table(_verification_rows(result)), quiet)
    return result


def _verify_tflite_decode(
    tmp_file: str,
    model,
    tokenizer,
    *,
    prompt: str,
    prompt_ids: list[int],
    steps: int,
    quantize: str,
    tolerance: float | None,
    num_threads: int,
    quiet: bool,
) -> dict:
    """Greedy-decode ``steps`` tokens of the ``.tflite`` (``prefill_<N>`` + ``decode``) against PyTorch's logits.

    Returns:
        the ``verify.verify_causal_lm`` result plus ``prompt`` and ``litert_text`` (the LiteRT tokens decoded).
    """
    _say(f"verifying {steps} greedy steps with the LiteRT runtime against PyTorch ...", quiet)
    bound = verify_lib.TOLERANCES[quantize]
    if tolerance is not None:
        bound = dataclasses.replace(bound, relative_error=tolerance)
    result = verify_lib.verify_causal_lm(tmp_file, model, prompt_ids, steps, bound, num_threads)
    result["prompt"] = prompt
    result["litert_text"] = tokenizer.decode(result["litert_tokens"])
    _say("verification\n" + verify_lib.format_table(_verification_rows(result)), quiet)
    return result


def _score_eval_items(
    tmp_file: str,
    model,
    tokenizer,
    *,
    eval_file: str,
    eval_items: list[dict],
    stop_ids: tuple[int, ...],
    scorer: str,
    eval_max_tokens: int,
    cache_length: int,
    num_threads: int,
    max_drop: float,
    quiet: bool,
) -> dict:
    """Score ``eval_items`` through the LiteRT-LM runtime and in PyTorch (``evaluate.evaluate_bundle``).

    Returns:
        the evaluation dict: both task accuracies in percent, ``disagreements``, ``passed`` (the runtime lost at
        most ``max_drop`` points) and ``failures``.
    """
    from edge_export import evaluate

    _say(f"scoring {len(eval_items)} items of {eval_file} through the runtime and in PyTorch ...", quiet)
    found = evaluate.evaluate_bundle(
        tmp_file,
        model,
        tokenizer,
        eval_items,
        stop_ids=stop_ids,
        scorer=scorer,
        max_tokens=eval_max_tokens,
        cache_length=cache_length,
        num_threads=num_threads,
        max_drop_points=max_drop,
    )
    _say(
        f"task accuracy: runtime {found['runtime_accuracy']:.1f}%, PyTorch {found['torch_accuracy']:.1f}% "
        f"({found['disagreements']} of {len(eval_items)} items scored differently)",
        quiet,
    )
    return found


def export_module(
    module: torch.nn.Module,
    sample_inputs: tuple[torch.Tensor, ...],
    output: str,
    *,
    quantize: str = "none",
    dynamic_shapes=None,
    verify: bool = True,
    tolerance: float | None = None,
    num_threads: int = 1,
    benchmark: bool = False,
    name: str = "module",
    block_size: int = 32,
    quiet: bool = False,
) -> ExportResult:
    """Export a plain ``nn.Module`` to a one-signature ``.tflite`` via ``litert_torch.convert``.

    Args:
        sample_inputs: positional tensors; shapes/dtypes are frozen into the file (int64 runs as int32).
        dynamic_shapes: ``torch.export`` dynamic shapes, if any (often not lowerable: ``ExportError(DYNAMIC_DIM)``).
        Others as in ``export_checkpoint``; verification compares outputs on ``sample_inputs``.
    Raises:
        ExportError: unknown quantization, sample inputs the module's forward rejects (``BAD_INPUT_SPEC``),
            conversion failure kinds, missing runtime op, failed check.
    """
    recipe_name(quantize)
    if quantize == "dynamic-int4-block":
        check_block_size(block_size)
    out = _check_output(output, (".tflite",))
    workdir = tempfile.mkdtemp(prefix=f".{out.name}.work-", dir=out.parent)
    tmp_file = str(out.parent / f".{out.name}.tmp-{os.getpid()}{out.suffix}")
    torch.set_num_threads(num_threads)
    try:
        notes = convert.int64_notes(sample_inputs, run_on_sample(module, sample_inputs, name))
        for note in notes:
            _say(f"note: {note}", quiet)
        _say(f"converting {name} with litert_torch.convert ...", quiet)
        start = time.perf_counter()
        with convert.quiet_stdout(quiet):
            convert.export_plain_module(
                module,
                tuple(sample_inputs),
                tmp_file,
                workdir,
                quantization=quantize,
                dynamic_shapes=dynamic_shapes,
                name=name,
                block_size=block_size,
            )
        report = {
            "source": name,
            "output": str(out),
            "kind": "module",
            "format": "tflite",
            "quantization": quantize,
            "recipe": _recipe_label(quantize, block_size),
            "inputs": [f"{'x'.join(map(str, t.shape))}:{str(t.dtype).removeprefix('torch.')}" for t in sample_inputs],
            "export_seconds": round(time.perf_counter() - start, 2),
            "file_bytes": os.path.getsize(tmp_file),
            "notes": notes,
            "versions": _versions(),
            "verification": None,
            "benchmark": None,
        }
        if verify:
            _say("verifying with the LiteRT runtime against PyTorch ...", quiet)
            bound = verify_lib.TOLERANCES[quantize]
            if tolerance is not None:
                bound = dataclasses.replace(bound, relative_error=tolerance)
            report["verification"] = verify_lib.verify_module(tmp_file, module, sample_inputs, bound, num_threads)
            _say("verification\n" + verify_lib.format_table(_verification_rows(report["verification"])), quiet)
        if benchmark and (report["verification"] is None or report["verification"]["passed"]):
            report["benchmark"] = bench_lib.bench_module(tmp_file, sample_inputs, module, num_threads)
            _say("benchmark\n" + verify_lib.format_table(bench_rows(report["benchmark"])), quiet)
        return _finish(report, tmp_file, out, quiet)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if os.path.exists(tmp_file):
            os.unlink(tmp_file)


def _verification_rows(result: dict) -> list[tuple[str, str]]:
    if result.get("runtime") == "litert_lm":
        return verification_rows(result)
    rows = [
        ("max abs error", f"{result['max_abs_error']:.4g}"),
        ("relative error", f"{result['relative_error']:.3g} (bound {result['tolerance']['relative_error']:.3g})"),
    ]
    if "greedy_agreed_steps" in result:
        rows.append(("greedy agreement", f"{result['greedy_agreed_steps']}/{result['steps']} steps"))
        rows.append(("top-1 agreement", f"{result['top1_agreement']:.0%}"))
    rows.append(("result", "PASS" if result["passed"] else "FAIL: " + "; ".join(result["failures"])))
    return rows


def bench_rows(result: dict) -> list[tuple[str, str]]:
    rows = [("file size", f"{result['file_bytes'] / 2**20:.2f} MiB"), ("threads", str(result["threads"]))]
    for key, label in (
        ("litert_ms", "LiteRT ms/call"),
        ("torch_ms", "PyTorch ms/call"),
        ("litert_over_torch", "LiteRT / PyTorch"),
        ("litert_prefill_ms", "LiteRT prefill ms"),
        ("torch_prefill_ms", "PyTorch prefill ms"),
        ("litert_decode_ms_per_token", "LiteRT decode ms/token"),
        ("torch_decode_ms_per_token", "PyTorch decode ms/token"),
        ("decode_litert_over_torch", "decode LiteRT / PyTorch"),
        ("litert_prefill_tokens_per_s", "LiteRT-LM prefill tokens/s"),
        ("litert_decode_tokens_per_s", "LiteRT-LM decode tokens/s"),
        ("torch_prefill_tokens_per_s", "PyTorch prefill tokens/s"),
        ("torch_decode_tokens_per_s", "PyTorch decode tokens/s"),
        ("time_to_first_token_s", "LiteRT-LM first token s"),
        ("litert_peak_rss_gib", "LiteRT-LM peak RSS GiB"),
    ):
        if key in result:
            rows.append((label, f"{result[key]:.3f}"))
    return rows
