"""The TPU profile's figures on CPU: ops per decode step and per training micro batch, graphs and compile seconds
of the compiled sampler and trainer, and decode speed of the sampler's paths against both limits of this thread.

TorchTPU's default eager mode (``rl_tpu.tpu_eager_mode=strict``) dispatches every aten op to the chip as it comes,
so an eager decode step costs at least (ops per step) x (launch cost); a compiled step is one launch. This counts,
at the batch and buckets given (default: the default job's 4 prompts x 4 samples = 16 rows, prompt bucket 64,
generation bucket 32), the aten ops of one decode step (:func:`rl_tpu.sampler.opcount.decode_step_ops`: model
forward, token choice and bookkeeping) for

* ``tpu-eager``: the bucketed sampler with the CPU fast paths off (what the TPU profile runs; on CPU it keeps the
  sampler's grouped-query attention and its read of only the written cache slots, which a TPU run does not);
* ``tpu-compiled``: ``Sampler(compile=True, packed_weights=False)``: the TPU profile's graphs, on plain weights
  (inductor on CPU; a step counts as one launch);
* ``cpu-eager``: today's CPU sampler (lean decode on packed weights: rl-tpu's panel kernel, or oneDNN where it
  cannot run, :mod:`rl_tpu.sampler.panel_kernel`; rl-tpu's decode attention and greedy token kernels);
* ``cpu-compiled``: ``Sampler(compile=True)`` on the CPU: the graphs' linear layers on packed copies kept outside
  the graph (:mod:`rl_tpu.sampler.compiled_packed`, a C++ op), their decode attention rl-tpu's kernel (an opaque
  op), the greedy choice rl-tpu's token kernel;

and times their decode steps: (time to generate ``hi`` tokens - time for ``lo``) / (``hi - lo``), prefill and set-up
cancelled, median of ``--repeats``. Both limits are measured in the same run: memory (a decode step reads every
weight once: weight bytes / this thread's read bandwidth) and arithmetic (a decode step's FLOPs: 2 per weight per
row, plus attention over the whole cache, / this thread's best measured float32 matmul GFLOP/s at 256 rows: MKL's,
oneDNN's or rl-tpu's panel kernel's);
``% limit`` is of the lower of the two. The linear layers alone (on the sampler's packed copies, at the step's rows)
are timed too: what a step cannot go below on this thread with these kernels.

The trainer (``rl_tpu.compile_trainer``'s :class:`rl_tpu.compiled_blocks.CompiledBlocks`, inductor) runs one
training step's shapes on a padded micro batch at its bucket length: a no-grad log-prob forward
(``--logprob-rows``) and an update micro batch (``--train-rows``), forward and backward; graphs are inductor's
(a forward, an inference forward, a backward), compile seconds are first call minus second. Ops per training micro
batch (update: forward + loss + backward) are counted by :func:`rl_tpu.train_opcount.micro_batch_ops`, eager and
with compiled blocks (each block's forward and backward graph one launch).

Inductor's caches are off unless ``--use-compile-cache``: a cached graph would read as a 0-second compile.

    python benchmarks/bench_eager_ops.py [--tiny] [--threads 1] [--prompts 4] [--n 4] [--repeats 3] [--train-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rl_tpu.patches import torch_internals
from rl_tpu.patches.transformers_internals import set_attn_implementation
from rl_tpu.sampler import panel_kernel


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
        cfg = LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.2,
        )
        set_attn_implementation(cfg, "sdpa")
        return LlamaForCausalLM(cfg).eval(), "tiny Llama (2 layers, 64 wide)"
    from verl_backend.models import ensure_default_model

    path = ensure_default_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, "SmolLM2-135M-Instruct, float32"


def matmul_gflops(rows: int = 256, inner: int = 576, cols: int = 1536) -> dict[str, float]:
    """Float32 matmul GFLOP/s of this thread at ``(rows, inner) @ (inner, cols)``, best of 5, by library: ``mkl``
    (``torch.mm``) and ``onednn`` (on a weight packed for oneDNN, where torch has it). The arithmetic limit takes
    the faster: a limit the sampler's own products can beat is no limit (on AMD EPYC, MKL's sgemm reaches less than
    half of oneDNN's)."""
    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    a @ b
    flop = 2 * rows * inner * cols
    rates = {"mkl": flop / min(_timed(torch.mm, a, b) for _ in range(5)) / 1e9}
    from rl_tpu.sampler.packed import packed_linear_supported

    if packed_linear_supported():
        packed = torch_internals.reorder_linear_weight(b.T.contiguous(), rows)
        rates["onednn"] = flop / min(_timed(torch_internals.linear_pointwise, a, packed, None) for _ in range(6)) / 1e9
    if panel_kernel.backend() == "panel":
        panels = panel_kernel.pack(b.T.contiguous())
        rates["panel"] = flop / min(_timed(panel_kernel.linear, a, panels, None, cols) for _ in range(6)) / 1e9
    return rates


