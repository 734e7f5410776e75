"""The CPU sampler's packed linear layers: rl-tpu's weight-streaming AVX-512 kernel, or oneDNN's where it cannot run.

A decode step multiplies a few rows (the batch, one token each) by every weight of the model, so it reads ~540 MB
of float32 SmolLM2 weights for 16 rows. oneDNN's inner product on a packed weight
(``torch.ops.mkldnn._linear_pointwise``) barely overlaps that read with its multiply-adds: on one AMD EPYC core
its 211 products take 91-94% of (the weights' read alone) + (the same products with the weights in cache)
(``benchmarks/bench_eager_ops.py``). ``panel_kernel.cpp`` streams each weight panel from memory, prefetched a few
KiB ahead, while it multiplies the one before, with the batch's 16 rows held in registers
(``benchmarks/bench_decode_linears.py`` times both).

:func:`backend` decides once per process: the panel kernel where the CPU has AVX-512 (``torch.backends.cpu``'s
capability), a C++ compiler builds ``panel_kernel.cpp``, ``attention_kernel.cpp`` (the decode attention of
:mod:`rl_tpu.sampler.attention`) and ``token_kernel.cpp`` (the greedy token choice of
:mod:`rl_tpu.sampler.processing`) into one library against this torch (20-60 s, once per machine: the library is kept
in torch's extension build folder, written under a temporary name and renamed, so processes building at once never
read a half-written file), and a self-check on random inputs matches ``F.linear``, softmax attention in float64, and
argmax and log_softmax; otherwise oneDNN's packed linear, the batched attention products and ATen's argmax, as before,
said in one line. Both compute
float32 products summed in their own order: they differ from ``torch.nn.functional.linear`` by float32 rounding
(relative ~1e-6).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from rl_tpu.patches import torch_internals  # oneDNN's private packed-linear ops, version-checked

__all__ = ["backend", "linear", "pack"]

#: compiled into one library: the linear layers' kernel, the decode attention's (:mod:`rl_tpu.sampler.attention`) and
#: the greedy token choice's (:mod:`rl_tpu.sampler.processing`)
_SOURCES = tuple(Path(__file__).with_name(f"{name}_kernel.cpp") for name in ("panel", "attention", "token"))
_STATE: dict[str, str] = {}
_FAKES: set[str] = set()
_LOCK = threading.Lock()


def _library_path() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    code = b"".join(source.read_bytes() for source in _SOURCES)
    key = hashlib.sha256(code + f"{torch.__version__} {sys.version}".encode()).hexdigest()[:16]
    return Path(get_default_build_root()) / f"rl_tpu_panel_kernel_{key}.so"


def _build(target: Path) -> None:
    """Compile the kernels' sources into ``target``. Raises ``RuntimeError`` with the compiler's last lines."""
    from torch.utils.cpp_extension import (
        TORCH_LIB_PATH,
        get_cxx_compiler,
        include_paths,
    )

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    cmd = [
        get_cxx_compiler(),
        "-O3",
        "-std=gnu++20",
        "-shared",
        "-fPIC",
        "-mavx512f",
        "-mfma",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        *[f"-I{p}" for p in include_paths()],
        *map(str, _SOURCES),
        "-o",
        tmp,
        f"-L{TORCH_LIB_PATH}",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{TORCH_LIB_PATH}",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {' '.join(done.stderr.strip().splitlines()[-3:])[:400]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _self_check() -> str | None:
    """Why the loaded kernels disagree with ``F.linear`` or with softmax attention in float64 on random inputs, or
    ``None``."""
    g = torch.Generator().manual_seed(0)
    for rows, inner, out in ((16, 100, 37), (5, 64, 16), (35, 33, 70)):
        x, w, b = (torch.randn(*shape, generator=g) for shape in ((rows, inner), (out, inner), (out,)))
        got = torch.ops.rl_tpu_kernels.panel_linear(x, pack_panels(w), b, out)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        err = (got.double() - want).abs().max().item()
        if not err <= 1e-4:
            return f"self-check at {rows}x{inner}x{out}: max |error| {err:.3g} against F.linear"
    for heads, kv_heads, dim in ((6, 2, 64), (2, 2, 128)):
        q, k, v = (torch.randn(*shape, generator=g) for shape in ((3, heads, dim), *[(3, kv_heads, 11, dim)] * 2))
        keep = torch.arange(11) >= torch.tensor([[0], [4], [10]])  # (3, 11): left padding
        got = torch.ops.rl_tpu_kernels.decode_attention(q, k, v, keep, 0.3)
        k2, v2 = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # (3, heads, 11, dim)
        scores = (q.double()[:, :, None] * k2).sum(-1).mul(0.3).masked_fill(~keep[:, None], float("-inf"))
        err = (got.double() - (scores.softmax(-1)[..., None] * v2).sum(-2)).abs().max().item()
        if not err <= 1e-4:
            return f"self-check of the decode attention ({heads} heads, dim {dim}): max |error| {err:.3g}"
    logits = torch.randn(3, 1000, generator=g) * 4
    tokens, logprobs = torch.ops.rl_tpu_kernels.greedy_choice(logits)
    want = torch.log_softmax(logits.double(), -1)
    if (
        not torch.equal(tokens, logits.argmax(-1))
        or not (logprobs.double() - want.gather(-1, tokens[:, None])[:, 0]).abs().max().item() <= 1e-5
    ):
        return "self-check of the greedy token choice: tokens or log-probs differ from argmax and log_softmax"
    return None


def _register_fakes() -> None:
    """Shapes of the kernels' outputs for tracing (``torch.compile``): the attention kernel runs in compiled graphs."""

    def attention(q, k, v, mask, scale):
        return q.new_empty(q.shape)

    def panels(x, wp, bias, out_features):
        return x.new_empty((x.shape[0], out_features))

    def packed(x, weight, bias, cache):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    def greedy(logits):
        return logits.new_empty(logits.shape[:1], dtype=torch.long), logits.new_empty(logits.shape[:1])

    for name, fn in (
        ("decode_attention", attention),
        ("panel_linear", panels),
        ("packed_linear", packed),
        ("greedy_choice", greedy),
    ):
        if name not in _FAKES:  # once per process (the library itself loads once)
            torch.library.register_fake(f"rl_tpu_kernels::{name}", fn)
            _FAKES.add(name)


