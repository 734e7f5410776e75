"""The training engine for devices ``cpu`` and ``tpu``: VeRL's own FSDP2 engine, registered for them.

VeRL 0.9.1 registers ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` for ``cuda`` and ``npu`` only.
The engine itself is device-agnostic once the platform supplies the device module and the collective backend
(gloo on CPU, ``tpu_dist`` on TPU): FSDP2 ``fully_shard`` over ``init_device_mesh(<device>, ...)``. We register
subclasses for our devices rather than copying the engine. On one CPU rank the model runs unwrapped instead
(:class:`verl_backend.host_memory.plain_module.SingleRankPlainModule`): FSDP2 would shard nothing there and only add
copies. The LM head runs at response positions only (:mod:`verl_backend.workers.response_logits`).
"""

from __future__ import annotations

import inspect

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import (
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
)

from rl_tpu.patches.torch_internals import unwrap_fsdp  # FSDP1's private wrapper attribute
from verl_backend import weight_sync
from verl_backend.host_memory.plain_module import SingleRankPlainModule
from verl_backend.patches.verl_internals import engine_state
from verl_backend.settings import EngineSettings, current, engine_settings
from verl_backend.workers.lora_checkpoint import HFConfigDtypeOnSave
from verl_backend.workers.response_logits import (
    HeadPassThrough,
    chunked_response_log_probs,
    first_response_logit_position,
    logits_chunk_tokens,
    packed_response_log_probs,
    response_log_probs,
    response_logit_indices,
)
from verl_backend.workers.shared_prefix import attention_kinds, shared_prefix_inputs

DEVICES = ["cpu", "tpu"]
_FROM_KEY = "rl_tpu_logits_from"
_KEEP_KEY = "rl_tpu_logits_keep"
_CHUNK_KEY = "rl_tpu_logits_chunk"


class _JobSettingsHere:
    """Engine mixin: the engine's initialisation is where the engine reads the job's settings record, once
    (:func:`verl_backend.settings.current`), and keeps its section as ``self.rl_tpu``
    (:class:`verl_backend.settings.EngineSettings`), before the module is built; everything below reads that. It sets
    the worker's torch thread count (``rl_tpu.num_threads``) there too.

    Raises:
        verl_backend.settings.SettingsMissingError: this process was not started by a ``verl train`` job.
    """

    rl_tpu: EngineSettings = EngineSettings()  # the defaults until initialize (an engine built without it: tests)

    def initialize(self):
        self.rl_tpu = engine_settings(current())  # the one read of the job's record in a trainer engine
        if self.rl_tpu.num_threads:  # torch's count in this worker process: from the record, no variable
            from rl_tpu.device import set_num_threads

            set_num_threads(self.rl_tpu.num_threads)
        return super().initialize()


