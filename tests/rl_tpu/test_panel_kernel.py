"""rl-tpu's panel kernel (:mod:`rl_tpu.sampler.panel_kernel`): the packed linear layers of the CPU sampler equal
``F.linear`` at every row count, width and bias the sampler meets; a kernel that cannot be built falls back to
oneDNN, said in one line; the built library is reused, not rebuilt."""

from __future__ import annotations

import shutil

import pytest
import torch
from address_reuse import tensors_at_one_address
from torch.utils.cpp_extension import get_cxx_compiler

from rl_tpu.sampler import panel_kernel

pytestmark = [
    pytest.mark.skipif(
        torch.backends.cpu.get_cpu_capability() != "AVX512",
        reason="the panel kernel needs an AVX-512 CPU (oneDNN runs elsewhere)",
    ),
    pytest.mark.skipif(
        shutil.which(get_cxx_compiler()) is None,
        reason="no C++ compiler to build the panel kernel (the sampler then runs oneDNN's)",
    ),
]


@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 33, 64])
@pytest.mark.parametrize(("inner", "out"), [(64, 97), (576, 192), (33, 16), (7, 5)])
def test_panels_equal_linear(rows, inner, out) -> None:
    assert panel_kernel.backend() == "panel", "an AVX-512 machine with a compiler builds the panel kernel"
    g = torch.Generator().manual_seed(rows * 1000 + inner + out)
    x = torch.randn(2, rows, inner, generator=g)  # (batch, tokens, in), as a layer sees it
    weight, bias = torch.randn(out, inner, generator=g) * 0.1, torch.randn(out, generator=g)
    packed = panel_kernel.pack(weight)
    assert packed.shape == (-(-out // 16), inner, 16)
    for b in (None, bias):
        got = panel_kernel.linear(x, packed, b, out)
        want = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.shape == (2, rows, out) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        # the sum of float32 products, not a shortcut: as close to float64 as F.linear itself is
        plain = (torch.nn.functional.linear(x, weight, b).double() - want).abs().max().item()
        assert (got.double() - want).abs().max().item() <= 20 * plain + 1e-6


def test_a_non_contiguous_input_and_wrong_panels_are_refused_or_handled() -> None:
    weight = torch.randn(40, 24)
    packed = panel_kernel.pack(weight)
    x = torch.randn(24, 5).t()  # (5, 24), not contiguous: linear() copies it
    torch.testing.assert_close(panel_kernel.linear(x, packed, None, 40), x @ weight.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="wp must be the contiguous"):
        torch.ops.rl_tpu_kernels.panel_linear(torch.randn(5, 24), packed, None, 60)  # 60 columns, 48 packed
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.rl_tpu_kernels.panel_linear(torch.randn(5, 24), packed, torch.randn(39), 40)


def test_the_compiled_graphs_packed_linear_op_follows_its_weights() -> None:
    """``rl_tpu_kernels::packed_linear`` (the compiled sampler's graphs' linear layers, :mod:`rl_tpu.sampler.
    compiled_packed`): ``F.linear``'s numbers on a packed copy kept per cache; a weight written in place, or freed
    and another allocated at its address with the same shape and version, is packed again; not float32 is
    ``F.linear`` itself; ``release`` (and a cache's end) frees the copies."""
    import gc

    from rl_tpu.sampler.compiled_packed import PackCache

    assert panel_kernel.backend() == "panel"
    op = torch.ops.rl_tpu_kernels.packed_linear
    cache = PackCache()
    x, w, b = torch.randn(5, 3, 8), torch.randn(6, 8), torch.randn(6)
    got = op(x, w, b, cache.id)
    assert got.shape == (5, 3, 6)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert cache.nbytes == 16 * 8 * 4  # one panel: 6 rows padded to 16
    with torch.no_grad():
        w.mul_(2)  # in place: the version counter moves
    torch.testing.assert_close(
        op(x.transpose(0, 1), w, None, cache.id), x.transpose(0, 1) @ w.T, rtol=1e-5, atol=1e-5
    )  # a non-contiguous input too
    assert cache.nbytes == 16 * 8 * 4  # the stale copy was replaced, not kept beside the new one
    assert torch.equal(
        op(x.bfloat16(), w.bfloat16(), None, cache.id), torch.nn.functional.linear(x.bfloat16(), w.bfloat16())
    )  # not float32: plain
    # a weight freed and another made at its address, with the same shape and version counter (0): the old copy
    # must not be used
    x2, addresses = torch.randn(4, 64), set()
    for weight in tensors_at_one_address(32, 64, count=4):
        addresses.add(weight.data_ptr())
        torch.testing.assert_close(op(x2, weight, None, cache.id), x2 @ weight.T, rtol=1e-5, atol=1e-5)
        del weight
    assert len(addresses) == 1
    kept = [torch.randn(32, 64) for _ in range(2)]  # live weights at their own addresses: a copy each
    for weight in kept:
        op(x2, weight, None, cache.id)
    assert cache.nbytes >= 16 * 8 * 4 + 2 * 32 * 64 * 4
    del kept, weight
    op(x2, torch.randn(48, 64), None, cache.id)  # the next packing drops the copies of every freed weight
    assert cache.nbytes == 16 * 8 * 4 + 48 * 64 * 4  # w's and the new weight's: the freed ones' went
    other = PackCache()
    op(x, w, None, other.id)
    cache.release()
    assert cache.nbytes == 0 and other.nbytes == 16 * 8 * 4  # each cache its own copies
    other_id = other.id
    del other
    gc.collect()
    assert torch.ops.rl_tpu_kernels.cache_bytes(other_id) == 0  # freed with its cache


def test_the_library_is_kept_and_a_failed_build_falls_back_in_one_line(tmp_path, monkeypatch, capfd) -> None:
    assert panel_kernel.backend() == "panel"
    assert panel_kernel._library_path().exists(), "the built library is kept for the next process"
    broken = tmp_path / "panel_kernel.cpp"
    broken.write_text(panel_kernel._SOURCES[0].read_text() + "\nthis is not C++;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    monkeypatch.setattr(panel_kernel, "_SOURCES", (broken, *panel_kernel._SOURCES[1:]))
    monkeypatch.setattr(panel_kernel, "_STATE", {})
    assert panel_kernel.backend() == "onednn"
    lines = [line for line in capfd.readouterr().err.splitlines() if "CPU kernels off" in line]
    assert len(lines) == 1 and "rl-tpu's CPU kernels off (RuntimeError:" in lines[0], lines
    assert not list((tmp_path / "build").glob("*.so*")), "no half-written library is left behind"
    weight = torch.randn(20, 8)
    packed = panel_kernel.pack(weight)  # oneDNN's layout now, same numbers
    assert packed.dim() == 2
    x = torch.randn(3, 8)
    torch.testing.assert_close(panel_kernel.linear(x, packed, None, 20), x @ weight.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 256), (6, 1, 64)])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_decode_attention_kernel_equals_the_batched_products(heads, kv_heads, dim, mask_kind) -> None:
    """The kernel against :func:`decode_attention`'s own products (float64), on a sliced static cache (the lean
    decode reads the written slots: strided keys and values), with left padding in the mask."""
    from rl_tpu.sampler.attention import decode_attention

    assert panel_kernel.backend() == "panel"
    g = torch.Generator().manual_seed(heads * dim)
    batch, slots, kv_len = 5, 40, 37
    query = torch.randn(batch, heads, 1, dim, generator=g)
    cache_k, cache_v = (torch.randn(batch, kv_heads, slots, dim, generator=g) for _ in range(2))
    key, value = cache_k[:, :, :kv_len], cache_v[:, :, :kv_len]
    keep = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
    for row in range(batch):
        keep[row, ..., : 3 * row] = False  # left padding
    mask = {
        "bool": keep,
        "float": torch.where(keep, 0.0, -1e4) - 0.1 * torch.rand(batch, 1, 1, kv_len, generator=g),
        "none": None,
    }[mask_kind]
    want = decode_attention(
        query.double(),
        key.double(),
        value.double(),
        None if mask is None else (mask if mask.dtype == torch.bool else mask.double()),
        0.17,
    )
    got = decode_attention(query, key, value, mask, 0.17, kernel=True)
    plain = decode_attention(query, key, value, mask, 0.17)
    assert got.shape == want.shape == (batch, 1, heads, dim) and got.dtype == torch.float32
    assert not torch.equal(got, plain), "the kernel ran (its float32 rounding differs from the products')"
    err, plain_err = ((x.double() - want).abs().max().item() for x in (got, plain))
    assert err <= 1e-5 and err <= 10 * plain_err + 1e-7, (err, plain_err)


def test_decode_attention_kernel_falls_back_where_it_does_not_apply() -> None:
    from rl_tpu.sampler.attention import decode_attention

    assert panel_kernel.backend() == "panel"  # built and self-checked (this test may run first)
    query, key = torch.randn(2, 4, 1, 48), torch.randn(2, 2, 7, 48)  # head dim 48: the products
    assert torch.equal(
        decode_attention(query, key, key, None, None, kernel=True), decode_attention(query, key, key, None, None)
    )
    query, key = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 7, 64)
    half = (query.bfloat16(), key.bfloat16())  # bfloat16: the products
    assert torch.equal(
        decode_attention(*half, half[1], None, None, kernel=True), decode_attention(*half, half[1], None, None)
    )
    nothing = torch.zeros(2, 1, 1, 7, dtype=torch.bool)  # every key masked: NaN, as torch's softmax gives
    assert decode_attention(query, key, key, nothing, None, kernel=True).isnan().all()
    assert decode_attention(query, key, key, nothing, None).isnan().all()


