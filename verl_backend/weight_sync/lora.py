"""LoRA weight sync for the native rollout: the merged model's weights, one tensor at a time, in the trainer's dtype.

The native rollout has no adapter slots: it samples on the merged model ``W + (alpha / r) * B @ A`` (peft's
``get_delta_weight``), under the base model's Hugging Face names. VeRL 0.9.1's own merged export
(``FSDPEngine._merged_lora_per_tensor_param``) merges the adapters into the trainer's module in place, backs the base
weights up and restores them, and casts every sharded tensor to bfloat16 on the way out: a float32 rollout then
samples on other numbers than the trainer computes (``rollout_corr/kl`` 5e-4 on a tiny Llama at step 1, where the
adapter is still zero). :func:`merged_lora_weights` leaves the module untouched, computes each merged tensor on its
own and keeps its dtype, so the rollout's log-probs are the trainer's.

**Adapter-only sync** (what the engine sends, :func:`lora_adapter_payload`): per adapted matrix its ``A``, ``B`` and
scaling as named tensors (:func:`payload_names`), ~19.5 MB for SmolLM2-135M at rank 16 against 538 MB merged. The
rollout turns that stream back into merged ``(Hugging Face name, tensor)`` pairs with :class:`AdapterMerger`, onto the
base weights ``W0`` read from the model's own safetensors (the files the trainer and the rollout were loaded from; the
base is frozen under LoRA), mapped read-only, so the merge holds no anonymous copy of the base. Both sides compute the
merge with one function (:func:`lora_delta`), in the same order and dtypes: the receiver's tensors are bitwise the
trainer-side merge's.

Why merged into the rollout's own weights, not an unmerged LoRA forward in the sampler: the sampler's fast paths pack
each weight matrix (oneDNN packed copies, fused/packed projections, compiled graphs with the weights as arguments);
an unmerged forward would add two skinny matmuls per adapted matrix per decode step to every one of those paths, and a
step's weight traffic is what bounds decode on CPU. The merge costs one pass over the adapted matrices per sync (the
same work the trainer-side merge did), and the rollout keeps sampling on plain weights. Measured
(``benchmarks/bench_lora_forward.py``, SmolLM2-135M, rank 16): the merge 0.66 s a sync, the unmerged forward's
generation 1.41x the merged one's at its best case.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rl_tpu.patches.torch_internals import unwrap_fsdp  # FSDP1's private wrapper attribute


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a parameter (``DTensor``: gathered; on one rank its local tensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, transpose: bool) -> torch.Tensor:
    """``scaling * B @ A`` in the base weight's layout (``transpose``: ``(B @ A).T``, Embedding and fan-in-fan-out
    Linear), one new tensor. The one definition both the trainer-side merge and the rollout's
    :class:`AdapterMerger` call, so the two are bitwise equal."""
    delta = b @ a  # (out, in); scaled in place: one new tensor per adapted matrix
    return (delta.T.contiguous() if transpose else delta).mul_(scaling)


def _adapter_parts(layer, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """``(A, B, scaling, transpose)`` of ``layer``'s ``adapter``, whole tensors (peft's ``get_delta_weight``).

    Raises:
        ValueError: a layer kind other than peft's LoRA Linear or Embedding (e.g. a ``ParamWrapper`` on fused MoE
            experts, a Conv): its merge is not ``scaling * B @ A`` in the base weight's layout.
    """
    from peft.tuners.lora import Embedding, Linear

    if isinstance(layer, Linear):
        a, b = _full(layer.lora_A[adapter].weight), _full(layer.lora_B[adapter].weight)  # (r, in), (out, r)
        return a, b, layer.scaling[adapter], bool(layer.fan_in_fan_out)
    if isinstance(layer, Embedding):
        a, b = _full(layer.lora_embedding_A[adapter]), _full(layer.lora_embedding_B[adapter])  # (r, vocab), (dim, r)
        return a, b, layer.scaling[adapter], True  # (vocab, dim)
    raise ValueError(
        f"LoRA on a {type(layer).__name__} layer: the native rollout merges Linear and Embedding "
        "adapters only; leave this module out of actor_rollout_ref.model.target_modules"
    )


def _delta(layer, adapter: str) -> torch.Tensor:
    """``scaling * B @ A`` of ``layer``'s ``adapter`` in the base weight's layout (peft's ``get_delta_weight``, on
    whole tensors)."""
    a, b, scaling, transpose = _adapter_parts(layer, adapter)
    return lora_delta(a, b, scaling, transpose)


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
        ValueError: an adapter on a layer kind other than Linear or Embedding (e.g. peft's ``ParamWrapper`` on fused
            MoE experts or a router, which ``all-linear`` adapts on Qwen3-MoE), or DoRA (``use_dora``), whose merge
            is not a sum.
    """
    from peft.tuners.lora import LoraLayer
    from verl.utils.model import convert_weight_keys

    from peft.tuners.lora import Embedding, Linear

    peft_model = unwrap_fsdp(module)
    layers = {}  # base_layer weight's state-dict name -> LoRA layer
    for name, m in peft_model.named_modules():
        if isinstance(m, LoraLayer):
            if any(m.use_dora.get(a, False) for a in m.active_adapters):
                raise ValueError(f"{name}: DoRA adapters (use_dora) are not merged by the native rollout's sync")
            if not isinstance(m, (Linear, Embedding)) and not m.disable_adapters:
                # e.g. peft's ParamWrapper on fused MoE experts (whose weights are not named ``base_layer.weight``:
                # their adapter would otherwise be left out without a word)
                _adapter_parts(m, m.active_adapters[0])  # raises, naming the layer kind
            layers[f"{name}.base_layer.weight"] = m
    state = peft_model.state_dict()
    names = {}  # state-dict name -> Hugging Face name
    for name in state:
        if "lora_" in name or ".adapter_" in name:
            continue
        names[name] = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
    hf_names = convert_weight_keys(
        {hf: None for hf in names.values()},
        peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model,
    )
    for (name, _), hf in zip(names.items(), hf_names):
        tensor = _full(state[name]).detach()
        layer = layers.get(name)
        if layer is not None and not layer.merged and not layer.disable_adapters:
            for adapter in layer.active_adapters:
                if adapter in layer.scaling:
                    # into the fresh delta, in place: W + delta without a third copy (and W is never written)
                    tensor = _delta(layer, adapter).to(tensor.dtype).add_(tensor)
        yield hf, tensor


