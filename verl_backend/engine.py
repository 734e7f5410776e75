"""The training engine for devices ``cpu`` and ``tpu``: VeRL's own FSDP2 engine, registered for them.

VeRL 0.9.1 registers ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` for ``cuda`` and ``npu`` only.
The engine itself is device-agnostic once the platform supplies the device module and the collective backend
(gloo on CPU, ``tpu_dist`` on TPU): FSDP2 ``fully_shard`` over ``init_device_mesh(<device>, ...)``. We register
subclasses for our devices rather than copying the engine. On one CPU rank the model runs unwrapped instead
(:class:`_SingleRankPlainModule`): FSDP2 would shard nothing there and only add copies.
"""

from __future__ import annotations

import inspect
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from verl_backend.settings import current
from verl_backend.shared_prefix import no_padding_layout, attention_kinds, shared_prefix_inputs

DEVICES = ["cpu", "tpu"]
_FROM_KEY = "rl_tpu_logits_from"
_KEEP_KEY = "rl_tpu_logits_keep"


def first_response_logit_position(micro_batch: TensorDict) -> int | None:
    """First position (in the packed, right-padded micro batch) whose logits predict a response token.

    In VeRL 0.9.1's no-padding layout sequence ``i`` of ``input_ids`` is its ``p_i`` prompt tokens followed by its
    ``r_i`` response tokens, and ``prompts`` / ``responses`` hold them as jagged nested tensors. The log-prob of
    response token ``p_i`` comes from the logits at position ``p_i - 1``, so this returns ``min_i p_i - 1`` (>= 0).
    Returns ``None`` (use VeRL's own path) when the micro batch does not have that layout.
    """
    layout = no_padding_layout(micro_batch)
    if layout is None:
        return None
    return max(int(layout[0].min().item()) - 1, 0)


def response_logit_indices(micro_batch: TensorDict) -> torch.Tensor | None:
    """Positions in the packed (remove-padding) row whose logits predict a response token.

    In VeRL 0.9.1's no-padding layout the micro batch packs to one row of ``total_nnz`` tokens, sequence ``i`` at
    ``offsets[i]`` with ``p_i`` prompt then ``r_i`` response tokens. Its response tokens are predicted at
    ``offsets[i] + p_i - 1 ... offsets[i] + p_i + r_i - 2``. Returns those positions, ascending, as a ``(sum r_i,)``
    int64 tensor, or ``None`` when the micro batch has another layout (or a sequence without prompt tokens).
    """
    layout = no_padding_layout(micro_batch)
    if layout is None or bool((layout[0] < 1).any()):
        return None
    prompt_lens, response_lens, offsets = layout
    starts = offsets[:-1] + prompt_lens - 1  # (batch,) position predicting each sequence's first response token
    run_start = torch.cumsum(response_lens, 0) - response_lens  # (batch,) where each sequence's run begins
    within = torch.arange(int(response_lens.sum())) - torch.repeat_interleave(run_start, response_lens)
    return torch.repeat_interleave(starts, response_lens) + within