def _choose() -> tuple[str, str]:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "onednn", f"this CPU's capability is {torch.backends.cpu.get_cpu_capability()}, not AVX512"
    try:
        path = _library_path()
        if not path.exists():
            print(
                f"[rl-tpu] sampler: building rl-tpu's CPU kernels into {path} (once per machine, ~20-60 s)",
                file=sys.stderr,
                flush=True,
            )
            _build(path)
        torch.ops.load_library(str(path))
        _register_fakes()
        reason = _self_check()
    except (OSError, RuntimeError, ValueError, TypeError, AttributeError, subprocess.SubprocessError) as exc:
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return ("onednn", reason) if reason else ("panel", "")


def backend() -> str:
    """``"panel"`` (rl-tpu's AVX-512 kernel) or ``"onednn"``: which one :func:`pack` and :func:`linear` use in this
    process. Decided at the first call (building the kernel if this machine has no copy yet); when the panel kernel
    cannot run, the reason is printed once, in one line."""
    with _LOCK:  # two threads' first calls must not build or register twice
        return _decide()


def ready() -> bool:
    """Whether this process has loaded rl-tpu's kernels already (:func:`backend` decided ``"panel"``); decides
    nothing and builds nothing."""
    return _STATE.get("name") == "panel"


def _decide() -> str:
    if "name" not in _STATE:
        name, reason = _choose()
        _STATE["name"] = name
        if reason:
            print(
                f"[rl-tpu] sampler: rl-tpu's CPU kernels off ({reason}): packed linear layers on oneDNN, decode "
                "attention as batched products",
                file=sys.stderr,
                flush=True,
            )
    return _STATE["name"]


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``(out, in)`` float32 -> its panels ``(ceil(out / 16), in, 16)`` float32, zero past ``out``: the
    layout ``panel_kernel.cpp`` packs its compiled graphs' copies in (its ``pack_panels``; needs :func:`backend`
    ``"panel"``)."""
    return torch.ops.rl_tpu_kernels.pack_panels(weight.detach())


def pack(weight: torch.Tensor, batch_hint: int = 16) -> torch.Tensor:
    """A packed copy of ``weight`` ``(out, in)`` float32 CPU for :func:`linear`, in the layout of :func:`backend`
    (``batch_hint``: the rows oneDNN tunes its layout for; the panel layout has none). The copy is the weight's size
    (the panels pad ``out`` to a multiple of 16)."""
    with torch.inference_mode(False), torch.no_grad():
        if backend() == "panel":
            return pack_panels(weight)
        return torch_internals.reorder_linear_weight(weight.detach(), max(1, int(batch_hint)))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``packed = pack(weight)``: ``x`` ``(..., in)`` float32 -> ``(..., out)``
    float32; ``bias`` ``(out,)`` or ``None``."""
    if packed.dim() == 3:  # panels
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = torch.ops.rl_tpu_kernels.panel_linear(flat, packed, bias, out_features)
        return out.view(*x.shape[:-1], out_features)
    return torch_internals.linear_pointwise(x, packed, bias)