class _DefaultModelHere:
    """Engine mixin: the job's default model is converted on this host before the module is built from it, if this
    host lacks it (:func:`verl_backend.models.convert_default_model_here`). The critic's model config is resolved
    in the TaskRunner and reaches its worker pickled, so no ``copy_to_local`` (where the other readers convert it)
    runs on the critic's host."""

    def _build_module(self):
        from verl_backend.models import convert_default_model_here

        convert_default_model_here(self.model_config.local_path)
        return super()._build_module()


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithLMHead(
    _JobSettingsHere, _DefaultModelHere, SingleRankPlainModule, HFConfigDtypeOnSave, FSDPEngineWithLMHead
):
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
      holds that prompt once (:func:`verl_backend.workers.shared_prefix.shared_prefix_inputs`, with sliding windows
      where the model has them; ``actor.use_prefix_grouper=false`` turns it off).
    - padded (``use_remove_padding=False``): the kept logits are the last ``seq_len - first`` positions
      (:func:`first_response_logit_position`).

    Σπ², distillation, fused kernels, Ulysses sequence parallel and a static packed length keep VeRL's own path,
    as does ``rl_tpu.response_only_logits=false``.

    On CPU, a training engine (not the reference policy) also hands the heap pages its activations free back to the
    OS after each transformer block's backward (:class:`verl_backend.host_memory.heap.BackwardHeapTrim`,
    ``backward_trim``), which lowers the update's peak host memory; ``rl_tpu.trim_backward=false`` turns it off.
    """

    def initialize(self):
        super().initialize()
        self.shared_weights = None
        reason = self._shared_weights_blocker()
        if reason is None:
            from rl_tpu.shared_weights import SharedWeightsError

            try:
                self.shared_weights = share_fsdp_parameters(self.module)
            except (SharedWeightsError, OSError) as exc:
                reason = str(exc)
            else:
                weight_sync.hand_over(self.shared_weights)  # to this worker's rollout adapter
        self._shared_weights_reason = reason
        self.compiled_blocks = None
        if self.rl_tpu.compile_trainer:  # the driver refused packed micro batches (rl_tpu.compiled_blocks.refusal)
            from verl.utils.device import get_device_name

            from rl_tpu.compiled_blocks import CompiledBlocks
            from rl_tpu.sampler.compiled import compile_backend_for

            from verl_backend.tpu_on_cpu import compile_backend

            # the backend of the worker's platform (its parameters may be offloaded to the host), or tpu-on-cpu
            region = "reference.block" if self.engine_config.forward_only else "actor.block"
            backend = compile_backend(
                self.rl_tpu.compile_backend, region, self.rl_tpu.compile_cache_dir
            ) or compile_backend_for(get_device_name())
            self.compiled_blocks = CompiledBlocks(self.module, backend, say=lambda line: print(line, flush=True))
            print(
                f"[rl-tpu] compiled trainer blocks: {self.compiled_blocks.blocks} blocks of the "
                f"{'reference policy' if self.engine_config.forward_only else 'actor'} compile per input shape "
                "(rl_tpu.compile_trainer)",
                flush=True,
            )
        inner = unwrap_fsdp(self.module)
        if (
            not self.engine_config.forward_only
            and callable(getattr(inner, "get_output_embeddings", None))
            and inner.get_output_embeddings() is not None
        ):  # the actor (a critic's value head is no LM head)
            from verl_backend.weight_sync.verify import register_trainer_module

            # every sync verified: this process's rollout adapter scores a probe on the actor's module
            register_trainer_module(
                self.module, probe_context=self.compiled_blocks.eager if self.compiled_blocks is not None else None
            )
        self.backward_trim = None
        if next(self.module.parameters()).device.type == "cpu":
            from verl_backend.host_memory.heap import BackwardHeapTrim, freeze_long_lived_objects

            if not self.engine_config.forward_only and self.rl_tpu.trim_backward:
                self.backward_trim = BackwardHeapTrim(self.module)  # peak host memory of the update
                print(
                    f"[rl-tpu] actor backward: heap pages handed back after each of {self.backward_trim.blocks} "
                    "blocks (rl_tpu.trim_backward=false turns it off)",
                    flush=True,
                )
            freeze_long_lived_objects()  # VeRL's empty_cache collects garbage several times a step

    def _shared_weights_blocker(self) -> str | None:
        """Why this engine's parameters stay in private memory (``None``: they move into shared memory)."""
        if not self.rl_tpu.shared_weights:
            return "rl_tpu.shared_weights=false"
        if self.engine_config.forward_only:
            return "a forward-only engine (reference policy) sends no weights"
        if next(self.module.parameters()).device.type != "cpu":
            return "parameters on an accelerator"
        if torch.distributed.get_world_size() != 1:
            return "FSDP shards the parameters over several ranks: the rollout needs whole tensors"
        state = engine_state(self)  # VeRL's private flags (verl_backend.patches.verl_internals)
        if state.lora or state.qat or state.offload_param:
            return "LoRA, QAT or parameter offload sends transformed weights"
        return None

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """VeRL's weight export; with the parameters in shared memory, each yields its own storage (one rank
        holds whole tensors, so ``full_tensor()``'s copy is skipped) and the rollout adapter finds it already in
        place. With LoRA: the adapter only (:func:`verl_backend.weight_sync.lora.lora_adapter_payload`: A, B and scaling
        per adapted matrix under self-describing names), whatever ``model.lora.merge`` says; the rollout merges it onto
        the base weights it loaded from the model path (:func:`verl_backend.weight_sync.lora.received_stream`).

        VeRL's own protocol (a ``peft_config`` returned, ``base_sync_done``) is not used: its checkpoint-engine path
        (``update_weights`` with any backend but ``naive``) calls this with ``base_sync_done=False`` every sync and
        drops the ``peft_config``, so it would send the whole base each time; and a peft config makes VeRL's naive
        path set vLLM/SGLang adapter state. The payload's names carry all the receiver needs on every transport,
        and the rollout never starts from dummy weights (it loads the model path), so no base sync is needed."""
        if engine_state(self).lora:
            from verl_backend.weight_sync.lora import lora_adapter_payload

            return lora_adapter_payload(self.module), None
        if self.shared_weights is None:
            return super().get_per_tensor_param(layered_summon=layered_summon, base_sync_done=base_sync_done, **kwargs)
        from torch.distributed.tensor import DTensor
        from verl.utils.model import convert_weight_keys

        params = convert_weight_keys(self.module.state_dict(), unwrap_fsdp(self.module))
        return ((n, p.to_local() if isinstance(p, DTensor) else p) for n, p in params.items()), None

    def _response_only_applies(self, micro_batch: TensorDict) -> bool:
        get = tu.get_non_tensor_data
        if not self.rl_tpu.response_only_logits:
            return False
        if get(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
            return False
        for key in ("use_fused_kernels", "calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"):
            if get(data=micro_batch, key=key, default=False):
                return False
        if not hasattr(self, "_accepts_logits_to_keep"):
            # a peft model's forward takes **kwargs and hands them to the model it wraps (LoRA): ask that model
            inner = self._base_model()
            forward = getattr(inner, "forward", None)
            try:
                self._accepts_logits_to_keep = (
                    forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
                )
            except (TypeError, ValueError):
                self._accepts_logits_to_keep = False
        return self._accepts_logits_to_keep

    def _shared_prefix_kinds(self):
        """The model's masking for the shared-prefix row (:func:`verl_backend.workers.shared_prefix.attention_kinds`),
        read once; ``None`` (and one line saying why) when the row cannot compute the model's own numbers."""
        if not hasattr(self, "_prefix_kinds"):
            kinds = attention_kinds(self.module)
            if isinstance(kinds, str):
                print(
                    f"[rl-tpu] shared-prefix forward off for this model ({kinds}): each sequence keeps its own "
                    "copy of its prompt",
                    flush=True,
                )
                kinds = None
            self._prefix_kinds = kinds
        return self._prefix_kinds

    def _base_model(self) -> torch.nn.Module:
        """The model the engine trains: a peft model's base model (LoRA), else the module itself."""
        return self.module.get_base_model() if hasattr(self.module, "get_base_model") else self.module

    def _chunked_head(self) -> HeadPassThrough | None:
        """The LM head to pass through for the chunked log-probs (``rl_tpu.logits_chunk_mib``), or ``None`` (one
        line says why, once): only on one unwrapped CPU rank, eager, where :meth:`HeadPassThrough.exact_for` shows
        the model's logits are its head's plain linear map."""
        if not hasattr(self, "_head_passthrough"):
            self._head_passthrough, reason = None, None
            inner = self._base_model()
            head = inner.get_output_embeddings() if callable(getattr(inner, "get_output_embeddings", None)) else None
            if head is None:
                reason = "the model has no output embeddings"
            elif torch.distributed.get_world_size() != 1 or unwrap_fsdp(self.module) is not self.module:
                reason = "FSDP2 shards the head's weight over ranks"
            elif getattr(self, "compiled_blocks", None) is not None:
                reason = "compiled trainer blocks (rl_tpu.compile_trainer)"
            elif head.weight.device.type != "cpu":
                reason = f"the head is on {head.weight.device.type}"
            else:
                candidate = HeadPassThrough(head)
                reason = candidate.exact_for(self.module, inner.config.vocab_size)
                if reason is None:
                    self._head_passthrough = candidate
            if reason is not None:
                print(
                    f"[rl-tpu] chunked LM head off ({reason}): the response logits are computed all at once",
                    flush=True,
                )
        return self._head_passthrough

    def _use_chunked_head(self, tokens: int, temperature: torch.Tensor) -> HeadPassThrough | None:
        """The head to pass through when ``tokens`` response logits would take more than ``rl_tpu.logits_chunk_mib``
        MiB in fp32 and every kept position has one temperature; else ``None``."""
        chunk_mib = self.rl_tpu.logits_chunk_mib
        if chunk_mib <= 0 or temperature.numel() == 0 or not bool((temperature == temperature[0]).all()):
            return None
        inner = self._base_model()
        vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
        if not vocab or tokens * vocab * 4 <= chunk_mib << 20:
            return None
        return self._chunked_head()

    def _mask_dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def prepare_model_inputs(self, micro_batch: TensorDict):
        if getattr(self, "_head_passthrough", None) is not None:
            self._head_passthrough.clear()  # one a failed forward may have left armed
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if getattr(self, "compiled_blocks", None) is not None and not tu.get_non_tensor_data(
            data=micro_batch, key="use_remove_padding", default=True
        ):
            from rl_tpu.compiled_blocks import pad_to_bucket

            pad_to_bucket(  # static shapes: a graph per bucket, not per length
                model_inputs, tu.get_non_tensor_data(data=micro_batch, key="pad_token_id", default=0)
            )
        if not (self._response_only_applies(micro_batch) and "input_ids" in model_inputs):
            return model_inputs, output_args
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            if getattr(self, "use_ulysses_sp", False) or output_args.get("pad_size", 0):
                return model_inputs, output_args  # sliced or padded packed rows: VeRL's own path
            keep = response_logit_indices(micro_batch)
            if keep is not None and keep.numel() > 0:
                device = model_inputs["input_ids"].device
                kinds = self._shared_prefix_kinds() if self.rl_tpu.shared_prefix else None
                shared = shared_prefix_inputs(micro_batch, kinds, self._mask_dtype()) if kinds is not None else None
                if shared is not None:  # one copy of each prompt, its samples' responses all attend to it
                    row_inputs, row_keep = shared
                    if not getattr(self, "_reported_shared_prefix", False):
                        self._reported_shared_prefix = True
                        print(
                            f"[rl-tpu] shared-prefix forward: a micro batch of {micro_batch.batch_size[0]} "
                            f"sequences packs to {row_inputs['input_ids'].shape[1]} tokens instead of "
                            f"{model_inputs['input_ids'].shape[1]}",
                            flush=True,
                        )
                    mask = row_inputs.pop("attention_mask")
                    model_inputs.update({k: v.to(device) for k, v in row_inputs.items()})
                    model_inputs["attention_mask"] = (
                        {k: m.to(device) for k, m in mask.items()} if isinstance(mask, dict) else mask.to(device)
                    )
                    model_inputs["logits_to_keep"] = row_keep.to(device)
                else:
                    model_inputs["logits_to_keep"] = keep.to(device)
                output_args[_KEEP_KEY] = keep.to(device)  # the same positions in VeRL's packed layout
                temperature = output_args["temperature_rmpad"][keep]
                passthrough = self._use_chunked_head(int(keep.numel()), temperature)
                if passthrough is not None:  # the model returns the head's inputs; the head runs in chunks
                    passthrough.arm()
                    output_args[_CHUNK_KEY] = float(temperature[0])
                    if not getattr(self, "_reported_chunked_head", False):
                        self._reported_chunked_head = True
                        vocab = passthrough.head.weight.shape[0]
                        print(
                            f"[rl-tpu] chunked LM head: {keep.numel()} response tokens x {vocab} vocab in chunks of "
                            f"{logits_chunk_tokens(vocab, self.rl_tpu.logits_chunk_mib)} tokens "
                            f"(rl_tpu.logits_chunk_mib={self.rl_tpu.logits_chunk_mib})",
                            flush=True,
                        )
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
        if keep is not None and _CHUNK_KEY in output_args:
            head = self._head_passthrough.head
            return chunked_response_log_probs(
                output.logits,
                head.weight,
                output_args["input_ids_rmpad_rolled"],
                output_args[_CHUNK_KEY],
                keep,
                micro_batch["input_ids"].offsets(),
                logits_chunk_tokens(head.weight.shape[0], self.rl_tpu.logits_chunk_mib),
                entropy=bool(entropy),
            )
        if keep is not None:
            return packed_response_log_probs(
                output.logits,
                output_args["input_ids_rmpad_rolled"],
                output_args["temperature_rmpad"],
                keep,
                micro_batch["input_ids"].offsets(),
                entropy=entropy,
            )
        return response_log_probs(
            output.logits, micro_batch["input_ids"], first, output_args["temperature"], entropy=entropy
        )


def share_fsdp_parameters(module: torch.nn.Module, name: str = "rl_tpu_actor"):
    """Move an FSDP2 module's parameter storage into one shared-memory file, in place (one rank: whole tensors).

    An unwrapped module (one CPU rank, :class:`~verl_backend.host_memory.plain_module.SingleRankPlainModule`) gets
    the same: each parameter's ``.data`` becomes its view of the file.

    Every ``FSDPParam``'s sharded storage (what the optimizer updates and the all-gather reads; FSDP2's private
    names, read only through :mod:`verl_backend.patches.fsdp2_internals`) becomes a view of the file, so a reader that
    maps it (the rollout server, :class:`rl_tpu.shared_weights.SharedWeightsReader`) sees each optimizer step with no
    copy. The ``Parameter`` objects stay the same (the optimizer's references remain valid); FSDP2's lazy init keeps the
    storage since it is already padded (``FSDPParam.reset_sharded_param``, torch 2.13). Slot names are the
    state-dict keys after VeRL's ``convert_weight_keys`` (the names ``get_per_tensor_param`` yields, i.e. the
    rollout model's); tied weights share a slot.

    Raises:
        rl_tpu.shared_weights.SharedWeightsError: a parameter that is sharded (more than one rank), padded, or not
            on the CPU; any state-dict tensor FSDP does not manage; a torch whose FSDP2 internals were not checked.
    """
    from torch.distributed.tensor import DTensor
    from verl.utils.model import convert_weight_keys

    from rl_tpu.shared_weights import SharedWeights, SharedWeightsError
    from verl_backend.patches import fsdp2_internals as fsdp2

    by_param = fsdp2.fsdp_params(module)
    named = convert_weight_keys(module.state_dict(keep_vars=True), unwrap_fsdp(module))
    if not by_param:  # an unwrapped module (SingleRankPlainModule): each tensor's .data moves into the file
        return SharedWeights.from_named_tensors(named, name=name)
    groups: dict[int, tuple[list[str], object]] = {}
    for key, param in named.items():
        fp = by_param.get(id(param))
        if fp is None or not isinstance(param, DTensor):
            raise SharedWeightsError(
                f"{key!r} is not an FSDP2 parameter: shared-memory weights need every tensor of "
                "the actor's state_dict managed by fully_shard"
            )
        if not fsdp2.is_whole(fp):
            whole, local = fsdp2.shapes(fp)
            raise SharedWeightsError(
                f"{key!r} is sharded or padded ({whole} -> {local}): shared-memory weights need one rank"
            )
        groups.setdefault(id(fp), ([], fp))[0].append(key)

    def rebind_to(fp):
        return lambda _old, view: fsdp2.rebind(fp, view)  # view: (orig shape) in the file

    entries = [(names, fsdp2.local_storage(fp), rebind_to(fp)) for names, fp in groups.values()]
    return SharedWeights.from_tensors(entries, name=name)


@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=DEVICES)
class RlTpuFSDPEngineWithValueHead(
    _JobSettingsHere, _DefaultModelHere, SingleRankPlainModule, HFConfigDtypeOnSave, FSDPEngineWithValueHead
):
    """FSDP2 critic engine on CPU (gloo) or TPU (TorchTPU); unwrapped on one CPU rank."""
