"""``litert``: export trained checkpoints and PyTorch modules to verified LiteRT files, and benchmark them.

    litert export SOURCE -o OUT [--quantize none|dynamic-int8|weight-int8|dynamic-int4|dynamic-int4-block] [...]
    litert verify FILE.litertlm --source SOURCE [...]
    litert bench FILE [--source SOURCE] [...]

Exit status: 0 done; 1 bad input or a conversion failure (one line on stderr says what to change); 2 bad command
line; 3 verification failed (the output was not written; the report says by how much).
"""

from __future__ import annotations

import argparse
import os
import sys

from edge_export.errors import BAD_INPUT_SPEC, VERIFICATION_FAILED, ExportError
from edge_export.quantize import RECIPES

EXAMPLES = """examples:
  litert export runs/ckpt/actor/huggingface -o out/model.litertlm --quantize dynamic-int8
  litert export runs/ckpt/actor/huggingface -o out/model.tflite --prefill-lengths 32,128 --cache-length 512
  litert export torchvision.models:mobilenet_v3_small -o out/mnv3.tflite --input 1x3x224x224:float32
  litert verify out/model.litertlm --source runs/ckpt/actor/huggingface --quantize dynamic-int8
  litert bench out/model.tflite --source runs/ckpt/actor/huggingface
"""


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers, e.g. 32,128")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': lengths must be positive")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The ``litert`` parser: ``export``, ``verify`` and ``bench``, sharing the common and ``--eval`` options."""
    parser = argparse.ArgumentParser(
        prog="litert",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common, evaluation = _common_options(), _eval_options()
    export = _add_export_command(sub, [common, evaluation])
    _add_export_check_options(export)
    _add_verify_command(sub, [common, evaluation])
    _add_bench_command(sub, [common])
    return parser


def _common_options() -> argparse.ArgumentParser:
    """Returns the parent parser of options every subcommand takes (module inputs, prompt, threads, debug)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE:DTYPE",
        help="module SOURCE only: one per positional input, e.g. 1x3x224x224:float32; a size "
        "written name=N (batch=2x16:float32) asks for a dynamic dimension",
    )
    common.add_argument(
        "--prompt", default=None, help="causal LMs: text to verify/benchmark with (default: 'The capital of France is')"
    )
    common.add_argument("--threads", type=int, default=1, help="CPU threads for LiteRT and PyTorch (default 1)")
    common.add_argument("--debug", action="store_true", help="show stack traces instead of one-line errors")
    return common


def _eval_options() -> argparse.ArgumentParser:
    """Returns the parent parser of the ``--eval`` options (task accuracy through the LiteRT-LM runtime)."""
    evaluation = argparse.ArgumentParser(add_help=False)
    evaluation.add_argument(
        "--eval",
        default=None,
        metavar="FILE.jsonl",
        help='.litertlm: score {"prompt", "answer"} lines through the LiteRT-LM runtime and in PyTorch; '
        "exit 3 when the runtime loses more than --max-drop accuracy points",
    )
    evaluation.add_argument(
        "--scorer",
        default="number",
        metavar="NAME",
        help="--eval scorer: number (last number equal, GSM8K-style), exact, or package.module:function "
        "(e.g. verl_backend.data.rewards:compute_score for reasoning-gym/GSM8K items) (default number)",
    )
    evaluation.add_argument(
        "--eval-max-tokens", type=int, default=128, help="--eval: answer tokens per item (default 128)"
    )
    evaluation.add_argument(
        "--max-drop",
        type=float,
        default=5.0,
        metavar="POINTS",
        help="--eval: accuracy points the runtime may lose against PyTorch (default 5)",
    )
    return evaluation