def test_threads_split_the_work_without_changing_a_bit() -> None:
    """Panels (linear) and key/value heads (attention) are split among ATen's threads; each output is summed by one
    thread in the same order, so the numbers are the same at any thread count."""
    from rl_tpu.sampler.attention import decode_attention

    g = torch.Generator().manual_seed(5)
    x, weight, bias = torch.randn(16, 576, generator=g), torch.randn(1000, 576, generator=g), torch.randn(1000)
    packed = panel_kernel.pack(weight)
    query, key, value = torch.randn(16, 9, 1, 64), torch.randn(16, 3, 96, 64), torch.randn(16, 3, 96, 64)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                (
                    panel_kernel.linear(x, packed, bias, 1000),
                    decode_attention(query, key, value, None, None, kernel=True),
                )
            )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[1][0], torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vocab", [1, 15, 16, 97, 49152])
def test_greedy_token_kernel_equals_argmax_and_log_softmax(vocab) -> None:
    """``rl_tpu_kernels::greedy_choice`` (the CPU sampler's greedy choice, :func:`rl_tpu.sampler.processing.
    choose_tokens`): ``argmax``'s token (the first of tied largest logits), ``log_softmax``'s log-prob at it; a NaN
    row gives the first NaN's index and NaN, a row of -inf index 0 and NaN, as torch does."""
    from rl_tpu.sampler.processing import choose_tokens

    assert panel_kernel.backend() == "panel"
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(7, vocab + 5, generator=g) * 5
    logits = wide[:, 2 : vocab + 2]  # rows not contiguous with each other: the row stride is read
    if vocab > 3:
        logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first wins
        logits[2, vocab - 1] = float("nan")
        logits[2, vocab // 2] = float("nan")
    logits[3] = float("-inf")
    logits[4, 0] = float("inf")
    logits[5, vocab - 1] = logits[5].max() + 1  # the largest in the last, partial block
    tokens, logprobs = torch.ops.rl_tpu_kernels.greedy_choice(logits)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and tokens.shape == logprobs.shape == (7,)
    assert torch.equal(tokens, logits.argmax(-1))
    want = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.equal(logprobs.isnan(), want.isnan())
    torch.testing.assert_close(logprobs.double(), want, rtol=0, atol=1e-5, equal_nan=True)
    fast = choose_tokens(logits.contiguous(), temperature=0, top_k=-1, top_p=1.0, generator=None, kernel=True)
    plain = choose_tokens(logits.contiguous(), temperature=0, top_k=-1, top_p=1.0, generator=None)
    assert torch.equal(fast[0], plain[0])
    torch.testing.assert_close(fast[1], plain[1], rtol=0, atol=1e-5, equal_nan=True)
    with pytest.raises(RuntimeError, match="greedy_choice: logits must be"):
        torch.ops.rl_tpu_kernels.greedy_choice(logits.t())
    transposed = choose_tokens(
        logits.t().contiguous().t(), temperature=0, top_k=-1, top_p=1.0, generator=None, kernel=True
    )  # columns not contiguous: ATen's path, not a refusal
    assert torch.equal(transposed[0], plain[0])


def test_greedy_tokens_are_the_logits_argmax_on_every_path() -> None:
    """Two logits one float32 step apart: ``log_softmax``'s rounding merges them, so an argmax over its result would
    take the first; the greedy token is the larger logit's on the kernel's path and on ATen's."""
    from rl_tpu.sampler.processing import choose_tokens

    assert panel_kernel.backend() == "panel"
    logits = torch.ones(2, 49152)
    logits[:, 20] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    for kernel in (True, False):
        for logprobs in (True, False):
            tokens, _ = choose_tokens(
                logits, temperature=0, top_k=-1, top_p=1.0, generator=None, kernel=kernel, logprobs=logprobs
            )
            assert tokens.tolist() == [20, 20], (kernel, logprobs)


def test_the_greedy_kernel_reads_nothing_past_a_row_that_ends_at_an_unmapped_page() -> None:
    """A row of 17 logits ending exactly where an inaccessible page starts, its largest logit in the last, partial
    block of 16: every load of the row's tail is masked (an unmasked one faults). In a child process: a fault
    would end it, not the test run."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import ctypes, mmap, torch
        from rl_tpu.sampler import panel_kernel
        assert panel_kernel.backend() == "panel"
        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = mmap.PAGESIZE
        base = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
        row = (ctypes.c_float * 17).from_address(base + page - 4 * 17)
        logits = torch.frombuffer(row, dtype=torch.float32).view(1, 17)
        logits.copy_(torch.arange(17, dtype=torch.float32)[None])
        tokens, logprobs = torch.ops.rl_tpu_kernels.greedy_choice(logits)
        print("token", tokens.item(), round(logprobs.item(), 4))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    want = torch.log_softmax(torch.arange(17, dtype=torch.float64), -1)[16].item()
    assert done.returncode == 0, (done.returncode, done.stderr[-1000:])
    assert f"token 16 {round(want, 4)}" in done.stdout, done.stdout
