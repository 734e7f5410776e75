"""Engine mixin for one CPU rank: the model trained unwrapped, without FSDP2 (:class:`SingleRankPlainModule`)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from verl_backend.patches.verl_internals import engine_state, set_unwrapped_precision
from verl_backend.settings import EngineSettings


class SingleRankPlainModule:
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
    rl_tpu: EngineSettings = EngineSettings()  # the engine's section, set by its initialisation (workers.engine)

    def _plain_module_blocker(self, module: torch.nn.Module) -> str | None:
        from verl.utils.torch_dtypes import PrecisionType

        config = self.engine_config
        if not self.rl_tpu.plain_module:  # the engine's section (verl_backend.workers.engine._JobSettingsHere)
            return "rl_tpu.plain_module=false"
        if config.strategy != "fsdp2":
            return f"strategy {config.strategy}"
        if torch.distributed.get_world_size() != 1:
            return "several ranks: FSDP2 shards the parameters over them"
        if getattr(self.device_mesh, "device_type", None) != "cpu":
            return "an accelerator mesh"
        state = engine_state(self)  # VeRL's private flags (verl_backend.patches.verl_internals)
        if (
            state.lora
            or state.qat
            or state.offload_param
            or state.offload_optimizer
            or config.offload_policy
            or self.model_config.enable_activation_offload
            or self.ulysses_sequence_parallel_size > 1
        ):
            return "LoRA, QAT, offload or sequence parallelism"
        mp = config.mixed_precision or {}
        stored = {p.dtype for p in module.parameters()}
        wanted = {
            PrecisionType.to_dtype(mp.get("param_dtype", "bf16")),
            PrecisionType.to_dtype(mp.get("reduce_dtype", "fp32")),
        }
        if len(stored) != 1 or stored != wanted:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in stored))
            return f"weights stored in {names}, computed in mixed precision: FSDP2 casts them layer by layer"
        return None

    def _build_fsdp_module(self, module):
        from verl_backend.settings import RECORD_ENV, digest

        self.plain_module_reason = self._plain_module_blocker(module)
        role = (
            "reference policy"
            if self.engine_config.forward_only
            else "critic"
            if self.model_config.model_type == "value_model"
            else "actor"
        )
        if torch.distributed.get_rank() == 0:  # which settings record this worker runs on (one line per engine)
            print(f"[rl-tpu] {role}: settings record {digest(os.environ[RECORD_ENV])}", flush=True)
        if self.plain_module_reason is not None:
            if torch.distributed.get_rank() == 0:
                print(f"[rl-tpu] {role}: FSDP2 wraps the model ({self.plain_module_reason})", flush=True)
            return super()._build_fsdp_module(module)
        set_unwrapped_precision(self, next(module.parameters()).dtype)  # float32: VeRL's forward skips autocast
        print(
            f"[rl-tpu] {role}: one CPU rank, so the model runs unwrapped, without FSDP2's parameter and "
            f"gradient copies (rl_tpu.plain_module=false wraps it)",
            flush=True,
        )
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

            how = (
                "run with rl_tpu.plain_module=false to resume it (its tensors are FSDP2 DTensors)"
                if saved == 2
                else "run on one CPU rank with rl_tpu.plain_module=true to resume it (its tensors are plain)"
            )
            exc = BadInputError(
                f"checkpoint {local_path}: saved by an engine {'with' if saved else 'without'} FSDP2, "
                f"and this one trains {'without' if saved else 'with'} it; {how}, or start over with "
                "trainer.resume_mode=disable"
            )
            record_bad_input(exc)
            raise exc
        return super().load_checkpoint(
            local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load, **kwargs
        )


def _saved_fsdp_version(local_path) -> int | None:
    """``FSDP_version`` in a VeRL checkpoint's ``fsdp_config.json`` (0: an unwrapped module), or ``None``."""
    try:
        return int(json.loads((Path(local_path) / "fsdp_config.json").read_text())["FSDP_version"])
    except (OSError, TypeError, ValueError, KeyError):
        return None
