"""Compiled transformer blocks for the trainer: each decoder block's forward as a ``torch.compile`` graph.

On TPU every eager op is a dispatch (TorchTPU's strict eager mode); a compiled block is one launch. The trainer's
model is compiled per block rather than whole: FSDP2 gathers and frees each block's parameters in forward hooks
around the block, which stay outside the graph here, since only the block's ``forward`` method is compiled (as
torchtitan compiles per ``TransformerBlock``). Blocks of one class share their graphs: their parameters are graph
inputs (dynamo's ``inline_inbuilt_nn_modules``, on by default since torch 2.5), so a 28-block model compiles one
forward (and one backward) graph per input shape, not 28. (Measured with torch 2.13 and ``aot_eager``: dynamo's
``unique_graphs`` counter reads 3 after one forward and backward of a 3-block Llama, and of a Qwen3-MoE with a dense
first block: one graph per block, whatever the kind; not investigated further here.) ``verl train --aot-only`` lists
one graph per kind of block (:func:`verl_backend.driver.aot.lower.block_kinds`).

Shapes must be static for the graphs to be bounded. VeRL's padded micro batches (the TPU profile's
``use_remove_padding=false``) are padded to their own longest sequence, a new length almost every micro batch;
:func:`pad_to_bucket` pads them on to a power of two, so a run compiles a graph per bucket and micro-batch size
for the update, and as many for the log-prob forward (no grad). Packed micro batches (remove-padding) are one row
whose length changes every step: :func:`refusal` says so before a run starts.

What cannot compile runs eagerly, said in one line: block inputs whose graph does not compile (``fullgraph=True``:
a graph break is an error; dynamo's and the backend's errors), and new input signatures past ``max_graphs`` (a shape
that changes from call to call). Signatures already compiled keep their graphs, so a forward and its recomputation
under gradient checkpointing (VeRL's default off the CPU) always take the same path; either path computes the
model's numbers. Other exceptions pass through untouched: gradient checkpointing stops a block's recomputation by
raising through it. AOT autograd compiles a backward when it first runs, inside ``loss.backward()``: a backend
failure there is an error of the step, not a fallback.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

import torch

from rl_tpu.patches import torch_internals  # Dynamo, pytree, FSDP1: torch's private names, version-checked
from rl_tpu.patches import transformers_internals  # a model's block classes

#: distinct block input signatures (shapes, dtypes, grad mode) compiled before falling back to eager: bucketed
#: lengths (:func:`bucket_length`) x micro-batch sizes x {update, no-grad forward}
MAX_GRAPHS = 16
#: dynamo's recompile limits while a block runs (its default, 8 per code object, counts every model in the process
#: that shares the block class: actor and reference policy); :data:`MAX_GRAPHS` bounds each model
RECOMPILE_LIMIT = 256
#: the shortest bucket of :func:`pad_to_bucket` (tokens)
MIN_BUCKET = 64


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: modules whose class (or a base class, as FSDP2 renames it) is named in the
    model's ``_no_split_modules`` (the unit Hugging Face and FSDP wrap). ``[]`` when the model names none."""
    names = transformers_internals.no_split_modules(torch_internals.unwrap_fsdp(model))
    return [m for m in model.modules() if names.intersection(c.__name__ for c in type(m).__mro__)]