def packed_response_log_probs(logits: torch.Tensor, labels_rolled: torch.Tensor, temperature: torch.Tensor,
                              keep: torch.Tensor, offsets: torch.Tensor,
                              entropy: bool | str = False) -> dict[str, torch.Tensor]:
    """Per-token log-probs (and entropy) as VeRL's remove-padding path returns them, from logits kept at ``keep``.

    Args:
        logits: ``(1, K, vocab)`` float, the model's logits predicting the ``K`` response tokens, in the order of
            ``keep`` (from VeRL's packed row, or from a :func:`shared_prefix_inputs` row).
        labels_rolled: ``(total_nnz,)`` int64, the packed tokens shifted left by one (VeRL's
            ``input_ids_rmpad_rolled``): the label of position ``t`` is token ``t + 1``.
        temperature: ``(total_nnz,)`` float, the sampling temperature of each position's sequence
            (VeRL's ``temperature_rmpad``); logits are divided by it.
        keep: ``(K,)`` int64 positions (:func:`response_logit_indices`).
        offsets: ``(batch + 1,)`` int64 sequence offsets of the packed row (the nested ``input_ids``').
        entropy: also return the entropy of ``softmax(logits / temperature)``; ``"checkpointed"`` recomputes it in
            the backward pass (VeRL's ``entropy_checkpointing``).

    Returns:
        ``{"log_probs": ..., "entropy": ...}``, each ``(batch, j1)`` jagged nested float
        (``verl.utils.torch_functional.logprobs_from_logits`` / ``entropy_from_logits`` at the kept positions, 0
        elsewhere: VeRL's losses and metrics read only the response positions, ``response_mask``).
    """
    from torch.distributed.tensor import DTensor
    from verl.utils.torch_functional import entropy_from_logits

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logits = logits.squeeze(0)  # (K, vocab)
    temp = temperature[keep].clamp(min=1e-8).to(logits.dtype).unsqueeze(-1)  # (K, 1)
    if not bool((temp == 1).all()):
        logits = logits / temp
    total = labels_rolled.shape[0]

    def pack(per_kept: torch.Tensor) -> torch.Tensor:  # (K,) -> (batch, j1) nested, zeros off the kept positions
        full = per_kept.new_zeros(total).scatter(0, keep, per_kept)
        return torch.nested.nested_tensor_from_jagged(full, offsets)

    out = {"log_probs": pack(logprobs_from_logits(logits=logits, labels=labels_rolled[keep]))}
    if entropy == "checkpointed":
        out["entropy"] = pack(torch.utils.checkpoint.checkpoint(entropy_from_logits, logits, use_reentrant=False))
    elif entropy:
        out["entropy"] = pack(entropy_from_logits(logits))
    return out


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


class _HFConfigDtypeOnSave:
    """Engine mixin: after VeRL saves a checkpoint, rank 0 fixes its HF config's dtype (:func:`match_saved_config_dtype`);
    with LoRA, ``huggingface/`` becomes the merged model and ``lora_adapter/`` the adapter
    (:func:`verl_backend.lora_sync.save_lora_checkpoint`)."""

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        super().save_checkpoint(local_path, hdfs_path=hdfs_path, global_step=global_step,
                                max_ckpt_to_keep=max_ckpt_to_keep, **kwargs)
        if getattr(self, "_is_lora", False) and local_path is not None:
            from verl_backend.lora_sync import save_lora_checkpoint

            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            save_lora_checkpoint(self.module, local_path, rank=rank)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            match_saved_config_dtype(Path(local_path) / "huggingface")


