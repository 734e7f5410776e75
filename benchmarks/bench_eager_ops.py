"""Ops dispatched per decode step, and decode speed, for the sampler's decode paths on CPU.

TorchTPU's default eager mode (``rl_tpu.tpu_eager_mode=strict``) dispatches every aten op to the chip as it comes,
so an eager decode step costs at least (ops per step) x (launch cost); a compiled step is one launch. This counts,
at the batch and buckets given (default: the default job's 4 prompts x 4 samples = 16 rows, prompt bucket 64,
generation bucket 32), the aten ops of one decode step (:func:`rl_tpu.sampler.opcount.decode_step_ops`: model
forward, token choice and bookkeeping) for

* ``tpu-eager``: the bucketed sampler with the CPU fast paths off (what the TPU profile runs; on CPU it keeps the
  sampler's grouped-query attention and its read of only the written cache slots, which a TPU run does not);
* ``cpu-eager``: today's CPU sampler (lean decode on oneDNN-packed weights);
* ``compiled``: ``Sampler(compile=True)`` (inductor on CPU; a step counts as one launch);

and times their decode steps: (time to generate ``hi`` tokens - time for ``lo``) / (``hi - lo``), prefill and set-up
cancelled, median of ``--repeats``. The memory bound is the model's weight bytes over this thread's measured read
bandwidth (a decode step reads every weight once).

    python benchmarks/bench_eager_ops.py [--tiny] [--threads 1] [--prompts 4] [--n 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def read_bandwidth_gbs(nbytes: int = 512 << 20) -> float:
    """Bytes per second one thread reads (``sum`` over a float32 buffer larger than the caches), in GB/s."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(3))
    return nbytes / best / 1e9


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def load_model(tiny: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if tiny:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg).eval(), "tiny Llama (2 layers, 64 wide)"
    from verl_backend.models import ensure_default_model

    path = ensure_default_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, "SmolLM2-135M-Instruct, float32"


def main() -> None:
    from rl_tpu.sampler import Sampler, SamplingParams
    from rl_tpu.sampler.opcount import GRAPH, decode_step_ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random Llama instead of SmolLM2 (seconds)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=50, help="tokens per prompt (bucket: the next power of two)")
    ap.add_argument("--steps", type=int, nargs=2, default=(17, 32), help="lo hi max_new_tokens (one gen bucket)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, label = load_model(args.tiny)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    lo, hi = args.steps
    rows = args.prompts * args.n
    common = {"pad_token_id": 0, "eos_token_ids": []}  # no EOS: every row runs every step, the batch keeps its size
    paths = {
        "tpu-eager": Sampler(model, **common, packed_weights=False, packed_prefill=False, lean_decode=False),
        "cpu-eager": Sampler(model, **common),
        "compiled": Sampler(model, **common, compile=True),
    }
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gbs = read_bandwidth_gbs()
    print(f"{label}; batch {rows} ({args.prompts} prompts x {args.n}); {args.threads} thread(s); "
          f"steps {lo}->{hi}; weights {weight_bytes / 1e6:.0f} MB, read {gbs:.1f} GB/s: memory bound "
          f"{weight_bytes / gbs / 1e9 * 1e3:.1f} ms/step = {rows * gbs * 1e9 / weight_bytes:.0f} tokens/s")
    table = []
    for name, sampler in paths.items():
        warm = time.perf_counter()
        sampler.generate(prompts, SamplingParams(n=args.n, temperature=0, max_new_tokens=hi))  # compiles here
        warm = time.perf_counter() - warm
        ops = decode_step_ops(sampler, prompts, (lo, hi), n=args.n, temperature=0)
        per_step = []
        for _ in range(args.repeats):
            t_lo, t_hi = (_timed(sampler.generate, prompts, SamplingParams(n=args.n, temperature=0, max_new_tokens=m))
                          for m in (lo, hi))
            per_step.append((t_hi - t_lo) / (hi - lo))
        step_s = statistics.median(per_step)
        compiled = sampler.compiled
        table.append((name, sum(ops.values()), ops, step_s, rows / step_s,
                      compiled.total_graphs if compiled else 0, sum(compiled.compile_s.values()) if compiled else 0.0,
                      warm, compiled.active if compiled else None))

    print(f"\n{'path':<10} {'ops/step':>8} {'ms/step':>8} {'s/token':>9} {'tokens/s':>8} {'graphs':>6} "
          f"{'compile s':>9}  top ops per step")
    for name, total, ops, step_s, tps, graphs, comp_s, _warm, active in table:
        top = ", ".join(f"{op} {c:g}" for op, c in ops.most_common(6))
        flag = "" if active in (None, True) else " (compile fell back to eager)"
        print(f"{name:<10} {total:>8g} {step_s * 1e3:>8.1f} {step_s / rows:>9.5f} {tps:>8.0f} {graphs:>6} "
              f"{comp_s:>9.1f}  {top}{flag}")
    print(f"\n(ops/step: aten ops one decode step dispatches; a compiled step's graph counts as one ({GRAPH!r}). "
          "s/token: seconds per generated token at this batch.)")


if __name__ == "__main__":
    main()
