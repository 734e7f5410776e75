"""The host-memory machinery's glibc and gc code (``verl_backend/host_memory/heap.py``): malloc settings, the trim
after each block's backward, the garbage collector's freeze."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_backend.host_memory.heap import BackwardHeapTrim, host_malloc_env


def test_host_malloc_env_keeps_what_the_user_set() -> None:
    assert host_malloc_env({}) == {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2"}
    assert host_malloc_env({"MALLOC_ARENA_MAX": "8"})["MALLOC_ARENA_MAX"] == "8"


_MMAP_PROBE = textwrap.dedent("""
    import ctypes, sys
    from verl_backend.host_memory.heap import tune_host_malloc

    class MallInfo2(ctypes.Structure):  # glibc >= 2.33
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "tuned":
        assert tune_host_malloc()
    before = libc.mallinfo2().hblks
    libc.free(libc.malloc(8 << 20))  # freeing a mapped 8 MiB block raises glibc's dynamic threshold to 8 MiB
    block = libc.malloc(2 << 20)
    print(libc.mallinfo2().hblks - before)  # blocks that have their own mmap
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_tuned_host_malloc_maps_every_large_block_on_its_own() -> None:
    """Untuned, glibc serves a 2 MiB tensor from the heap once an 8 MiB one was freed (its threshold moved up);
    tuned, the threshold stays at 128 KiB, so the block is mapped alone and goes back to the OS when freed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    mapped = {}
    for mode in ("default", "tuned"):
        proc = subprocess.run(
            [sys.executable, "-c", _MMAP_PROBE, mode], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        mapped[mode] = int(proc.stdout.split()[-1])
    assert mapped == {"default": 0, "tuned": 1}


def _tiny_llama(seed: int):
    from families import tiny_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def test_backward_heap_trim_runs_once_per_block_backward_and_leaves_gradients_alone() -> None:
    hooked, plain = _tiny_llama(0), _tiny_llama(0)
    trim = BackwardHeapTrim(hooked)
    assert trim.blocks == 3  # the decoder layers (LlamaForCausalLM._no_split_modules), nothing else
    x = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hooked(input_ids=x)  # a log-prob forward: nothing to trim after
    assert trim.trims == 0
    for m in (hooked, plain):
        m(input_ids=x, labels=x).loss.backward()
    assert trim.trims == 3
    for (name, a), b in zip(hooked.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name
    trim.remove()
    hooked(input_ids=x, labels=x).loss.backward()
    assert trim.trims == 3


def test_backward_heap_trim_hooks_nothing_in_a_model_without_blocks() -> None:
    trim = BackwardHeapTrim(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    assert trim.blocks == 0


def test_freeze_long_lived_objects_leaves_only_new_objects_to_collect():
    import gc

    from verl_backend.host_memory.heap import freeze_long_lived_objects

    enabled = gc.isenabled()
    try:
        frozen = freeze_long_lived_objects()
        # torch and transformers' objects, at least; not compared for equality with a second count: another
        # thread may free a frozen object in between (the full suite saw 1192079 then 1192077)
        assert frozen > 1000 and gc.get_freeze_count() > 1000
        # no automatic collection in between: a thread left by an earlier test (inductor's compile workers) that
        # allocates could otherwise collect the cycle first, and this collect would find nothing
        gc.disable()
        cycle = []
        cycle.append(cycle)  # garbage created after the freeze is still collected
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