def _signature(args, kwargs) -> tuple:
    leaves = torch_internals.tree_leaves((args, kwargs))
    return (torch.is_grad_enabled(),) + tuple(
        (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves
    )


def _first_line(exc: Exception) -> str:
    """``Type: message`` of ``exc`` in one line; for dynamo's ``backend='...' raised:`` wrapper, the cause's line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith("raised:"):
        lines = lines[1:]
    return f"{type(exc).__name__}: {lines[0][:240] if lines else ''}"


class CompiledBlocks:
    """Compile every decoder block's ``forward`` of ``model`` in place (``torch.compile(fullgraph=True,
    dynamic=False)``), counting distinct input signatures as graphs.

    Args:
        model: a Hugging Face causal LM, plain or FSDP2-wrapped.
        backend: the ``torch.compile`` backend (``"tpu"`` on TPU, ``"inductor"`` on CPU and CUDA; ``"aot_eager"``
            traces without code generation).
        max_graphs: signatures allowed before falling back to eager (:data:`MAX_GRAPHS`).
        say: where the one-line notices go (default: stderr).

    Attributes:
        blocks: number of blocks compiled (0: the model names no block class; nothing is done).
        signatures: the distinct ``(grad mode, shapes, dtypes)`` the compiled blocks have run on.
        eager_reason: why some block inputs run eagerly (``None`` while every one ran compiled).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: str,
        *,
        max_graphs: int = MAX_GRAPHS,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.backend = backend
        self.max_graphs = max_graphs
        self.signatures: set[tuple] = set()
        self._eager_signatures: set[tuple] = set()
        self.eager_reason: str | None = None
        self._eager_depth = threading.local()
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._name = type(torch_internals.unwrap_fsdp(model)).__name__
        self._blocks = decoder_blocks(model)
        for block in self._blocks:
            eager = block.forward
            compiled = torch.compile(eager, backend=backend, fullgraph=True, dynamic=False)
            block.forward = self._wrap(eager, compiled)
        self.blocks = len(self._blocks)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run every block eagerly inside the ``with`` (this thread), compiling nothing and counting no signature: for
        a forward outside training whose shape no step has (the weight-sync probe,
        :mod:`verl_backend.weight_sync.verify`), so it neither costs a graph nor counts against ``max_graphs``."""
        self._eager_depth.depth = getattr(self._eager_depth, "depth", 0) + 1
        try:
            yield
        finally:
            self._eager_depth.depth -= 1

    def _wrap(self, eager: Callable, compiled: Callable) -> Callable:
        def forward(*args, **kwargs):
            if getattr(self._eager_depth, "depth", 0):
                return eager(*args, **kwargs)
            sig = _signature(args, kwargs)
            if sig in self._eager_signatures:
                return eager(*args, **kwargs)
            if sig not in self.signatures:
                if len(self.signatures) >= self.max_graphs:
                    self.fall_back(
                        sig,
                        f"more than {self.max_graphs} distinct block input shapes (the micro batches' "
                        "shape changes from call to call: pad them to one length)",
                    )
                    return eager(*args, **kwargs)
                self.signatures.add(sig)
                hidden = next(
                    (x for x in torch_internals.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None
                )
                self._say(
                    f"[rl-tpu] compiled trainer blocks: graph {len(self.signatures)} of at most "
                    f"{self.max_graphs} ({'update' if sig[0] else 'no-grad forward'}, block input "
                    f"{tuple(hidden.shape) if hidden is not None else ()}, backend {self.backend})"
                )
            try:
                with torch_internals.recompile_limits(RECOMPILE_LIMIT):
                    return compiled(*args, **kwargs)
            except torch_internals.dynamo_errors()[0]:  # RecompileError
                raise  # config.error_on_recompile (set_stance("fail_on_recompile") raises a RuntimeError: not caught)
            except torch_internals.dynamo_errors()[1:] as exc:  # TorchDynamoException, FailOnRecompileLimitHit
                self.signatures.discard(sig)
                self.fall_back(sig, _first_line(exc))  # a graph break (fullgraph), a backend failure: nothing ran
                return eager(*args, **kwargs)

        return forward

    def fall_back(self, sig: tuple, reason: str) -> None:
        """Run block inputs of signature ``sig`` eagerly from now on, saying why in one line (the first time).

        Signatures already compiled keep their graphs: a step whose blocks ran compiled recomputes them compiled
        under gradient checkpointing, so forward and recomputation always take the same path."""
        self._eager_signatures.add(sig)
        if self.eager_reason is None:
            self.eager_reason = reason
            self._say(
                f"[rl-tpu] compiled trainer blocks: {self._name} runs eagerly for block inputs it cannot "
                f"compile ({reason})"
            )

    @property
    def graphs(self) -> int:
        """Distinct block input signatures compiled so far (dynamo may still compile more than one graph for one
        signature, e.g. on a guard over a non-tensor input; the sampler-style fail_on_recompile tests check that)."""
        return len(self.signatures)


def bucket_length(length: int, smallest: int = MIN_BUCKET) -> int:
    """The static length a padded micro batch of ``length`` tokens is padded to: the next power of two, at least
    ``smallest`` (so a run's lengths up to ``L`` make at most ``log2(L / smallest) + 1`` shapes)."""
    return max(smallest, 1 << max(0, int(length) - 1).bit_length())


def pad_to_bucket(model_inputs: dict, pad_token_id: int, smallest: int = MIN_BUCKET) -> dict:
    """Right-pad a padded micro batch to :func:`bucket_length` of its length, in place, and return it.

    VeRL 0.9.1's padded layout (``use_remove_padding=false``) pads each micro batch to its own longest sequence,
    a new shape nearly every micro batch; padded to a bucket, a run has a handful. The extra positions are padding
    (attention mask 0, after every real token), so causal attention keeps the real positions' outputs, and VeRL
    reads each sequence's first ``length`` positions back (``torch.nested.narrow``).

    Args:
        model_inputs: ``input_ids`` ``(batch, seq)`` int64, ``attention_mask`` ``(batch, seq)``, ``position_ids``
            ``(batch, seq)`` int64 (a 3-D multimodal ``position_ids`` is left as it is, and so is the batch).
        pad_token_id: the token the extra positions hold.
    """
    ids, pos = model_inputs.get("input_ids"), model_inputs.get("position_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or (pos is not None and pos.dim() != 2):
        return model_inputs
    extra = bucket_length(ids.shape[1], smallest) - ids.shape[1]
    if extra <= 0:
        return model_inputs
    pad = torch.nn.functional.pad
    model_inputs["input_ids"] = pad(ids, (0, extra), value=pad_token_id)
    if pos is not None:
        model_inputs["position_ids"] = pad(pos, (0, extra), value=0)
    mask = model_inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        model_inputs["attention_mask"] = pad(mask, (0, extra), value=0)
    return model_inputs


def refusal(
    remove_padding: bool, backend: str = "cpu", key: str = "actor_rollout_ref.model.use_remove_padding"
) -> str | None:
    """Why the trainer's blocks cannot be compiled with bounded graphs, or ``None``.

    Args:
        remove_padding: the micro batches are packed (their length changes every step).
        backend: ``verl train --backend``; rl-tpu's engine (which compiles) runs on ``cpu`` and ``tpu`` only.
        key: the config key that sets packing, named in the message.
    """
    if backend not in ("cpu", "tpu"):
        return (
            f"rl_tpu.compile_trainer applies to --backend cpu and tpu (rl-tpu's engine); on --backend {backend} "
            "VeRL's own engine runs: use its actor_rollout_ref.actor.use_torch_compile instead"
        )
    if remove_padding:
        return (
            f"rl_tpu.compile_trainer needs padded micro batches of one shape, but {key}=true packs them into rows "
            f"whose length changes every step (a compile per step): set {key}=false (the TPU profile's default)"
        )
    return None
