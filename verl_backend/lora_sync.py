"""LoRA weight sync for the native rollout: the merged model's weights, one tensor at a time, in the trainer's dtype.

The native rollout has no adapter slots: it samples on the merged model ``W + (alpha / r) * B @ A`` (peft's
``get_delta_weight``), under the base model's Hugging Face names. VeRL 0.9.1's own merged export
(``FSDPEngine._merged_lora_per_tensor_param``) merges the adapters into the trainer's module in place, backs the base
weights up and restores them, and casts every sharded tensor to bfloat16 on the way out: a float32 rollout then
samples on other numbers than the trainer computes (``rollout_corr/kl`` 5e-4 on a tiny Llama at step 1, where the
adapter is still zero). :func:`merged_lora_weights` leaves the module untouched, computes each merged tensor on its
own and keeps its dtype, so the rollout's log-probs are the trainer's.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a parameter (``DTensor``: gathered; on one rank its local tensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _delta(layer, adapter: str) -> torch.Tensor:
    """``scaling * B @ A`` of ``layer``'s ``adapter`` in the base weight's layout (peft's ``get_delta_weight``, on
    whole tensors)."""
    from peft.tuners.lora import Embedding, Linear

    if isinstance(layer, Linear):
        a, b = _full(layer.lora_A[adapter].weight), _full(layer.lora_B[adapter].weight)  # (r, in), (out, r)
        delta = b @ a  # (out, in); scaled in place: one new tensor per adapted matrix
        return (delta.T.contiguous() if layer.fan_in_fan_out else delta).mul_(layer.scaling[adapter])
    if isinstance(layer, Embedding):
        a, b = _full(layer.lora_embedding_A[adapter]), _full(layer.lora_embedding_B[adapter])  # (r, vocab), (dim, r)
        return (b @ a).T.contiguous().mul_(layer.scaling[adapter])  # (vocab, dim)
    raise ValueError(f"LoRA on a {type(layer).__name__} layer: the native rollout merges Linear and Embedding "
                     "adapters only; leave this module out of actor_rollout_ref.model.target_modules")


@torch.no_grad()
def merged_lora_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged model's ``(Hugging Face name, tensor)`` pairs, computed per tensor; ``module`` is not modified.

    Args:
        module: the trainer's peft model (``PeftModel``), possibly FSDP2-wrapped (one rank or several:
            ``full_tensor()`` gathers).

    Yields:
        each base-model tensor under the name the rollout model has (``model.layers.0.self_attn.q_proj.weight``),
        in the trainer's dtype; an adapted weight as ``W + scaling * B @ A`` of its active adapters.

    Raises:
        ValueError: an adapter on a layer kind other than Linear or Embedding, or DoRA (``use_dora``), whose merge
            is not a sum.
    """
    from peft.tuners.lora import LoraLayer
    from verl.utils.model import convert_weight_keys

    peft_model = getattr(module, "_fsdp_wrapped_module", module)
    layers = {}  # base_layer weight's state-dict name -> LoRA layer
    for name, m in peft_model.named_modules():
        if isinstance(m, LoraLayer):
            if any(m.use_dora.get(a, False) for a in m.active_adapters):
                raise ValueError(f"{name}: DoRA adapters (use_dora) are not merged by the native rollout's sync")
            layers[f"{name}.base_layer.weight"] = m
    state = peft_model.state_dict()
    names = {}  # state-dict name -> Hugging Face name
    for name in state:
        if "lora_" in name or ".adapter_" in name:
            continue
        names[name] = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
    hf_names = convert_weight_keys({hf: None for hf in names.values()}, peft_model.get_base_model()
                                   if hasattr(peft_model, "get_base_model") else peft_model)
    for (name, _), hf in zip(names.items(), hf_names):
        tensor = _full(state[name]).detach()
        layer = layers.get(name)
        if layer is not None and not layer.merged and not layer.disable_adapters:
            for adapter in layer.active_adapters:
                if adapter in layer.scaling:
                    # into the fresh delta, in place: W + delta without a third copy (and W is never written)
                    tensor = _delta(layer, adapter).to(tensor.dtype).add_(tensor)
        yield hf, tensor


def save_lora_checkpoint(module: torch.nn.Module, checkpoint_dir: str, rank: int = 0) -> tuple[str, str] | None:
    """Make a LoRA checkpoint usable outside VeRL: its ``huggingface/`` folder becomes the merged model under the base
    model's names (VeRL 0.9.1 writes the peft model's names there, ``base_model.model.….base_layer.weight``, which
    ``AutoModelForCausalLM.from_pretrained`` does not recognise and silently initialises at random), and
    ``lora_adapter/`` receives the adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``;
    ``PeftModel.from_pretrained(base, dir)``). Call on every rank after VeRL's save (gathering is collective); rank
    0 writes.

    Args:
        module: the trainer's peft model (possibly FSDP2-wrapped).
        checkpoint_dir: VeRL's ``global_step_N/actor`` folder (holding ``huggingface/`` with config and tokenizer).
        rank: this process's rank.

    Returns:
        ``(merged model folder, adapter folder)`` on rank 0, else ``None``.
    """
    import os

    from peft.utils.save_and_load import get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from verl.utils.transformers_compat import drop_tied_target_keys

    peft_model = getattr(module, "_fsdp_wrapped_module", module)
    merged = dict(merged_lora_weights(module))  # every rank: full_tensor() is collective
    adapter = {k: _full(v).detach() for k, v in get_peft_model_state_dict(peft_model).items()}
    if rank != 0:
        return None
    hf_dir, adapter_dir = os.path.join(checkpoint_dir, "huggingface"), os.path.join(checkpoint_dir, "lora_adapter")
    base = peft_model.get_base_model()
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(base.config, dtype=next(iter(merged.values())).dtype)
    drop_tied_target_keys(merged, shell, base.config)
    keep = {}  # VeRL's config and generation config (the shell's own would replace them)
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(hf_dir, name)):
            with open(os.path.join(hf_dir, name), "rb") as f:
                keep[name] = f.read()
    for stale in os.listdir(hf_dir):  # VeRL's peft-named weights
        if stale.endswith(".safetensors") or stale == "model.safetensors.index.json":
            os.remove(os.path.join(hf_dir, stale))
    shell.save_pretrained(hf_dir, state_dict={k: v.contiguous() for k, v in merged.items()})
    for name, data in keep.items():
        with open(os.path.join(hf_dir, name), "wb") as f:
            f.write(data)
    os.makedirs(adapter_dir, exist_ok=True)
    peft_model.peft_config["default"].save_pretrained(adapter_dir)
    save_file({k: v.contiguous() for k, v in adapter.items()}, os.path.join(adapter_dir, "adapter_model.safetensors"))
    return hf_dir, adapter_dir