# ------------------------------------------------------------------------------------------ adapter-only sync
PAYLOAD_MARK = "@lora_"  # never in a Hugging Face weight name
_LAYOUTS = {False: "BA", True: "BA_T"}


def payload_names(hf_name: str, base_dtype: torch.dtype, transpose: bool) -> tuple[str, str, str]:
    """The three payload names of the adapted base weight ``hf_name``: ``{hf}@lora_A``, ``{hf}@lora_B`` and
    ``{hf}@lora_scaling/{base dtype}/{BA|BA_T}``. The scaling travels as a float64 tensor of one element (any
    named-tensor transport carries it, and ``.item()`` gives back the trainer's Python float exactly); the base
    weight's dtype in the trainer (which the merge is computed in) and the layout of ``B @ A`` travel in its name."""
    return (
        f"{hf_name}{PAYLOAD_MARK}A",
        f"{hf_name}{PAYLOAD_MARK}B",
        f"{hf_name}{PAYLOAD_MARK}scaling/{str(base_dtype).removeprefix('torch.')}/{_LAYOUTS[transpose]}",
    )


def is_payload(name: str) -> bool:
    return PAYLOAD_MARK in name


def _adapted_layers(peft_model) -> list[tuple[str, str, object]]:
    """``(Hugging Face name, state-dict name, LoRA layer)`` of every adapted base weight.

    Raises:
        ValueError: DoRA, more than one active adapter on a layer, an adapter already merged into its base weight,
            or an adapted weight tied to another module's (tied embeddings with LoRA on ``embed_tokens`` or
            ``lm_head``: the trainer applies the adapter to one use of the weight, a merged rollout to both).
    """
    from peft.tuners.lora import Embedding, Linear, LoraLayer
    from verl.utils.model import convert_weight_keys

    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    users: dict[int, list[str]] = {}  # id(parameter) -> names (tied weights: several)
    for name, p in peft_model.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(name)
    found = []
    for name, m in peft_model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if any(m.use_dora.get(a, False) for a in m.active_adapters):
            raise ValueError(f"{name}: DoRA adapters (use_dora) are not merged by the native rollout's sync")
        if m.merged:
            raise ValueError(
                f"{name}: the adapter is merged into the base weight in the trainer; the rollout's sync "
                "merges it onto the unmerged base"
            )
        active = [a for a in m.active_adapters if a in m.scaling]
        if m.disable_adapters or not active:
            continue
        if len(active) > 1:
            raise ValueError(
                f"{name}: {len(active)} active adapters ({active}); adapter-only sync carries one per layer"
            )
        if not isinstance(m, (Linear, Embedding)):
            _adapter_parts(m, active[0])  # raises, naming the layer kind
        base_weight = m.get_base_layer().weight
        tied = [n for n in users.get(id(base_weight), []) if not n.startswith(f"{name}.")]
        if tied:
            raise ValueError(
                f"{name}: its base weight is tied to {tied[0]} (tied embeddings?): the trainer applies "
                "the adapter to this module only, a merged rollout would apply it to both; leave it out "
                "of actor_rollout_ref.model.target_modules"
            )
        found.append((name, f"{name}.base_layer.weight", m, active[0]))
    stripped = {state.replace("base_model.model.", "", 1).replace(".base_layer", ""): None for _, state, _, _ in found}
    hf_names = list(convert_weight_keys(stripped, base))
    return [(hf, state, layer, adapter) for hf, (_, state, layer, adapter) in zip(hf_names, found)]