class _SingleRankPlainModule:
    """Engine mixin: on one CPU rank, train the Hugging Face module as it is instead of wrapping it in FSDP2.

    With a world size of 1 FSDP2 shards nothing, yet it still costs host memory and time: the root module's
    parameters (for SmolLM2 the 113 MB tied embedding and LM head) are "all-gathered" into a second copy that lives
    from the start of each forward to the end of its backward, every block's parameters are copied in each forward
    and again in the backward, and every gradient goes through a reduce-scatter input and output buffer. Measured on
    SmolLM2-135M (4 micro batches of 400 tokens, AdamW, one thread): peak anonymous memory 3.24 against 3.55 GiB,
    and each step about 8% shorter.

    The module is left plain only where FSDP2 would change nothing about the numbers: strategy ``fsdp2``, one
    rank, a CPU device mesh, no LoRA, QAT, parameter / optimizer offload, activation offload or Ulysses, and the
    mixed-precision ``param_dtype`` and ``reduce_dtype`` equal to the dtype the weights are stored in (so no
    per-layer cast: a reference policy stored in bfloat16 and computed in float32 stays wrapped; the CPU default
    stores and computes all three in float32). Anywhere else, and with ``rl_tpu.plain_module=false``, VeRL's own FSDP2
    wrapping runs. VeRL 0.9.1's engine already handles an
    unwrapped module (``fsdp_version(module) == 0``) in its optimizer step (``clip_grad_norm_``), checkpoint manager
    and weight export; the one place it does not, the gradient-sync context of gradient accumulation, has nothing to
    synchronise on one rank.

    Checkpoints keep VeRL's layout (``model_world_size_1_rank_0.pt`` and ``fsdp_config.json``, whose
    ``FSDP_version`` is 0 here and 2 under FSDP2); the two hold plain tensors and ``DTensor`` s respectively, so a
    resume across the switch is refused with one line naming ``rl_tpu.plain_module``.
    """

    plain_module_reason: str | None = "not built yet"  # why FSDP2 wraps the module; None: it trains as it is

    def _plain_module_blocker(self, module: torch.nn.Module) -> str | None:
        from verl.utils.torch_dtypes import PrecisionType

        config = self.engine_config
        if not current().plain_module:
            return "rl_tpu.plain_module=false"
        if config.strategy != "fsdp2":
            return f"strategy {config.strategy}"
        if torch.distributed.get_world_size() != 1:
            return "several ranks: FSDP2 shards the parameters over them"
        if getattr(self.device_mesh, "device_type", None) != "cpu":
            return "an accelerator mesh"
        if (self._is_lora or self._qat_enabled or self._is_offload_param or self._is_offload_optimizer
                or config.offload_policy or self.model_config.enable_activation_offload
                or self.ulysses_sequence_parallel_size > 1):
            return "LoRA, QAT, offload or sequence parallelism"
        mp = config.mixed_precision or {}
        stored = {p.dtype for p in module.parameters()}
        wanted = {PrecisionType.to_dtype(mp.get("param_dtype", "bf16")),
                  PrecisionType.to_dtype(mp.get("reduce_dtype", "fp32"))}
        if len(stored) != 1 or stored != wanted:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in stored))
            return f"weights stored in {names}, computed in mixed precision: FSDP2 casts them layer by layer"
        return None

    def _build_fsdp_module(self, module):
        from verl_backend.settings import RECORD_ENV, digest

        self.plain_module_reason = self._plain_module_blocker(module)
        role = ("reference policy" if self.engine_config.forward_only else
                "critic" if self.model_config.model_type == "value_model" else "actor")
        if torch.distributed.get_rank() == 0:  # which settings record this worker runs on (one line per engine)
            print(f"[rl-tpu] {role}: settings record {digest(os.environ[RECORD_ENV])}", flush=True)
        if self.plain_module_reason is not None:
            if torch.distributed.get_rank() == 0:
                print(f"[rl-tpu] {role}: FSDP2 wraps the model ({self.plain_module_reason})", flush=True)
            return super()._build_fsdp_module(module)
        self._autocast_dtype = next(module.parameters()).dtype  # float32: VeRL's forward_step skips autocast
        self.scaler = None
        print(f"[rl-tpu] {role}: one CPU rank, so the model runs unwrapped, without FSDP2's parameter and "
              f"gradient copies (rl_tpu.plain_module=false wraps it)", flush=True)
        return module

    @contextmanager
    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        if self.plain_module_reason is None:  # one rank: nothing to synchronise
            yield
            return
        with super()._gradient_sync_context(is_last_micro_batch=is_last_micro_batch):
            yield

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        saved = _saved_fsdp_version(local_path)
        ours = 0 if self.plain_module_reason is None else 2
        if saved in (0, 2) and saved != ours and self.engine_config.strategy == "fsdp2":
            from verl_backend.errors import BadInputError, record_bad_input

            how = ("run with rl_tpu.plain_module=false to resume it (its tensors are FSDP2 DTensors)" if saved == 2
                   else "run on one CPU rank with rl_tpu.plain_module=true to resume it (its tensors are plain)")
            exc = BadInputError(f"checkpoint {local_path}: saved by an engine {'with' if saved else 'without'} FSDP2, "
                                f"and this one trains {'without' if saved else 'with'} it; {how}, or start over with "
                                "trainer.resume_mode=disable")
            record_bad_input(exc)
            raise exc
        return super().load_checkpoint(local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load,
                                       **kwargs)


