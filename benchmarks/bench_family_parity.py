"""Sampler log-prob parity per model family and path: the table the per-family tests hold to 1e-4.

For each family of ``tests/families.py`` (tiny random models with the SmolLM2 tokenizer: Llama, Qwen2, Qwen2 with
a sliding window, Qwen3, Mistral, Gemma3, Qwen3-MoE; sliding windows of 5 tokens, prompts of 10-31), the native
sampler generates 12 tokens for 4 prompts x 2 samples, greedy and at temperature 1, with packed prefill and lean
decode each on and off; each sample is scored by one plain Hugging Face forward over prompt + response. Prints the
max |log-prob difference| per cell and whether each fast path actually ran (``-``: it fell back to the model's
forward, the reason said once on stderr).

    python benchmarks/bench_family_parity.py [--families llama,qwen3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    from families import FAMILIES, build_tiny_model
    from transformers import AutoModelForCausalLM

    from rl_tpu.sampler import Sampler, SamplingParams
    from verl_backend.models import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names from tests/families.py")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 40000, (9,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 40000, (n,), generator=g).tolist() for n in (3, 14, 1, 22)]
    params = {
        "greedy": SamplingParams(n=2, temperature=0, max_new_tokens=12),
        "T=1": SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1),
    }
    print(f"{'family':14s} {'packed prefill':>14s} {'lean decode':>11s} {'greedy':>9s} {'T=1':>9s}")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = build_tiny_model(family, ensure_default_model(), Path(tmp) / family)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
            for packed in (True, False):
                for lean in (True, False):
                    cells, used = [], ("", "")
                    for p in params.values():
                        s = Sampler(model, pad_token_id=0, eos_token_ids=[], packed_prefill=packed, lean_decode=lean)
                        outs = s.generate(prompts, p)
                        err = 0.0
                        for i, o in enumerate(outs):
                            prompt = prompts[i // p.n]
                            with torch.no_grad():
                                logits = model(torch.tensor([prompt + o.token_ids])).logits[0, len(prompt) - 1 : -1]
                            t = p.temperature or 1.0
                            ref = (logits / t).log_softmax(-1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
                            err = max(err, float((torch.tensor(o.logprobs) - ref).abs().max()))
                        cells.append(err)
                        ran_packed = all(b == 1 for b, q, _ in s.shapes_seen if q > 1)
                        used = (
                            "on" if ran_packed else "-" if packed else "off",
                            "on" if s.lean is not None else "-" if lean else "off",
                        )
                    print(f"{family:14s} {used[0]:>14s} {used[1]:>11s} {cells[0]:9.1e} {cells[1]:9.1e}", flush=True)


if __name__ == "__main__":
    main()
