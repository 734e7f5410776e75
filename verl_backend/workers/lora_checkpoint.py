"""A LoRA checkpoint usable outside VeRL: the merged model under the base model's names, and the adapter in peft's
format, written beside VeRL's own save of ``global_step_N/actor``.

VeRL 0.9.1 writes the peft model's names into ``huggingface/`` (``base_model.model.….base_layer.weight``), which
``AutoModelForCausalLM.from_pretrained`` does not recognise and silently initialises at random; ``litert export`` and
any Hugging Face user read that folder. The merge is :func:`verl_backend.weight_sync.lora.merged_lora_weights` (the
trainer's dtype, the module untouched), the same tensors the rollout samples on.
"""

from __future__ import annotations

import os
import shutil

import torch

from rl_tpu.patches.torch_internals import unwrap_fsdp  # FSDP1's private wrapper attribute
from verl_backend.weight_sync.lora import merged_lora_weights


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a parameter (``DTensor``: gathered, a collective; on one rank its local tensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _swap_in(new_dir: str, final_dir: str) -> None:
    """Put the finished folder ``new_dir`` at ``final_dir``: the old one is renamed aside first and removed last, so
    a crash leaves either folder whole (the aside one named ``<final>.replaced``)."""
    aside = final_dir + ".replaced"
    shutil.rmtree(aside, ignore_errors=True)
    if os.path.isdir(final_dir):
        os.rename(final_dir, aside)
    os.rename(new_dir, final_dir)
    shutil.rmtree(aside, ignore_errors=True)


def save_lora_checkpoint(module: torch.nn.Module, checkpoint_dir: str, rank: int = 0) -> tuple[str, str] | None:
    """Rewrite ``checkpoint_dir/huggingface/`` as the merged model under the base model's names (VeRL's config,
    generation config and tokenizer files kept) and write ``checkpoint_dir/lora_adapter/`` in peft's format
    (``adapter_config.json``, ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, dir)``). Each folder
    is written whole under another name, then renamed into place. Call on every rank after VeRL's save (gathering is
    collective); rank 0 writes.

    Args:
        module: the trainer's peft model (possibly FSDP2-wrapped).
        checkpoint_dir: VeRL's ``global_step_N/actor`` folder (holding ``huggingface/`` with config and tokenizer).
        rank: this process's rank.

    Returns:
        ``(merged model folder, adapter folder)`` on rank 0, else ``None``.

    Raises:
        OSError: the folders cannot be written (the checkpoint VeRL wrote stays).
    """
    from peft.utils.save_and_load import get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from verl.utils.transformers_compat import drop_tied_target_keys

    peft_model = unwrap_fsdp(module)
    merged = dict(merged_lora_weights(module))  # every rank: full_tensor() is collective
    adapter = {k: _whole(v).detach() for k, v in get_peft_model_state_dict(peft_model).items()}
    if rank != 0:
        return None
    hf_dir, adapter_dir = os.path.join(checkpoint_dir, "huggingface"), os.path.join(checkpoint_dir, "lora_adapter")
    base = peft_model.get_base_model()
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(base.config, dtype=next(iter(merged.values())).dtype)
    drop_tied_target_keys(merged, shell, base.config)
    weights = lambda name: name.endswith(".safetensors") or name == "model.safetensors.index.json"  # noqa: E731
    staging = hf_dir + ".merging"
    shutil.rmtree(staging, ignore_errors=True)
    # VeRL's config, generation config and tokenizer, without its peft-named weights
    shutil.copytree(hf_dir, staging, ignore=lambda _d, names: [n for n in names if weights(n)])
    keep = {}  # the shell's save_pretrained would replace VeRL's config and generation config
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(staging, name)):
            with open(os.path.join(staging, name), "rb") as f:
                keep[name] = f.read()
    shell.save_pretrained(staging, state_dict={k: v.contiguous() for k, v in merged.items()})
    for name, data in keep.items():
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    _swap_in(staging, hf_dir)
    staging = adapter_dir + ".writing"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    peft_model.peft_config["default"].save_pretrained(staging)
    save_file({k: v.contiguous() for k, v in adapter.items()}, os.path.join(staging, "adapter_model.safetensors"))
    _swap_in(staging, adapter_dir)
    return hf_dir, adapter_dir