def _saved_fsdp_version(local_path) -> int | None:
    """``FSDP_version`` in a VeRL checkpoint's ``fsdp_config.json`` (0: an unwrapped module), or ``None``."""
    try:
        return int(json.loads((Path(local_path) / "fsdp_config.json").read_text())["FSDP_version"])
    except (OSError, TypeError, ValueError, KeyError):
        return None


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithLMHead(_SingleRankPlainModule, _HFConfigDtypeOnSave, FSDPEngineWithLMHead):
    """FSDP2 actor / reference engine on CPU (gloo) or TPU (TorchTPU); unwrapped on one CPU rank.

    One change to VeRL's engine: the LM head runs only at the positions whose next token is a response token,
    through Hugging Face's ``logits_to_keep``, instead of at every prompt position too. Those are the only
    log-probs VeRL's losses read (``response_mask``); the other positions get log-prob 0. On the default job
    (prompts ~70 tokens, responses <= 64) this skips most of the ``(tokens, vocab=49152)`` logits, their
    log-softmax and its backward, in the actor update and the reference forward alike (entropy too, when asked).

    - remove-padding (``use_remove_padding=True``, the CPU default): the micro batch is one packed row of
      ``total_nnz`` tokens (Hugging Face keeps the sequences apart with a block-diagonal causal mask built from
      the ``position_ids``, so no flash-attn is needed); ``logits_to_keep`` is the 1-D index of the response
      positions (:func:`response_logit_indices`). When sequences share a prompt (GRPO's ``n`` samples), the row
      holds that prompt once (:func:`verl_backend.shared_prefix.shared_prefix_inputs`, with sliding windows where
      the model has them; ``actor.use_prefix_grouper=false`` turns it off).
    - padded (``use_remove_padding=False``): the kept logits are the last ``seq_len - first`` positions
      (:func:`first_response_logit_position`).

    Σπ², distillation, fused kernels, Ulysses sequence parallel and a static packed length keep VeRL's own path,
    as does ``rl_tpu.response_only_logits=false``.

    On CPU, a training engine (not the reference policy) also hands the heap pages its activations free back to the
    OS after each transformer block's backward (:class:`rl_tpu.device.BackwardHeapTrim`, ``backward_trim``), which
    lowers the update's peak host memory; ``rl_tpu.trim_backward=false`` turns it off.
    """

    def initialize(self):
        super().initialize()
        global _TRAINER_WEIGHTS
        self.shared_weights = None
        reason = self._shared_weights_blocker()
        if reason is None:
            from rl_tpu.shared_weights import SharedWeightsError

            try:
                self.shared_weights = share_fsdp_parameters(self.module)
            except (SharedWeightsError, OSError) as exc:
                reason = str(exc)
            else:
                _TRAINER_WEIGHTS = self.shared_weights
        self._shared_weights_reason = reason
        self.backward_trim = None
        if next(self.module.parameters()).device.type == "cpu":
            from rl_tpu.device import BackwardHeapTrim, freeze_long_lived_objects

            if not self.engine_config.forward_only and current().trim_backward:
                self.backward_trim = BackwardHeapTrim(self.module)  # peak host memory of the update
                print(f"[rl-tpu] actor backward: heap pages handed back after each of {self.backward_trim.blocks} "
                      "blocks (rl_tpu.trim_backward=false turns it off)", flush=True)
            freeze_long_lived_objects()  # VeRL's empty_cache collects garbage several times a step

    def _shared_weights_blocker(self) -> str | None:
        """Why this engine's parameters stay in private memory (``None``: they move into shared memory)."""
        if not current().shared_weights:
            return "rl_tpu.shared_weights=false"
        if self.engine_config.forward_only:
            return "a forward-only engine (reference policy) sends no weights"
        if next(self.module.parameters()).device.type != "cpu":
            return "parameters on an accelerator"
        if torch.distributed.get_world_size() != 1:
            return "FSDP shards the parameters over several ranks: the rollout needs whole tensors"
        if self._is_lora or self._qat_enabled or self._is_offload_param:
            return "LoRA, QAT or parameter offload sends transformed weights"
        return None

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """VeRL's weight export; with the parameters in shared memory, each yields its own storage (one rank
        holds whole tensors, so ``full_tensor()``'s copy is skipped) and the rollout adapter finds it already in
        place. With LoRA: the merged model's weights under its Hugging Face names in the trainer's dtype
        (:func:`verl_backend.lora_sync.merged_lora_weights`) whatever ``model.lora.merge`` says, and no peft config:
        the native rollout has no adapter slots, it samples on the merged model."""
        if self._is_lora:
            from verl_backend.lora_sync import merged_lora_weights

            return merged_lora_weights(self.module), None
        if self.shared_weights is None:
            return super().get_per_tensor_param(layered_summon=layered_summon, base_sync_done=base_sync_done,
                                                **kwargs)
        from torch.distributed.tensor import DTensor
        from verl.utils.model import convert_weight_keys

        params = convert_weight_keys(self.module.state_dict(),
                                     getattr(self.module, "_fsdp_wrapped_module", self.module))
        return ((n, p.to_local() if isinstance(p, DTensor) else p) for n, p in params.items()), None

    def _response_only_applies(self, micro_batch: TensorDict) -> bool:
        get = tu.get_non_tensor_data
        if not current().response_only_logits:
            return False
        if get(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
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

    def _shared_prefix_kinds(self):
        """The model's masking for the shared-prefix row (:func:`verl_backend.shared_prefix.attention_kinds`), read
        once; ``None`` (and one line saying why) when the row cannot compute the model's own numbers."""
        if not hasattr(self, "_prefix_kinds"):
            kinds = attention_kinds(self.module)
            if isinstance(kinds, str):
                print(f"[rl-tpu] shared-prefix forward off for this model ({kinds}): each sequence keeps its own "
                      "copy of its prompt", flush=True)
                kinds = None
            self._prefix_kinds = kinds
        return self._prefix_kinds

    def _mask_dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def prepare_model_inputs(self, micro_batch: TensorDict):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if not (self._response_only_applies(micro_batch) and "input_ids" in model_inputs):
            return model_inputs, output_args
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            if getattr(self, "use_ulysses_sp", False) or output_args.get("pad_size", 0):
                return model_inputs, output_args  # sliced or padded packed rows: VeRL's own path
            keep = response_logit_indices(micro_batch)
            if keep is not None and keep.numel() > 0:
                device = model_inputs["input_ids"].device
                kinds = self._shared_prefix_kinds() if current().shared_prefix else None
                shared = shared_prefix_inputs(micro_batch, kinds, self._mask_dtype()) if kinds is not None else None
                if shared is not None:  # one copy of each prompt, its samples' responses all attend to it
                    row_inputs, row_keep = shared
                    if not getattr(self, "_reported_shared_prefix", False):
                        self._reported_shared_prefix = True
                        print(f"[rl-tpu] shared-prefix forward: a micro batch of {micro_batch.batch_size[0]} "
                              f"sequences packs to {row_inputs['input_ids'].shape[1]} tokens instead of "
                              f"{model_inputs['input_ids'].shape[1]}", flush=True)
                    mask = row_inputs.pop("attention_mask")
                    model_inputs.update({k: v.to(device) for k, v in row_inputs.items()})
                    model_inputs["attention_mask"] = {k: m.to(device) for k, m in mask.items()} \
                        if isinstance(mask, dict) else mask.to(device)
                    model_inputs["logits_to_keep"] = row_keep.to(device)
                else:
                    model_inputs["logits_to_keep"] = keep.to(device)
                output_args[_KEEP_KEY] = keep.to(device)  # the same positions in VeRL's packed layout
        else:
            first = first_response_logit_position(micro_batch)
            if first is not None:
                seq_len = model_inputs["input_ids"].shape[-1]
                model_inputs["logits_to_keep"] = seq_len - first  # HF keeps the last N positions
                output_args[_FROM_KEY] = first
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch: TensorDict, logits_processor_func):
        first, keep = output_args.get(_FROM_KEY), output_args.get(_KEEP_KEY)
        if first is None and keep is None:
            return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        entropy = "checkpointed" if entropy and self.engine_config.entropy_checkpointing else bool(entropy)
        if keep is not None:
            return packed_response_log_probs(output.logits, output_args["input_ids_rmpad_rolled"],
                                             output_args["temperature_rmpad"], keep, micro_batch["input_ids"].offsets(),
                                             entropy=entropy)
        return response_log_probs(output.logits, micro_batch["input_ids"], first, output_args["temperature"],
                                  entropy=entropy)