def _add_export_command(sub, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``export`` with its conversion options (source, output, quantization, signatures); returns its parser."""
    ex = sub.add_parser(
        "export",
        parents=parents,
        help="convert, quantize, verify, write",
        description="Convert SOURCE to a LiteRT file, verify it against PyTorch, then write OUT.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument(
        "source",
        metavar="SOURCE",
        help="HF causal-LM folder (config.json + *.safetensors + tokenizer) or package.module:factory",
    )
    ex.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="*.litertlm (LM bundle, tokenizer inside) or *.tflite; the report goes to OUT.report.json",
    )
    ex.add_argument(
        "--quantize",
        default="none",
        metavar="|".join(RECIPES),
        help="ai-edge-quantizer recipe: none, dynamic-int8 (int8 weights and activations), "
        "weight-int8 (int8 weights), dynamic-int4 (int4 weights, one scale per channel), "
        "dynamic-int4-block (int4 weights, one scale per --block-size weights) (default none)",
    )
    ex.add_argument(
        "--block-size",
        type=int,
        default=32,
        metavar="N",
        help="dynamic-int4-block: weights per scale, 32, 64, 128 or 256 (default 32)",
    )
    ex.add_argument(
        "--prefill-lengths",
        type=_positive_ints,
        default=(32,),
        metavar="N[,N...]",
        help="causal LMs: one prefill_<N> signature per length (default 32)",
    )
    ex.add_argument("--cache-length", type=int, default=256, help="causal LMs: KV-cache tokens (default 256)")
    return ex


def _add_export_check_options(ex: argparse.ArgumentParser) -> None:
    """Add ``export``'s verification and benchmark options (``--no-verify`` ... ``--quiet``) to ``ex``."""
    ex.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip running the file with the LiteRT runtime against PyTorch",
    )
    ex.add_argument(
        "--verify-steps",
        type=int,
        default=None,
        help="causal LMs: greedy steps to compare (default 32 per chat for .litertlm, 8 for .tflite)",
    )
    ex.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help=".tflite and modules: relative error bound (max abs error / max |PyTorch output|) replacing "
        "the default for the quantization (none 1e-3, weight-int8 0.1, dynamic-int8 0.2, "
        "dynamic-int4 0.75)",
    )
    ex.add_argument(
        "--min-agreement",
        type=float,
        default=None,
        metavar="SHARE",
        help=".litertlm: least share of greedy steps where the LiteRT-LM runtime and PyTorch pick the "
        "same token, over 8 chats (default: none 1.0 = every step, int8 0.9, dynamic-int4 0.5)",
    )
    ex.add_argument("--benchmark", action="store_true", help="also time LiteRT vs PyTorch eager")
    ex.add_argument("--quiet", action="store_true", help="print only the final summary line")


