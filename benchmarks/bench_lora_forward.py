"""Where the rollout applies a LoRA adapter: merged into its weights at each sync, or as an unmerged LoRA forward.

The rollout server merges each synced adapter (``W + scaling * B @ A``) into its own copy of the weights, so the
sampler's fast paths run unchanged. The alternative keeps ``W`` and adds ``scaling * (x @ A.T) @ B.T`` to every
adapted linear layer at every forward. This script measures both on the default model (SmolLM2-135M-Instruct, float32,
one torch thread), rank ``--rank`` on every linear layer of the decoder (A and B random, B non-zero):

- ``merge s``: merging the adapter into the weights once (what each sync costs the merged way);
- ``generate s``: the sampler generating ``--prompts`` x ``--samples`` completions of ``--tokens`` tokens at
  temperature 1 with a fixed seed, merged against unmerged (median of ``--repeats``). Both run the sampler with
  its packed weights but without lean decode and packed prefill, which multiply by fused q/k/v and gate/up copies
  that an unmerged adapter cannot join without a fused LoRA of its own: so the unmerged side is measured at its best
  case against a merged side slower than the default;
- the first completions' token ids must be equal on both sides (the two forwards compute the same model; float32
  rounding may part them late in a long sample: the count of equal completions is printed).

    python benchmarks/bench_lora_forward.py [--rank 16] [--prompts 4] [--samples 4] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def adapters(model: torch.nn.Module, rank: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (A (rank, in), B (out, rank)) float32 for every linear layer of the decoder (not the LM head)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers."):
            a = torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5
            b = torch.randn(m.out_features, rank, generator=g) * 1e-3
            out[name] = (a, b)
    return out


def merge(model: torch.nn.Module, lora: dict, scaling: float) -> None:
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, b) in lora.items():
            mods[name].weight.add_(scaling * (b @ a))


def unmerged_hooks(model: torch.nn.Module, lora: dict, scaling: float) -> list:
    mods = dict(model.named_modules())
    handles = []
    for name, (a, b) in lora.items():

        def hook(module, args, output, a=a, b=b):
            return output + scaling * torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b)

        handles.append(mods[name].register_forward_hook(hook))
    return handles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_tpu.sampler import Sampler, SamplingParams
    from verl_backend.models import ensure_default_model

    path = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    lora = adapters(base, args.rank)
    scaling = 2.0  # lora_alpha / rank with alpha = 2 * rank
    merged = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    start = time.perf_counter()
    merge(merged, lora, scaling)
    merge_s = time.perf_counter() - start
    unmerged_hooks(base, lora, scaling)
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": f"What is {i + 3} * {i + 7}?"}], tokenize=False, add_generation_prompt=True
            )
        )["input_ids"]
        for i in range(args.prompts)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, n=args.samples, seed=1)
    results = {}
    for label, model in (("merged", merged), ("unmerged", base)):
        sampler = Sampler(
            model,
            pad_token_id=tok.pad_token_id or 0,
            eos_token_ids=[tok.eos_token_id],
            packed_weights=True,
            packed_prefill=False,
            lean_decode=False,
        )
        times, outs = [], None
        for _ in range(args.repeats + 1):  # the first packs the weights: not timed
            start = time.perf_counter()
            outs = sampler.generate(prompts, params)
            times.append(time.perf_counter() - start)
        results[label] = (statistics.median(times[1:]), outs)
    equal = sum(a.token_ids == b.token_ids for a, b in zip(results["merged"][1], results["unmerged"][1]))
    tokens = sum(len(o.token_ids) for o in results["merged"][1])
    m, u = results["merged"][0], results["unmerged"][0]
    print(
        f"SmolLM2-135M fp32, LoRA rank {args.rank} on {len(lora)} linear layers, {args.prompts} x {args.samples} "
        f"samples, {tokens} tokens generated, one thread"
    )
    print("| adapter applied | merge s (per sync) | generate s | vs merged |")
    print("|---|---|---|---|")
    print(f"| merged into the weights | {merge_s:.3f} | {m:.2f} | 1.00x |")
    print(f"| unmerged LoRA forward | 0 | {u:.2f} | {u / m:.2f}x |")
    print(f"equal completions: {equal} of {len(results['merged'][1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
