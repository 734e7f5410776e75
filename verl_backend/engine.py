"""The training engine for devices ``cpu`` and ``tpu``: VeRL's own FSDP2 engine, registered for them.

VeRL 0.9.1 registers ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` for ``cuda`` and ``npu`` only.
The engine itself is device-agnostic once the platform supplies the device module and the collective backend
(gloo on CPU, ``tpu_dist`` on TPU): FSDP2 ``fully_shard`` over ``init_device_mesh(<device>, ...)``. We register
subclasses for our devices rather than copying the engine.
"""

from __future__ import annotations

import inspect
import os

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

DEVICES = ["cpu", "tpu"]
RESPONSE_LOGITS_ENV = "RL_TPU_RESPONSE_ONLY_LOGITS"  # "0" computes logits at every position, as VeRL does
_FROM_KEY = "rl_tpu_logits_from"


def first_response_logit_position(micro_batch: TensorDict) -> int | None:
    """First position (in the packed, right-padded micro batch) whose logits predict a response token.

    In VeRL 0.9.1's no-padding layout sequence ``i`` of ``input_ids`` is its ``p_i`` prompt tokens followed by its
    ``r_i`` response tokens, and ``prompts`` / ``responses`` hold them as jagged nested tensors. The log-prob of
    response token ``p_i`` comes from the logits at position ``p_i - 1``, so this returns ``min_i p_i - 1`` (>= 0).
    Returns ``None`` (use VeRL's own path) when the micro batch does not have that layout.
    """
    keys = set(micro_batch.keys())
    if not {"prompts", "responses", "input_ids"} <= keys:
        return None
    prompts, responses, input_ids = micro_batch["prompts"], micro_batch["responses"], micro_batch["input_ids"]
    if not (prompts.is_nested and responses.is_nested and input_ids.is_nested):
        return None
    prompt_lens = prompts.offsets().diff()
    if not torch.equal(prompt_lens + responses.offsets().diff(), input_ids.offsets().diff()):
        return None
    return max(int(prompt_lens.min().item()) - 1, 0)


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """FSDP2 actor / reference engine on CPU (gloo) or TPU (TorchTPU).

    One change to VeRL's engine, in its padded (no remove-padding) path: the LM head runs only at the positions
    whose next token is a response token, through Hugging Face's ``logits_to_keep``, instead of at every prompt
    position too. Those are the only log-probs VeRL's losses read (``response_mask``); the prompt positions get
    log-prob 0. On the default job (prompts ~70 tokens, responses <= 64) this skips over half of the
    ``(tokens, vocab=49152)`` logits, their log-softmax and its backward, in the actor update and the reference
    forward alike (entropy too, when asked, with 0 at prompt positions). Σπ², distillation, fused kernels and
    remove-padding keep VeRL's own path, as does ``RL_TPU_RESPONSE_ONLY_LOGITS=0``.
    """

    def _response_only_applies(self, micro_batch: TensorDict) -> bool:
        get = tu.get_non_tensor_data
        if os.environ.get(RESPONSE_LOGITS_ENV, "1") == "0":
            return False
        if get(data=micro_batch, key="use_remove_padding", default=True) or \
                get(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
            return False
        for key in ("use_fused_kernels", "calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"):
            if get(data=micro_batch, key=key, default=False):
                return False
        if not hasattr(self, "_accepts_logits_to_keep"):
            forward = getattr(self.module, "forward", None)
            try:
                self._accepts_logits_to_keep = forward is not None and \
                    "logits_to_keep" in inspect.signature(forward).parameters
            except (TypeError, ValueError):
                self._accepts_logits_to_keep = False
        return self._accepts_logits_to_keep

    def prepare_model_inputs(self, micro_batch: TensorDict):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if self._response_only_applies(micro_batch) and "input_ids" in model_inputs:
            first = first_response_logit_position(micro_batch)
            if first is not None:
                seq_len = model_inputs["input_ids"].shape[-1]
                model_inputs["logits_to_keep"] = seq_len - first  # HF keeps the last N positions
                output_args[_FROM_KEY] = first
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch: TensorDict, logits_processor_func):
        first = output_args.get(_FROM_KEY)
        if first is None:
            return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        return response_log_probs(output.logits, micro_batch["input_ids"], first, output_args["temperature"],
                                  entropy="checkpointed" if entropy and self.engine_config.entropy_checkpointing
                                  else bool(entropy))


@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithValueHead(FSDPEngineWithValueHead):
    """FSDP2 critic engine on CPU (gloo) or TPU (TorchTPU)."""


def response_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, first: int, temperature: torch.Tensor,
                       entropy: bool | str = False) -> dict[str, torch.Tensor]:
    """Per-token log-probs (and entropy) as VeRL's engine returns them, from logits kept at positions ``first..``.

    Args:
        logits: ``(batch, seq_len - first, vocab)`` float, the model's logits at positions ``first..seq_len-1``
            of the right-padded micro batch (``seq_len`` = its longest sequence).
        input_ids: ``(batch, j1)`` int64 jagged nested tensor (VeRL's no-padding layout: prompt + response).
        first: position of the first kept logits (:func:`first_response_logit_position`).
        temperature: ``(batch,)`` sampling temperature per sequence; logits are divided by it (as VeRL does).
        entropy: also return the entropy of ``softmax(logits / temperature)``; ``"checkpointed"`` recomputes it in
            the backward pass (VeRL's ``entropy_checkpointing``).

    Returns:
        ``{"log_probs": ..., "entropy": ...}``, each ``(batch, j1)`` jagged nested float: at position ``t`` the
        log-prob of token ``t + 1`` (``verl.utils.torch_functional.logprobs_from_logits``) and the entropy
        (``verl.utils.torch_functional.entropy_from_logits``); 0 at the prompt positions before ``first``, which
        VeRL's losses and metrics mask out (``response_mask``).
    """
    from torch.distributed.tensor import DTensor
    from verl.utils.torch_functional import entropy_from_logits

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    batch, kept = logits.shape[0], logits.shape[1]
    seq_len = first + kept
    offsets = input_ids.offsets()
    ids = torch.nested.to_padded_tensor(input_ids, padding=0, output_size=(batch, seq_len + 1))
    labels = ids[:, first + 1: first + 1 + kept]
    temperature = temperature.reshape(batch, 1, 1).clamp(min=1e-8).to(logits.dtype)
    if not bool((temperature == 1).all()):
        logits = logits / temperature
    valid = torch.arange(seq_len, device=logits.device).unsqueeze(0) < offsets.diff().to(logits.device).unsqueeze(1)

    def pack(per_position: torch.Tensor) -> torch.Tensor:  # (batch, kept) -> (batch, j1) nested, zeros before first
        full = torch.cat([per_position.new_zeros(batch, first), per_position], dim=1) if first else per_position
        return torch.nested.nested_tensor_from_jagged(full[valid], offsets)

    out = {"log_probs": pack(logprobs_from_logits(logits=logits, labels=labels))}
    if entropy == "checkpointed":
        out["entropy"] = pack(torch.utils.checkpoint.checkpoint(entropy_from_logits, logits, use_reentrant=False))
    elif entropy:
        out["entropy"] = pack(entropy_from_logits(logits))
    return out
