"""Seconds per GRPO step's parts with each fast path on and off, per model family, at about SmolLM2-135M's size.

Fast paths pay at size, not on the tiny test models, so each family here is a random-weight model shaped like
SmolLM2-135M (hidden 576, 30 layers, 9 query / 3 key-value heads, MLP 1536, its 49,152-token vocabulary; the
family's own features on top: Qwen3's query/key norms, Gemma3's sliding and global layers with a 512-token window,
Mistral's window, Qwen3-MoE's 8 experts of width 384 with 2 active). One GRPO step's work on the default job's shape
(4 prompts x 4 samples, prompts of 60-80 tokens, 64-token responses), on one thread, float32:

- ``update``: the actor's forward + backward over the 16 sequences as the CPU trainer packs them: VeRL's packed row
  with the LM head at every position (both fast paths off), at response positions only (``response_only_logits``),
  and the shared-prefix row (``use_prefix_grouper``, with response-only logits);
- ``rollout``: the native sampler generating the 16 responses (64 tokens, greedy), with packed prefill and lean
  decode on (where the family allows them; otherwise they fall back, said on stderr) and off.

Each cell is the median of ``--repeats`` timings after one warm-up (``--warmup cell``), or after one warm-up
update and rollout per model (``--warmup model``: about half the time, for a loaded machine); the ratio columns are
off / on (> 1: the fast path pays). Numbers are for this CPU, not a TPU. The last line gives the load average.

    python benchmarks/bench_family_fastpaths.py [--families llama,qwen3,gemma3,mistral,qwen3_moe] [--repeats 3]
        [--warmup cell|model]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
FAMILY_SIZE = {  # what differs from SmolLM2's shape per family (tests/families.py sets the family's features)
    "gemma3": {
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
        "query_pre_attn_scalar": 64,
    },
    "mistral": {"sliding_window": 512},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384},
}


def _batch(g: torch.Generator):
    """VeRL's no-padding micro batch of 4 prompts x 4 samples: (TensorDict, prompts, responses)."""
    from tensordict import TensorDict

    def nested(rows):
        return torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)

    prompts, responses = [], []
    for n in (60, 68, 74, 80):
        p = torch.randint(10, 40000, (n,), generator=g).tolist()
        for _ in range(4):
            prompts.append(p)
            responses.append(torch.randint(10, 40000, (64,), generator=g).tolist())
    td = TensorDict(
        {
            "prompts": nested(prompts),
            "responses": nested(responses),
            "input_ids": nested([p + r for p, r in zip(prompts, responses)]),
        },
        batch_size=[len(prompts)],
    )
    td["position_ids"] = nested([list(range(len(p) + len(r))) for p, r in zip(prompts, responses)])
    return td, prompts, responses


def _update(model, td, mode: str) -> float:
    """Seconds for one forward + backward of the micro batch in ``mode`` (``all``, ``response``, ``shared``)."""
    from verl.utils.torch_functional import logprobs_from_logits

    from verl_backend.workers.response_logits import response_logit_indices
    from verl_backend.workers.shared_prefix import attention_kinds, shared_prefix_inputs

    keep = response_logit_indices(td)
    labels = torch.roll(td["input_ids"].values(), shifts=-1)[keep]
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    if mode == "shared":
        kinds = attention_kinds(model)
        inputs, row_keep = shared_prefix_inputs(td, kinds, torch.float32)
        logits = model(**inputs, use_cache=False, logits_to_keep=row_keep).logits[0]
    else:
        ids, pos = td["input_ids"].values().unsqueeze(0), td["position_ids"].values().unsqueeze(0)
        kw = {"logits_to_keep": keep} if mode == "response" else {}
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits[0]
        if mode == "all":
            logits = logits[keep]
    logprobs_from_logits(logits, labels).sum().backward()
    return time.perf_counter() - start


def _rollout(model, prompts, fast: bool) -> float:
    from rl_tpu.sampler import Sampler, SamplingParams

    sampler = Sampler(model, pad_token_id=0, eos_token_ids=[], packed_prefill=fast, lean_decode=fast, max_batch_size=16)
    distinct = list(dict.fromkeys(tuple(p) for p in prompts))
    start = time.perf_counter()
    with torch.no_grad():
        sampler.generate([list(p) for p in distinct], SamplingParams(n=4, temperature=0, max_new_tokens=64))
    return time.perf_counter() - start


def main() -> int:
    from families import FAMILIES, build_tiny_model
    from transformers import AutoModelForCausalLM

    from verl_backend.models import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--families",
        default="llama,qwen3,gemma3,mistral,qwen3_moe",
        help=f"comma-separated, from: {', '.join(FAMILIES)}",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median; one warm-up before)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument(
        "--warmup",
        choices=["cell", "model"],
        default="cell",
        help="one untimed run before each cell, or one update and one rollout per model",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    td, prompts, _ = _batch(torch.Generator().manual_seed(0))
    head = (
        "family",
        "params M",
        "update all s",
        "response-only s",
        "shared prefix s",
        "update off/on",
        "rollout off s",
        "rollout on s",
        "rollout off/on",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = build_tiny_model(
                family,
                ensure_default_model(),
                Path(tmp) / family,
                weight_std=0.02,
                **{**SMOLLM2, **FAMILY_SIZE.get(family, {})},
            )
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")

            def median(fn, *a):
                if args.warmup == "cell":
                    fn(*a)
                return statistics.median(fn(*a) for _ in range(args.repeats))

            if args.warmup == "model":
                model.train()
                _update(model, td, "shared")
                model.eval()
                _rollout(model, prompts, True)
            model.train()
            upd = {m: median(_update, model, td, m) for m in ("all", "response", "shared")}
            model.eval()
            off, on = median(_rollout, model, prompts, False), median(_rollout, model, prompts, True)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            print(
                f"| {family} | {params:.0f} | {upd['all']:.2f} | {upd['response']:.2f} | {upd['shared']:.2f} | "
                f"{upd['all'] / upd['shared']:.2f} | {off:.2f} | {on:.2f} | {off / on:.2f} |",
                flush=True,
            )
            del model
    load = os.getloadavg()
    print(
        f"\n{args.threads} torch thread(s), median of {args.repeats}, warm-up per {args.warmup}; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
