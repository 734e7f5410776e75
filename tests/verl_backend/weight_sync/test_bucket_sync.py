"""The object-store sync's sending loop, measured: a LoRA model's merged weights (made one tensor at a time by
:func:`verl_backend.weight_sync.lora.merged_lora_weights`, a new tensor per adapted matrix, several larger than a
bucket) through 1 MiB buckets into a rollout sampler. Streamed, the sender's peak extra memory stays within one bucket
(and its staging buffer) plus the largest tensor; materialising the export first (what the loop did before) holds every
merged copy at once. Each measurement runs in a fresh process (freed heap pages would hide the next peak), after one
warm-up pass over the export (the first pass faults in pages that no later sync pays for again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import asyncio, json, sys
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

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

trainer = get_peft_model(llama(0), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
with torch.no_grad():
    for name, p in trainer.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.05)
rollout = Sampler(llama(1), pad_token_id=0, eos_token_ids=[])

def send(flat, meta, last, total):  # the server's side, here: copied into the model at once, as ray.put copies
    rollout.load_state_dict(unpack_bucket(flat, meta))
    done = asyncio.get_running_loop().create_future()
    done.set_result(flat.nbytes)
    return done

export = (lambda: merged_lora_weights(trainer)) if sys.argv[1] == "streamed" else \
    (lambda: iter(list(merged_lora_weights(trainer))))  # the control: materialised first
for _ in merged_lora_weights(trainer):  # warm-up: the first pass faults in pages no later sync pays for again
    pass
open("/proc/self/clear_refs", "w").write("5")  # reset the peak resident size
base = status("VmRSS:")
loaded, n = asyncio.run(send_buckets(export(), 1 << 20, send))
extra = status("VmHWM:") - base
merged = dict(merged_lora_weights(trainer))  # sized after the measurement
same = all(torch.equal(v, merged[k]) for k, v in rollout.model.state_dict().items())
adapted = sum(m.base_layer.weight.nbytes for m in trainer.modules() if hasattr(m, "lora_A"))
print(json.dumps({"extra": extra, "largest": max(t.nbytes for t in merged.values()), "adapted": adapted,
                  "buckets": n, "same": same}))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and clear_refs")
def test_streamed_buckets_hold_a_few_buckets_not_the_export():
    def measure(mode: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=600,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # the lowest of three peaks: other allocations in the process (the event loop, the unpacking) only ever add
    streamed = min((measure("streamed") for _ in range(3)), key=lambda m: m["extra"])
    materialised = measure("materialised")
    mib = 1 << 20
    assert streamed["same"] and materialised["same"]  # the rollout holds the merged weights after the sync
    assert streamed["largest"] > mib and streamed["adapted"] > 40 * mib  # tensors larger than a bucket
    # one bucket, its 2 MiB staging buffer, the largest tensor (sent as its own bytes) and 3 MiB of allocator slack
    # (with 1 MiB it failed at an unchanged commit on 2026-12-03: 7.4 and 8.3 MiB against 7.0; materialised: >= 25)
    assert streamed["extra"] <= 1 * mib + 2 * mib + streamed["largest"] + 3 * mib, streamed
    assert materialised["extra"] >= 0.5 * streamed["adapted"], materialised  # most merged copies alive at once
