"""The object-store sync's sending loop, measured: a LoRA model's merged weights (made one tensor at a time by
:func:`verl_backend.weight_sync.lora.merged_lora_weights`, a new tensor per adapted matrix, several larger than a
bucket) through 1 MiB buckets into a rollout sampler. Streamed, the bytes the allocator has handed out beyond those
before the sync stay, at every bucket sent, within the staging buffer and two of the largest tensor;
materialising the export first (what the loop did before) holds every merged copy at once. Each measurement runs in a
fresh process, after one warm-up pass over the export (the first pass makes what no later sync makes again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import asyncio, ctypes, json, sys
import torch
torch.set_num_threads(1)  # one thread, one malloc arena: the peak is the sync's, not the thread pool's
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from rl_tpu.collectives import unpack_bucket
from rl_tpu.sampler import Sampler
from verl_backend.weight_sync.lora import merged_lora_weights
from verl_backend.weight_sync.object_store import send_buckets

def llama(seed):  # 4 layers of 512 x 1536 MLPs: 3 MiB matrices, ~50 MiB of adapted weights
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()

class Mallinfo2(ctypes.Structure):  # glibc >= 2.33: the allocator's own count of the bytes it has handed out
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2

def live():  # bytes in use: heap chunks handed out + mmapped chunks (torch's CPU tensors are malloc'd)
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

trainer = get_peft_model(llama(0), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
with torch.no_grad():
    for name, p in trainer.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.05)
rollout = Sampler(llama(1), pad_token_id=0, eos_token_ids=[])

peak = [0]

def send(flat, meta, last, total):  # the server's side, here: copied into the model at once, as ray.put copies
    peak[0] = max(peak[0], live())  # every bucket, the export's tensors and the bucket alive
    rollout.load_state_dict(unpack_bucket(flat, meta))
    peak[0] = max(peak[0], live())
    done = asyncio.get_running_loop().create_future()
    done.set_result(flat.nbytes)
    return done

export = (lambda: merged_lora_weights(trainer)) if sys.argv[1] == "streamed" else \
    (lambda: iter(list(merged_lora_weights(trainer))))  # the control: materialised first
for _ in merged_lora_weights(trainer):  # warm-up: the first pass faults in pages no later sync pays for again
    pass
base = live()
loaded, n = asyncio.run(send_buckets(export(), 1 << 20, send))
extra = peak[0] - base
merged = dict(merged_lora_weights(trainer))  # sized after the measurement
same = all(torch.equal(v, merged[k]) for k, v in rollout.model.state_dict().items())
adapted = sum(m.base_layer.weight.nbytes for m in trainer.modules() if hasattr(m, "lora_A"))
print(json.dumps({"extra": extra, "largest": max(t.nbytes for t in merged.values()), "adapted": adapted,
                  "buckets": n, "same": same}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and clear_refs")
def test_streamed_buckets_hold_a_few_buckets_not_the_export():
    def measure(mode: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=600, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    streamed = measure("streamed")
    materialised = measure("materialised")
    mib = 1 << 20
    assert streamed["same"] and materialised["same"]  # the rollout holds the merged weights after the sync
    assert streamed["largest"] > mib and streamed["adapted"] > 40 * mib  # tensors larger than a bucket
    # the 2 MiB staging buffer, the bucket's tensors (here the largest, sent as its own bytes), the next tensor (read
    # to find the bucket full) and 1 MiB for the rest (the event loop, the unpacked views). Counted as the allocator's
    # bytes in use (measured 8.04 MiB), not the resident size: a resident peak also holds what glibc keeps of freed
    # chunks (its mmap threshold rises to the largest chunk freed), by which the earlier bound on VmHWM failed at
    # unchanged commits (9.3 MiB against 9.0 on 2026-12-05)
    assert streamed["extra"] <= 2 * mib + 2 * streamed["largest"] + 1 * mib, streamed
    assert materialised["extra"] >= 0.5 * streamed["adapted"], materialised  # most merged copies alive at once
