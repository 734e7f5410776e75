"""A checkpoint usable outside VeRL, fixed after VeRL's own save of ``global_step_N/actor`` by the engine mixin
:class:`HFConfigDtypeOnSave`: its HF config names the dtype its weights are stored in
(:func:`match_saved_config_dtype`), and a LoRA checkpoint holds the merged model under the base model's names and the
adapter in peft's format (:func:`save_lora_checkpoint`).

VeRL 0.9.1 writes the peft model's names into ``huggingface/`` (``base_model.model.….base_layer.weight``), which
``AutoModelForCausalLM.from_pretrained`` does not recognise and silently initialises at random; ``litert export`` and
any Hugging Face user read that folder. The merge is :func:`verl_backend.weight_sync.lora.merged_lora_weights` (the
trainer's dtype, the module untouched), the same tensors the rollout samples on.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from rl_tpu.patches.torch_internals import unwrap_fsdp  # FSDP1's private wrapper attribute
from verl_backend.patches.verl_internals import engine_state
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


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def match_saved_config_dtype(hf_dir: str | os.PathLike) -> str | None:
    """Make an HF checkpoint's ``config.json`` name the dtype its ``*.safetensors`` weights are stored in.

    VeRL 0.9.1's ``FSDPCheckpointManager.save_checkpoint`` (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``)
    builds the model it saves with ``torch_dtype=torch.bfloat16`` and then writes the trainer's state dict into it:
    on our float32 CPU engine the file holds F32 tensors under a config saying ``"dtype": "bfloat16"``, so
    ``AutoModelForCausalLM.from_pretrained(ckpt)`` silently loads the trained model in bfloat16. The config is
    rewritten atomically (a temporary file renamed over it).

    Args:
        hf_dir: the checkpoint's ``huggingface`` folder.

    Returns:
        The dtype name now in the config (e.g. ``"float32"``), or ``None`` when there is no config, no safetensors
        file, or no floating-point tensor to read it from.
    """
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    config_path, files = hf_dir / "config.json", sorted(hf_dir.glob("*.safetensors"))
    if not config_path.is_file() or not files:
        return None
    name = None
    with safe_open(str(files[0]), framework="pt") as f:
        for key in f.keys():
            name = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
            if name is not None:
                break
    if name is None:
        return None
    config = json.loads(config_path.read_text())
    stale = [k for k in ("dtype", "torch_dtype") if k in config and config[k] != name]
    if stale:
        for k in stale:
            config[k] = name
        tmp = config_path.with_name(f".{config_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, config_path)
    return name


class HFConfigDtypeOnSave:
    """Engine mixin: after VeRL saves a checkpoint, rank 0 fixes its HF config's dtype
    (:func:`match_saved_config_dtype`); with LoRA, ``huggingface/`` becomes the merged model and ``lora_adapter/`` the
    adapter (:func:`save_lora_checkpoint`)."""

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        super().save_checkpoint(
            local_path, hdfs_path=hdfs_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep, **kwargs
        )
        if engine_state(self).lora and local_path is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            save_lora_checkpoint(self.module, local_path, rank=rank)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            match_saved_config_dtype(Path(local_path) / "huggingface")