@torch.no_grad()
def lora_adapter_payload(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter alone as named tensors, for the rollout to merge (:class:`AdapterMerger`); ``module`` untouched.

    Per adapted base weight (Hugging Face name ``hf``), the three tensors named by :func:`payload_names`: ``A``
    ``(r, in)`` and ``B`` ``(out, r)`` in the trainer's dtype (whole tensors: ``full_tensor()`` on a ``DTensor``,
    collective), then the scaling (float64, one element). Nothing else: the unadapted weights never change under
    LoRA, and the rollout loads the base model from the same files at start.

    Raises:
        ValueError: as :func:`_adapted_layers` and :func:`_adapter_parts` (DoRA, a layer kind other than Linear or
            Embedding, tied weights, several active adapters, merged), before anything is yielded.
    """
    peft_model = unwrap_fsdp(module)
    layers = _adapted_layers(peft_model)  # refuses before the first tensor leaves
    for hf, _, layer, adapter in layers:
        a, b, scaling, transpose = _adapter_parts(layer, adapter)
        name_a, name_b, name_s = payload_names(hf, layer.get_base_layer().weight.dtype, transpose)
        yield name_a, a.detach()
        yield name_b, b.detach()
        yield name_s, torch.tensor([float(scaling)], dtype=torch.float64)


def adapter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the adapters' ``A`` and ``B`` (what a peft adapter checkpoint holds), for reports and tests."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if "lora_" in n)


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsBase:
    """The model's base weights straight from its safetensors files, mapped read-only: page-cache pages shared with
    every other reader of the files, no anonymous copy. ``get(name)`` is a zero-copy view (``None``: not in the
    files, e.g. a tied ``lm_head``).

    Args:
        model_path: a Hugging Face model folder (``model.safetensors`` or a sharded index).

    Raises:
        FileNotFoundError: no safetensors file in ``model_path`` (a ``.bin`` checkpoint).
    """

    def __init__(self, model_path: str) -> None:
        import glob
        import json
        import mmap
        import os

        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(
                f"{model_path}: no safetensors file: adapter-only LoRA sync reads the base weights from them"
            )
        self._maps, self._where = [], {}
        for path in files:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private, never written: file pages
            n = int.from_bytes(mm[:8], "little")
            header = json.loads(mm[8 : 8 + n])
            header.pop("__metadata__", None)
            self._maps.append(mm)
            for name, info in header.items():
                self._where[name] = (
                    mm,
                    8 + n + info["data_offsets"][0],
                    _ST_DTYPES[info["dtype"]],
                    tuple(info["shape"]),
                )

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor | None:
        entry = self._where.get(name)
        if entry is None:
            return None
        mm, offset, dtype, shape = entry
        count = 1
        for d in shape:
            count *= d
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).view(shape)

    def close(self) -> None:
        self._where.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a view still points into it: unmapped when the view goes
                pass
        self._maps.clear()


class AdapterMerger:
    """Rollout side of adapter-only LoRA sync: a stream transform from the adapter payload
    (:func:`lora_adapter_payload`, arriving in any order and cut anywhere, e.g. across object-store buckets) to the
    merged ``(Hugging Face name, W0 + scaling * B @ A)`` of exactly the adapted matrices, computed as
    :func:`merged_lora_weights` computes them (bitwise equal): ``lora_delta(A, B, scaling)`` in the adapter's dtype,
    cast to the trainer's base dtype (from the payload), plus ``W0`` cast to that dtype. Names that are not payload
    pass through unchanged (a full sync). One merged matrix is alive at a time, besides what the consumer keeps.

    Args:
        base: where ``W0`` comes from (:class:`SafetensorsBase` of the model path the rollout was loaded from, or any
            object with ``get(name) -> Tensor | None`` and ``names()``).

    Use: ``sampler.load_state_dict(merger(stream))`` per received piece, then :meth:`finish` once per sync.
    """

    def __init__(self, base) -> None:
        self.base = base
        self._pending: dict[str, dict[str, object]] = {}
        self.merged: list[str] = []  # this sync's merged names
        self.payload_bytes = 0

    def __call__(self, named_tensors) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            if PAYLOAD_MARK not in name:
                yield name, tensor
                continue
            hf, part = name.split(PAYLOAD_MARK, 1)
            self.payload_bytes += tensor.numel() * tensor.element_size()
            parts = self._pending.setdefault(hf, {})
            if part.startswith("scaling/"):
                _, dtype, layout = part.split("/")
                parts["scaling"] = (float(tensor.reshape(-1)[0].item()), getattr(torch, dtype), layout == "BA_T")
            elif part in ("A", "B"):
                parts[part] = tensor.detach().clone()  # kept past this item: the transport may reuse its memory
            else:
                raise ValueError(f"adapter-only LoRA sync: unknown payload tensor {name!r}")
            if len(parts) == 3:
                del self._pending[hf]
                yield hf, self.merge(hf, parts["A"], parts["B"], *parts["scaling"])

    @torch.no_grad()
    def merge(
        self, hf: str, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype, transpose: bool
    ) -> torch.Tensor:
        """``W0 + scaling * B @ A`` of base weight ``hf``, as the trainer-side merge computes it."""
        w0 = self.base.get(hf)
        if w0 is None:
            raise ValueError(
                f"adapter-only LoRA sync: the base weight {hf!r} is not in the model's files, so the "
                "rollout cannot merge its adapter; leave that module out of "
                "actor_rollout_ref.model.target_modules"
            )
        delta = lora_delta(a.to(w0.device), b.to(w0.device), scaling, transpose)
        if tuple(delta.shape) != tuple(w0.shape):
            raise ValueError(
                f"adapter-only LoRA sync: {hf!r} is {tuple(w0.shape)} in the model's files, its adapter "
                f"gives {tuple(delta.shape)}"
            )
        self.merged.append(hf)
        return delta.to(dtype).add_(w0.to(dtype))

    def unadapted(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every base tensor of the files that this sync did not merge, as the files hold it (for a rollout that gave
        its weights' pages back while asleep: it is then written whole again, from the page cache, not the wire)."""
        done = set(self.merged)
        for name in self.base.names():
            if name not in done:
                yield name, self.base.get(name)

    def finish(self) -> list[str]:
        """End of one sync: the names merged, and the state cleared for the next.

        Raises:
            ValueError: a matrix whose A, B or scaling never arrived (a truncated stream): named.
        """
        if self._pending:
            hf, parts = next(iter(self._pending.items()))
            missing = sorted({"A", "B", "scaling"} - set(parts))
            self._pending.clear()
            raise ValueError(
                f"adapter-only LoRA sync ended with {hf!r} missing its {', '.join(missing)}: the stream was cut"
            )
        merged, self.merged, self.payload_bytes = self.merged, [], 0
        return merged