def _add_verify_command(sub, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``verify`` (an existing ``.litertlm`` through the LiteRT-LM runtime against its checkpoint)."""
    ve = sub.add_parser(
        "verify",
        parents=parents,
        help="check a .litertlm through the LiteRT-LM runtime",
        description="Run 8 chats through the LiteRT-LM runtime (CPU, greedy) and compare the prompt "
        "it prefills and its answers with PyTorch on --source. Exit 3 when they differ.",
    )
    ve.add_argument("file", metavar="FILE", help="a .litertlm bundle")
    ve.add_argument("--source", required=True, help="the checkpoint folder FILE was exported from")
    ve.add_argument(
        "--quantize",
        default="none",
        metavar="|".join(RECIPES),
        help="how FILE was quantized: picks the default --min-agreement (default none)",
    )
    ve.add_argument(
        "--min-agreement",
        type=float,
        default=None,
        metavar="SHARE",
        help="least share of greedy steps where runtime and PyTorch agree (default by --quantize)",
    )
    ve.add_argument("--verify-steps", type=int, default=32, help="greedy steps per chat (default 32)")


def _add_bench_command(sub, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``bench`` (time a ``.tflite`` or ``.litertlm`` with the LiteRT runtime, PyTorch eager beside it)."""
    be = sub.add_parser(
        "bench",
        parents=parents,
        help="time a LiteRT file (vs PyTorch with --source)",
        description="Time FILE with the LiteRT runtime; with --source also PyTorch eager.",
    )
    be.add_argument("file", metavar="FILE", help="a .tflite or .litertlm written by litert export")
    be.add_argument("--source", default=None, help="the SOURCE it was exported from, for the PyTorch figures")
    be.add_argument("--steps", type=int, default=32, help="causal LMs: decode steps to time (default 32)")


def _module_inputs(specs: list[str], source: str):
    from edge_export.sources import dynamic_shapes_for, parse_input_spec

    if not specs:
        raise ExportError(
            BAD_INPUT_SPEC,
            f"SOURCE '{source}' is a module: give its inputs with --input "
            "SHAPE:DTYPE (e.g. --input 1x3x224x224:float32), once per argument",
        )
    import torch

    parsed = [parse_input_spec(s) for s in specs]
    generator = torch.Generator().manual_seed(0)
    return tuple(p.sample(generator) for p in parsed), dynamic_shapes_for(parsed)


def _run_export(args) -> int:
    from edge_export import export as export_lib
    from edge_export.quantize import recipe_name
    from edge_export.sources import is_checkpoint_dir, load_factory

    recipe_name(args.quantize)
    if is_checkpoint_dir(args.source):
        result = export_lib.export_checkpoint(
            args.source,
            args.output,
            quantize=args.quantize,
            prefill_lengths=args.prefill_lengths,
            cache_length=args.cache_length,
            verify=args.verify,
            prompt=args.prompt or export_lib.DEFAULT_PROMPT,
            verify_steps=args.verify_steps,
            tolerance=args.tolerance,
            min_agreement=args.min_agreement,
            block_size=args.block_size,
            eval_file=args.eval,
            scorer=args.scorer,
            eval_max_tokens=args.eval_max_tokens,
            max_drop=args.max_drop,
            num_threads=args.threads,
            benchmark=args.benchmark,
            quiet=args.quiet,
        )
    else:
        module = load_factory(args.source)
        sample, dynamic = _module_inputs(args.input, args.source)
        result = export_lib.export_module(
            module,
            sample,
            args.output,
            quantize=args.quantize,
            dynamic_shapes=dynamic,
            verify=args.verify,
            tolerance=args.tolerance,
            num_threads=args.threads,
            benchmark=args.benchmark,
            name=args.source,
            block_size=args.block_size,
            quiet=args.quiet,
        )
    report = result.report
    check = report["verification"]
    if report.get("eval"):
        found = report["eval"]
        print(
            f"task accuracy through LiteRT-LM {found['runtime_accuracy']:.1f}%, PyTorch "
            f"{found['torch_accuracy']:.1f}% on {len(found['items'])} items"
        )
    if check is None:
        summary = "not verified"
    elif check.get("runtime") == "litert_lm":
        summary = (
            f"verified through LiteRT-LM: {len(check['chats'])} chats, prompts as apply_chat_template, "
            f"top-1 agreement {check['top1_agreement']:.1%} of {check['compared_steps']} greedy steps"
        )
    else:
        summary = f"verified: max abs error {check['max_abs_error']:.3g}" + (
            f", greedy {check['greedy_agreed_steps']}/{check['steps']}" if "steps" in check else ""
        )
    print(
        f"{result.output}: {report['kind']} {report['format']}, {report['quantization']}, "
        f"{report['file_bytes'] / 2**20:.2f} MiB, {summary}"
    )
    return 0


def _run_bench(args) -> int:
    import torch

    from edge_export import bench as bench_lib
    from edge_export.errors import BAD_FILE
    from edge_export.export import DEFAULT_PROMPT, bench_rows
    from edge_export.sources import is_checkpoint_dir, load_factory, run_on_sample
    from edge_export.verify import format_table

    if not os.path.isfile(args.file):
        raise ExportError(BAD_FILE, f"FILE '{args.file}' does not exist; give a .tflite or .litertlm")
    if args.file.endswith(".litertlm"):  # through the LiteRT-LM runtime's own Benchmark API
        result = bench_lib.bench_litertlm(args.file, num_threads=args.threads, decode_tokens=args.steps)
        if args.source:
            if not is_checkpoint_dir(args.source):
                raise ExportError(BAD_FILE, f"--source '{args.source}' is not a model folder with config.json")
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
            result.update(bench_lib.torch_tokens_per_s(model, result["prefill_tokens"], args.steps, args.threads))
        print(f"{args.file} (this CPU, XNNPACK: not a phone)\n" + format_table(bench_rows(result)))
        return 0
    from edge_export.runtime import load_interpreter

    if "decode" in load_interpreter(args.file).get_signature_list():
        model, prompt_ids = None, list(range(1, 17))
        if args.source:
            if not is_checkpoint_dir(args.source):
                raise ExportError(BAD_FILE, f"--source '{args.source}' is not a model folder with config.json")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
            prompt_ids = AutoTokenizer.from_pretrained(args.source)(args.prompt or DEFAULT_PROMPT)["input_ids"]
        result = bench_lib.bench_causal_lm(args.file, prompt_ids, model, steps=args.steps, num_threads=args.threads)
    else:
        module = load_factory(args.source) if args.source else None
        if args.input:
            sample, _ = _module_inputs(args.input, args.source or args.file)
        else:  # the file fixes its input shapes: sample from them
            from edge_export.runtime import TFLiteModule

            lite = TFLiteModule(args.file)
            details = lite.runner.get_input_details()
            generator = torch.Generator().manual_seed(0)
            sample = tuple(
                torch.randn(tuple(details[n]["shape"]), generator=generator).numpy().astype(details[n]["dtype"])
                for n in lite.input_names
            )
            sample = tuple(torch.from_numpy(a) for a in sample)
        if module is not None:
            run_on_sample(module, sample, args.source)
        result = bench_lib.bench_module(args.file, sample, module, num_threads=args.threads)
    print(f"{args.file}\n" + format_table(bench_rows(result)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "verify":
            from edge_export.check_bundle import verify_litertlm

            result = verify_litertlm(
                args.file,
                args.source,
                quantize=args.quantize,
                steps=args.verify_steps,
                min_agreement=args.min_agreement,
                num_threads=args.threads,
                eval_file=args.eval,
                scorer=args.scorer,
                eval_max_tokens=args.eval_max_tokens,
                max_drop=args.max_drop,
            )
            if result.get("eval"):
                found = result["eval"]
                print(
                    f"task accuracy through LiteRT-LM {found['runtime_accuracy']:.1f}%, PyTorch "
                    f"{found['torch_accuracy']:.1f}% on {len(found['items'])} items"
                )
            print(
                f"{args.file}: verified through LiteRT-LM, top-1 agreement {result['top1_agreement']:.1%} of "
                f"{result['compared_steps']} greedy steps"
            )
            return 0
        return _run_export(args) if args.command == "export" else _run_bench(args)
    except ExportError as err:
        if args.debug:
            raise
        print(f"litert {args.command}: error: {err}", file=sys.stderr)
        return 3 if err.kind == VERIFICATION_FAILED else 1
    except KeyboardInterrupt:
        print(f"litert {args.command}: interrupted; the output was not written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