_TRAINER_WEIGHTS = None  # the actor's SharedWeights in this process, if its parameters live in shared memory


def trainer_shared_weights():
    """The :class:`rl_tpu.shared_weights.SharedWeights` holding this process's actor parameters, or ``None``."""
    return _TRAINER_WEIGHTS


def share_fsdp_parameters(module: torch.nn.Module, name: str = "rl_tpu_actor"):
    """Move an FSDP2 module's parameter storage into one shared-memory file, in place (one rank: whole tensors).

    An unwrapped module (one CPU rank, :class:`_SingleRankPlainModule`) gets the same: each parameter's ``.data``
    becomes its view of the file.

    Every ``FSDPParam``'s sharded storage (``_sharded_param_data`` and the ``DTensor``'s local tensor, what the
    optimizer updates and the all-gather reads) becomes a view of the file, so a reader that maps it (the rollout
    server, :class:`rl_tpu.shared_weights.SharedWeightsReader`) sees each optimizer step with no copy. The
    ``Parameter`` objects stay the same (the optimizer's references remain valid); FSDP2's lazy init keeps the
    storage since it is already padded (``FSDPParam.reset_sharded_param``, torch 2.13). Slot names are the
    state-dict keys after VeRL's ``convert_weight_keys`` (the names ``get_per_tensor_param`` yields, i.e. the
    rollout model's); tied weights share a slot.

    Raises:
        rl_tpu.shared_weights.SharedWeightsError: a parameter that is sharded (more than one rank), padded, or not
            on the CPU; or any state-dict tensor FSDP does not manage.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from verl.utils.model import convert_weight_keys

    from rl_tpu.shared_weights import SharedWeights, SharedWeightsError

    by_param = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    by_param[id(fp.sharded_param)] = fp
    named = convert_weight_keys(module.state_dict(keep_vars=True),
                                getattr(module, "_fsdp_wrapped_module", module))
    if not by_param:  # an unwrapped module (_SingleRankPlainModule): each tensor's .data moves into the file
        return SharedWeights.from_named_tensors(named, name=name)
    groups: dict[int, tuple[list[str], object]] = {}
    for key, param in named.items():
        fp = by_param.get(id(param))
        if fp is None or not isinstance(param, DTensor):
            raise SharedWeightsError(f"{key!r} is not an FSDP2 parameter: shared-memory weights need every tensor of "
                                     "the actor's state_dict managed by fully_shard")
        if tuple(fp.padded_sharded_param_size) != tuple(fp._orig_size):
            raise SharedWeightsError(f"{key!r} is sharded or padded ({tuple(fp._orig_size)} -> "
                                     f"{tuple(fp.padded_sharded_param_size)}): shared-memory weights need one rank")
        groups.setdefault(id(fp), ([], fp))[0].append(key)

    def rebind_to(fp):
        def rebind(_old: torch.Tensor, view: torch.Tensor) -> None:  # view: (orig shape) in the file
            fp._sharded_param_data = view.view(-1)
            fp.sharded_param._local_tensor = view
        return rebind

    entries = [(names, fp._sharded_param_data.view(fp._orig_size), rebind_to(fp)) for names, fp in groups.values()]
    return SharedWeights.from_tensors(entries, name=name)


@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithValueHead(_SingleRankPlainModule, _HFConfigDtypeOnSave, FSDPEngineWithValueHead):
    """FSDP2 critic engine on CPU (gloo) or TPU (TorchTPU); unwrapped on one CPU rank."""


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