# the rollout process's receiver: one merger per process, its base the model path the rollout was loaded from
_receiver: dict = {"path": None, "merger": None, "used": False}


def set_base_path(model_path: str) -> None:
    """Where this process's rollout loaded its base model from (the rollout server, an in-worker sampler): an
    adapter payload received here is merged onto that model's files."""
    if _receiver["path"] != model_path:
        _receiver.update(path=model_path, merger=None)


def received_stream(named_tensors):
    """The receive seam's transform (:func:`verl_backend.weight_sync.apply.received`): adapter payload tensors become
    merged ``(Hugging Face name, tensor)`` pairs, anything else passes through. A sync may arrive in several pieces
    (buckets): the merger's state spans them until :func:`end_of_sync`."""
    for name, tensor in named_tensors:
        if PAYLOAD_MARK not in name:
            yield name, tensor
            continue
        merger = _receiver["merger"]
        if merger is None:
            if _receiver["path"] is None:
                raise ValueError(
                    "adapter-only LoRA sync: this process received an adapter but knows no base model "
                    "to merge it onto (lora.set_base_path was not called)"
                )
            merger = _receiver["merger"] = AdapterMerger(SafetensorsBase(_receiver["path"]))
        _receiver["used"] = True
        yield from merger(((name, tensor),))


def adapter_sync_open() -> bool:
    """This process is between the first adapter tensor of a sync and :func:`end_of_sync`."""
    return bool(_receiver["used"])


def unadapted_for_refill():
    """This sync's unadapted base tensors from the files (a rollout that gave its weights' pages back)."""
    merger = _receiver["merger"]
    return merger.unadapted() if merger is not None else iter(())


def end_of_sync() -> bool:
    """End of one sync on the receiving side: ``True`` when it was adapter-only. The model's files are unmapped
    until the next sync (their pages, read for the merge, stay in the page cache, out of this process's memory).

    Raises:
        ValueError: a matrix's A, B or scaling never arrived (:meth:`AdapterMerger.finish`).
    """
    used, _receiver["used"] = _receiver["used"], False
    merger = _receiver["merger"]
    if merger is not None:
        _receiver["merger"] = None
        try:
            if used:
                merger.finish()
        finally:
            merger.base.close()
    return used