def linears_alone_s(model, rows: int) -> float:
    """Seconds one decode step's linear layers take alone at ``rows`` rows, each on the sampler's packed copy of its
    weight (:mod:`rl_tpu.sampler.panel_kernel`: rl-tpu's panel kernel, or oneDNN's where it cannot run), best of 5."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [panel_kernel.pack(m.weight, rows) for m in linears]
    inputs = [torch.randn(rows, m.in_features) for m in linears]

    def step():
        for x, w, m in zip(inputs, packed, linears):
            panel_kernel.linear(x, w, None, m.out_features)

    step()
    return min(_timed(step) for _ in range(5))


def linears_in_cache_s(model, rows: int, cols: int = 1536) -> float:
    """Seconds the same linear layers take with their weights already in cache: each layer's product timed on a
    packed slice of at most ``cols`` output columns (3.5 MB at SmolLM2's width) called again and again, scaled to the
    layer's columns; the arithmetic alone at ``rows`` rows, no weight read from memory."""
    total, timed = 0.0, {}
    for m in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        width = min(m.out_features, cols)
        if (m.in_features, width) not in timed:
            packed = panel_kernel.pack(m.weight.detach()[:width].contiguous(), rows)
            x = torch.randn(rows, m.in_features)

            def ten(x=x, packed=packed, width=width):
                for _ in range(10):
                    panel_kernel.linear(x, packed, None, width)

            ten()
            timed[(m.in_features, width)] = min(_timed(ten) for _ in range(5)) / 10
        total += timed[(m.in_features, width)] * m.out_features / width
    return total


def decode_flops(model, rows: int, cache_len: int) -> float:
    """FLOPs of one decode step: 2 per weight (the tied LM head counted once, as a matmul) per row, plus
    4 x layers x heads x head_dim x ``cache_len`` per row for attention over the whole static cache."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    weights = sum(p.numel() for p in model.parameters())
    return rows * (2 * weights + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * cache_len)


def padded_micro_batch(vocab: int, rows: int, length: int, seed: int = 0):
    """VeRL's padded layout at one bucket length: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, : row * 3] = 0
        mask[row, length - 5 * row :] = 0
    return ids * mask, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def loss_step(batch):
    ids, mask, pos = batch

    def step(model):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()

    return step


def trainer_figures(model, args) -> dict:
    """Compiled trainer (inductor) over one step's shapes, and ops per training micro batch eager and compiled."""
    import copy

    from rl_tpu.compiled_blocks import CompiledBlocks
    from rl_tpu.patches.torch_internals import inductor_compilers
    from rl_tpu.train_opcount import micro_batch_ops, split

    vocab = model.config.vocab_size
    update = loss_step(padded_micro_batch(vocab, args.train_rows, args.train_len))
    lp_ids, lp_mask, lp_pos = padded_micro_batch(vocab, args.logprob_rows, args.train_len, seed=1)
    graphs = {"forward": 0, "inference": 0, "backward": 0}
    compile_fx, compile_fx_inner = inductor_compilers()

    def inner(gm, example_inputs, **kw):
        kind = "backward" if kw.get("is_backward") else ("inference" if kw.get("is_inference") else "forward")
        graphs[kind] += 1
        return compile_fx_inner(gm, example_inputs, **kw)

    def one_step(m):
        with torch.no_grad():
            m(input_ids=lp_ids, attention_mask=lp_mask, position_ids=lp_pos, use_cache=False)
        update(m).backward()

    trained = copy.deepcopy(model).train()
    blocks = CompiledBlocks(trained, lambda gm, ex: compile_fx(gm, ex, inner_compile=inner), say=lambda line: None)
    first = _timed(one_step, trained)
    second = _timed(one_step, trained)
    eager_ops = micro_batch_ops(copy.deepcopy(model).train(), update)
    compiled_ops = micro_batch_ops(copy.deepcopy(model).train(), update, compiled=True)
    return {
        "graphs": graphs,
        "signatures": blocks.graphs,
        "compile_s": first - second,
        "step_s": second,
        "fell_back": blocks.eager_reason,
        "eager_ops": sum(eager_ops.values()),
        "compiled_ops": split(compiled_ops),
        "blocks": blocks.blocks,
    }


def main() -> None:
    from rl_tpu.sampler import Sampler, SamplingParams
    from rl_tpu.sampler.opcount import decode_step_ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random Llama instead of SmolLM2 (seconds)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=50, help="tokens per prompt (bucket: the next power of two)")
    ap.add_argument("--steps", type=int, nargs=2, default=(17, 32), help="lo hi max_new_tokens (one gen bucket)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-rows", type=int, default=4, help="update micro batch rows (default job: 4)")
    ap.add_argument("--logprob-rows", type=int, default=8, help="log-prob micro batch rows (default job: 8)")
    ap.add_argument(
        "--train-len",
        type=int,
        default=256,
        help="padded micro batch bucket length (default job: 128 + 64 tokens -> 256)",
    )
    ap.add_argument(
        "--use-compile-cache",
        action="store_true",
        help="let inductor reuse graphs compiled by earlier runs (compile seconds and graph counts then "
        "read 0 or less than a fresh compile)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.use_compile_cache:  # a cache hit skips the compile being measured (and the graph counter's hook)
        from rl_tpu.patches.torch_internals import disable_inductor_caches

        disable_inductor_caches()

    model, label = load_model(args.tiny)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    lo, hi = args.steps
    rows = args.prompts * args.n
    common = {"pad_token_id": 0, "eos_token_ids": []}  # no EOS: every row runs every step, the batch keeps its size
    paths = {
        "tpu-eager": Sampler(model, **common, packed_weights=False, packed_prefill=False, lean_decode=False),
        "tpu-compiled": Sampler(model, **common, compile=True, packed_weights=False),
        "cpu-eager": Sampler(model, **common),
        "cpu-compiled": Sampler(model, **common, compile=True),
    }
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gbs, rates = read_bandwidth_gbs(), matmul_gflops()
    gflops = max(rates.values())
    cache_len = 1 << (args.prompt_len - 1).bit_length()
    cache_len += 1 << (hi - 1).bit_length()
    flops = decode_flops(model, rows, cache_len)
    mem_s, math_s = weight_bytes / gbs / 1e9, flops / gflops / 1e9
    limit_tps = rows / max(mem_s, math_s)
    print(
        f"{label}; batch {rows} ({args.prompts} prompts x {args.n}); {args.threads} thread(s); steps {lo}->{hi}\n"
        f"memory limit: {weight_bytes / 1e6:.0f} MB of weights / {gbs:.1f} GB/s read = {mem_s * 1e3:.1f} ms/step = "
        f"{rows / mem_s:.0f} tokens/s\narithmetic limit: {flops / 1e9:.2f} GFLOP/step (cache {cache_len}) / "
        f"{gflops:.1f} GFLOP/s matmul = {math_s * 1e3:.1f} ms/step = {rows / math_s:.0f} tokens/s "
        f"(matmul GFLOP/s: {', '.join(f'{k} {v:.1f}' for k, v in rates.items())})"
    )
    packed = "onednn" in rates or "panel" in rates
    floor_s = linears_alone_s(model, rows) if packed else float("nan")
    print(
        f"the linear layers alone at {rows} rows, packed: {floor_s * 1e3:.1f} ms/step = {rows / floor_s:.0f} "
        f"tokens/s = {100 * max(mem_s, math_s) / floor_s:.0f}% of the lower limit"
    )
    if packed:
        hot_s = linears_in_cache_s(model, rows)
        print(
            f"  the same with their weights in cache (products alone at {rows} rows): {hot_s * 1e3:.1f} ms; + the "
            f"weights' read alone ({mem_s * 1e3:.1f} ms) = {(hot_s + mem_s) * 1e3:.1f} ms: the linears take "
            f"{100 * floor_s / (hot_s + mem_s):.0f}% of that sum (100%: reads and products do not overlap)"
        )
    table = []
    for name, sampler in paths.items():
        warm = time.perf_counter()
        sampler.generate(prompts, SamplingParams(n=args.n, temperature=0, max_new_tokens=hi))  # compiles here
        warm = time.perf_counter() - warm
        ops = decode_step_ops(sampler, prompts, (lo, hi), n=args.n, temperature=0)
        per_step = []
        for _ in range(args.repeats):
            t_lo, t_hi = (
                _timed(sampler.generate, prompts, SamplingParams(n=args.n, temperature=0, max_new_tokens=m))
                for m in (lo, hi)
            )
            per_step.append((t_hi - t_lo) / (hi - lo))
        step_s = statistics.median(per_step)
        compiled = sampler.compiled
        table.append(
            (
                name,
                sum(ops.values()),
                step_s,
                compiled.graphs if compiled else None,
                sum(compiled.compile_s.values()) if compiled else None,
                compiled.active if compiled else None,
            )
        )
    train = trainer_figures(model, args)

    print(
        f"\n{'decode path':<13} {'ops/step':>8} {'ms/step':>8} {'tokens/s':>8} {'% limit':>7} "
        f"{'graphs/rollout':>14} {'compile s':>9}"
    )
    for name, total, step_s, graphs, comp_s, active in table:
        graph_text = f"{graphs['prefill']} prefill + {graphs['decode']} decode" if graphs else "-"
        flag = "" if active in (None, True) else "  (compile fell back to eager)"
        print(
            f"{name:<13} {total:>8g} {step_s * 1e3:>8.1f} {rows / step_s:>8.0f} "
            f"{100 * rows / step_s / limit_tps:>6.0f}% {graph_text:>14} "
            f"{comp_s if comp_s is not None else float('nan'):>9.1f}{flag}"
        )
    ops, launches = train["compiled_ops"]
    g = train["graphs"]
    print(
        f"\ntraining step ({train['blocks']} blocks compiled, inductor; log-prob forward {args.logprob_rows} x "
        f"{args.train_len} + update {args.train_rows} x {args.train_len}): "
        f"{g['forward'] + g['inference'] + g['backward']} graphs ({g['forward']} forward, {g['inference']} inference, "
        f"{g['backward']} backward) for {train['signatures']} block input shapes, compile {train['compile_s']:.1f} s, "
        f"then {train['step_s']:.1f} s/step{'; FELL BACK: ' + train['fell_back'] if train['fell_back'] else ''}"
    )
    print(
        f"ops per training micro batch ({args.train_rows} x {args.train_len}, forward + loss + backward): "
        f"eager {train['eager_ops']}, compiled {ops + launches} ({ops} outside the blocks + {launches} launches)"
    )
    print(
        "\n(ops/step: aten ops one decode step dispatches, a compiled step counts as one launch; % limit: of the "
        "lower of the memory and arithmetic limits; graphs/rollout: graphs compiled over the warm-up rollout; "
        "compiled steps run the bucketed path, cpu-compiled's linear layers on packed weights)"
    )


if __name__ == "__main__":
    main()
