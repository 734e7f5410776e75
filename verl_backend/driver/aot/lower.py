"""The lowering subprocess: a TPU job's graphs to StableHLO through TorchTPU, on a machine without a chip.

Run as ``python -m verl_backend.driver.aot.lower SPEC.json`` by the interpreter that has torch-tpu
(:func:`verl_backend.driver.aot.run.aot_python`), never imported by the driver: TorchTPU's import takes 5-20 s and
an eager TPU op outside compile mode aborts the whole process.

``SPEC.json``: ``{"out": folder, "jobs": [{"label", "config" (a config.json dict), "model_type", "dtype"
("bfloat16"|"float32"), "attention" ("sdpa"|"eager"), "experts" (optional: transformers' experts implementation,
default the TPU job's ``batched_mm``, :data:`rl_tpu.expert_slices.TPU_EXPERTS`), "graphs": [GraphRequest
fields…]}]}``. A ``block`` or ``block_forward`` request is traced once per distinct kind of block of the model
(:func:`block_kinds`: dense and MoE, sliding and full attention, with and without RoPE). Each graph is traced on
the meta device (no weights: the model is built from its config on meta), through aot_autograd with TorchTPU's
decompositions and min-cut partitioning (forward and backward graphs), then every ``device=meta`` in it is pointed
at ``tpu`` and it is lowered on metadata-only TPU placeholders by TorchTPU's kernels
(:mod:`verl_backend.patches.torch_tpu_aot`). Writes ``<out>/<label>/<n>.mlir`` per graph and ``<out>/lowered.json``:
one record per graph, ``{"label", "graph", "file", "seconds", "mosaic", "inputs", "ops", "block", "block_layers",
"error"}`` (``ops``: the graph's ATen calls after TorchTPU's decompositions; ``block``: the block kind's label, ``""``
for a model of one kind or a graph of no block; ``block_layers``: how many of the model's blocks are of that kind);
``error`` is one line (op, module, graph) or ``None``.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

from verl_backend.driver.aot.graphs import WITH_BACKWARD


def _dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def build_model(config: dict, model_type: str, dtype, attention: str, device: str = "meta", experts: str | None = None):
    """A causal LM of ``config`` (a config.json dict) on ``device`` with ``attention`` as attention implementation and
    ``experts`` as transformers' experts implementation (default: the TPU job's, ``batched_mm``; it applies only to a
    mixture of experts)."""
    import torch
    import transformers

    from rl_tpu.expert_slices import TPU_EXPERTS

    cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    from rl_tpu.patches.transformers_internals import set_attn_implementation

    set_attn_implementation(cfg, attention)
    for sub in ("text_config",):
        if hasattr(cfg, sub):
            set_attn_implementation(getattr(cfg, sub), attention)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, experts_implementation=experts or TPU_EXPERTS
        )
    return model.eval()


def _layer_type(model, index: int) -> str | None:
    types = getattr(model.config, "layer_types", None)
    if types and index < len(types):
        return str(types[index])
    value = getattr(model.model.layers[index], "attention_type", None)
    return value if isinstance(value, str) else None


def block_kinds(model) -> list[dict]:
    """The distinct kinds of ``model``'s decoder blocks, in the order first met: ``[{"label", "layer", "layers"}]``
    (``layer``: the first block of the kind, the one traced; ``layers``: how many blocks are of the kind).

    Two blocks are of one kind when their module trees (each submodule's path and class: a dense MLP against a
    mixture of experts) and their attention's per-layer settings (``config.layer_types``, ``attention_type``,
    ``sliding_window``, ``use_rope``, ``is_sliding`` of the block and its ``self_attn``) agree. ``label`` is ``""``
    when all blocks are one kind (graph names stay as they were), else what tells the kinds apart, from ``dense`` /
    ``moe``, the layer type (``sliding``, ``full``, …) and ``rope`` / ``norope``; ``layer<i>`` when none of those
    does."""
    from rl_tpu.expert_slices import has_fused_experts

    layers = list(model.model.layers)
    kinds: dict[tuple, dict] = {}
    for i, layer in enumerate(layers):
        tree = tuple((name, type(m).__name__) for name, m in layer.named_modules())
        settings = [_layer_type(model, i)]
        for obj in (layer, getattr(layer, "self_attn", None)):
            for attr in ("attention_type", "sliding_window", "use_rope", "is_sliding"):
                value = getattr(obj, attr, None) if obj is not None else None
                settings.append(value if isinstance(value, (str, int, float, bool, type(None))) else type(value))
        key = (tree, tuple(settings))
        if key in kinds:
            kinds[key]["layers"] += 1
            continue
        rope = getattr(getattr(layer, "self_attn", None), "use_rope", True)
        kinds[key] = {
            "layer": i,
            "layers": 1,
            "features": {
                "mlp": "moe" if has_fused_experts(layer) else "dense",
                "attention": (_layer_type(model, i) or "").replace("_attention", ""),
                "rope": "rope" if rope in (True, None, 1) else "norope",
            },
        }
    out = list(kinds.values())
    varying = [f for f in ("mlp", "attention", "rope") if len({k["features"][f] for k in out}) > 1]
    for k in out:
        k["label"] = ",".join(k["features"][f] for f in varying) if len(out) > 1 else ""
    if len({k["label"] for k in out}) < len(out):  # the features above do not tell them apart
        for k in out:
            k["label"] = f"layer{k['layer']}"
    return [{"label": k["label"], "layer": k["layer"], "layers": k["layers"]} for k in out]


#: deliberately wrong decompositions for the numerics check's negative control: name -> (op, replacement)
WRONG = {"rsqrt": ("rsqrt", lambda x: 1.01 / x.sqrt())}


class Recorder:
    """A torch.compile backend that records aot_autograd's forward and backward graphs and runs them as they are;
    with ``capture``, each graph's first run's inputs and outputs (real tensors) are kept too (``runs``)."""

    def __init__(self, capture: bool = False, wrong: str | None = None):
        import torch
        from functorch.compile import min_cut_rematerialization_partition
        from rl_tpu.patches.torch_internals import aot_autograd

        from verl_backend.patches.torch_tpu_aot import decompositions

        self.graphs: list[tuple[str, object, list]] = []
        self.runs: list[tuple[list, list]] = []
        self.capture = capture
        table = decompositions()
        if wrong:
            name, fn = WRONG[wrong]
            table[getattr(torch.ops.aten, name).default] = fn
        self.backend = aot_autograd(
            fw_compiler=self._record("fwd"),
            bw_compiler=self._record("bwd"),
            inference_compiler=self._record("fwd"),
            decompositions=table,
            partition_fn=min_cut_rematerialization_partition,
        )

    def _record(self, part):
        def compiler(gm, example_inputs):
            index = len(self.graphs)
            self.graphs.append((part, gm, list(example_inputs)))
            if not self.capture:
                return gm

            def run(*args):
                out = gm(*args)
                if len(self.runs) <= index:
                    self.runs.append(
                        (
                            [a.detach().clone() if hasattr(a, "detach") else a for a in args],
                            [o.detach().clone() if hasattr(o, "detach") else o for o in out],
                        )
                    )
                return out

            return run

        return compiler


def _causal_mask(batch, seq, dtype, device):
    import torch

    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None].expand(batch, 1, seq, seq).contiguous()  # (batch, 1, seq, seq) additive


def _trace_block(model, backend, index: int, batch: int, seq: int, dtype, device: str, grad: bool) -> None:
    """Trace decoder block ``index`` of ``model`` with ``backend`` (a :class:`Recorder`'s) on a ``(batch, seq,
    hidden)`` input on ``device``, with its rotary tables (of the block's layer type where the model has several) and
    a causal mask; with ``grad``, through its backward too (the update's graphs), else under no_grad."""
    import torch

    inner = model.model
    layer_type = _layer_type(model, index)
    layer = inner.layers[index]  # the name dynamo gives its submodules in the graph and in errors: L['layer']
    x = torch.randn(batch, seq, model.config.hidden_size, dtype=dtype, device=device).requires_grad_(grad)
    pos = torch.arange(seq, device=device)[None].expand(batch, seq)
    rotary = inner.rotary_emb
    if layer_type and "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma3: per layer type
        cos, sin = rotary(x, pos, layer_type)
    else:
        cos, sin = rotary(x, pos)
    mask = _causal_mask(batch, seq, dtype, device)

    def block(x, cos, sin, mask):
        out = layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    with torch.set_grad_enabled(grad):
        out = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)(x, cos.detach(), sin.detach(), mask)
    if grad:
        out.float().sum().backward()


def _trace_head(model, backend, kind: str, batch: int, seq: int, dtype, device: str, grad: bool) -> None:
    """Trace the final norm and a head of ``model`` with ``backend`` on a ``(batch, seq, hidden)`` input on
    ``device``: for ``lm_head*`` kinds the LM head's fp32 log-probs of the labels, ``(batch, seq)``; for
    ``value_head*`` VeRL's critic head (the model's ...ForTokenClassification with one label, its ``score`` Linear
    with bias, made here; random weights off the meta device), fp32 values ``(batch, seq)``. With ``grad``, through
    the backward too, else under no_grad."""
    import torch

    hidden = model.config.hidden_size
    norm = model.model.norm
    h = torch.randn(batch, seq, hidden, dtype=dtype, device=device).requires_grad_(grad)
    if kind.startswith("lm_head"):
        head = model.lm_head
        labels = torch.zeros(batch, seq, dtype=torch.long, device=device)

        def logprob(h, labels):
            logits = head(norm(h)).float()  # (batch, seq, vocab) fp32
            return torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)  # (batch, seq)

        fn, args = logprob, (h, labels)
    else:  # VeRL's critic: the model's ...ForTokenClassification with one label, its `score` Linear (with bias)
        score = torch.nn.Linear(hidden, 1, dtype=dtype, device=device)
        if device != "meta":
            torch.nn.init.normal_(score.weight, 0, 0.2)

        def values(h):
            return score(norm(h)).float().squeeze(-1)  # (batch, seq) fp32

        fn, args = values, (h,)
    with torch.set_grad_enabled(grad):
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    if grad:
        out.sum().backward()


def _trace_sampler_step(model, backend, kind: str, batch: int, seq: int, cache_len: int, dtype, device: str) -> None:
    """Trace one sampler step of ``model`` with ``backend``, under no_grad: a ``prefill`` of ``seq`` tokens or a
    ``decode`` of one, for ``batch`` rows, into a static KV cache of ``cache_len`` positions (its tensors made on
    ``device`` before the trace, so the graph takes them as inputs)."""
    import torch
    from transformers import StaticCache

    from rl_tpu.sampler.compiled import model_logits

    config = model.config
    q = seq if kind == "prefill" else 1
    ids = torch.randint(0, config.vocab_size, (batch, q), device=device)
    mask = torch.ones(batch, cache_len, dtype=torch.long, device=device)
    pos = torch.arange(q, device=device)[None].expand(batch, q).contiguous()
    cache = StaticCache(config=config, max_cache_len=cache_len)
    # the cache's tensors are made at the first update, on the keys' device: make them now, outside the graph
    with torch.no_grad():
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        probe = torch.zeros(batch, config.num_key_value_heads, 1, head_dim, dtype=dtype, device=device)
        for cache_layer in cache.layers:
            cache_layer.lazy_initialization(probe, probe)

    def step(ids, mask, pos, cache):
        return model_logits(model, ids, mask, pos, cache)

    with torch.no_grad():
        torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(ids, mask, pos, cache)


def trace(
    model, request: dict, device: str = "meta", rec: Recorder | None = None, layer: int = 0
) -> list[tuple[str, object, list]]:
    """The FX graphs of one :class:`~verl_backend.driver.aot.graphs.GraphRequest` (dict form) of ``model``:
    ``[(part, graph_module, example_inputs)]`` with part ``fwd`` or ``bwd``. Inputs live on ``device``; ``rec``:
    the recorder to trace with (default: a new one); ``layer``: the block a ``block`` / ``block_forward`` graph
    traces (its rotary tables of that block's layer type).

    Raises:
        ValueError: an unknown graph kind.
    """
    import torch

    kind, batch, seq, cache_len = request["kind"], request["batch"], request["seq"], request["cache"]
    dtype = next(model.parameters()).dtype
    rec = rec or Recorder()
    torch.compiler.reset()  # a new trace each time (dynamo caches per code object)
    grad = kind in WITH_BACKWARD  # the update's graphs; the *_forward kinds run under no_grad (log-probs, values)
    if kind in ("block", "block_forward"):
        _trace_block(model, rec.backend, layer, batch, seq, dtype, device, grad)
    elif kind in ("lm_head", "lm_head_forward", "value_head", "value_head_forward"):
        _trace_head(model, rec.backend, kind, batch, seq, dtype, device, grad)
    elif kind in ("prefill", "decode"):
        _trace_sampler_step(model, rec.backend, kind, batch, seq, cache_len, dtype, device)
    else:
        raise ValueError(f"unknown graph kind {kind!r}")
    return rec.graphs


def retarget(gm) -> None:
    """Point every ``device=meta|cpu`` keyword in ``gm`` (factory calls, ``.to``) at the ``tpu`` device."""
    import torch

    tpu = torch.device("tpu", 0)
    for node in list(gm.graph.nodes):
        dev = node.kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type in ("meta", "cpu"):
            node.kwargs = {**node.kwargs, "device": tpu}
    gm.recompile()


def lift_constants(gm) -> list:
    """Turn each constant tensor of ``gm`` (``get_attr``; a CPU trace keeps some, e.g. a mask's fill value) into a
    new last input; returns their values, in the order of the new inputs."""
    import torch

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = []
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor):
            with gm.graph.inserting_after(placeholders[-1] if placeholders else None):
                new = gm.graph.placeholder(f"lifted_{len(values)}")
            placeholders.append(new)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            values.append(getattr(gm, node.target))
    gm.recompile()
    return values


def lower(gm, example_inputs) -> tuple[str, list]:
    """StableHLO text of ``gm`` on TPU placeholders shaped like ``example_inputs``, and the constant tensors lifted
    to extra last inputs (:func:`lift_constants`)."""
    import torch

    from verl_backend.patches.torch_tpu_aot import lower_fx_to_mlir, placeholder

    retarget(gm)
    constants = lift_constants(gm)
    args = [
        placeholder(t.shape, t.dtype) if isinstance(t, torch.Tensor) else t for t in list(example_inputs) + constants
    ]
    return lower_fx_to_mlir(gm, args), constants


def tracing_failure(exc: BaseException) -> tuple[str | None, str | None, str]:
    """What a dynamo / aot_autograd tracing failure says, in one line each: ``(op, where, why)``. ``op``: the ATen op
    or torch function that failed (from the message, else the call in the innermost line of user code); ``where``:
    the module class whose code holds that line and its file and line (``Qwen3MoeExperts
    (modeling_qwen3_moe.py:123)``); ``why``: the exception's type and its first line."""
    import re

    text = str(exc)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    why = f"{type(exc).__name__}: {(lines[0] if lines else '')[:200]}"
    op = None
    m = re.search(r"\b(aten\.\w+(?:\.\w+)?)", text) or re.search(
        r"call_(?:function|method) <(?:built-in method|function) (\w+)", text
    )
    if m:
        op = m.group(1)
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', text.split("from user code:")[-1])
    where = None
    if frames:
        path, line, code = frames[-1]
        if op is None:
            call = re.search(r"\b((?:torch|F|self)\.[\w.]+)\s*\(", code)
            op = call.group(1) if call else code.strip()[:80] or None
        owner = None
        try:  # the nearest class statement above the line, indented less than it
            source = Path(path).read_text().splitlines()[: int(line)]
            depth = len(source[-1]) - len(source[-1].lstrip())
            for text_line in reversed(source):
                m = re.match(r"(\s*)class (\w+)", text_line)
                if m and len(m.group(1)) < depth:
                    owner = m.group(2)
                    break
        except (OSError, IndexError):
            pass
        where = f"{owner + ' ' if owner else ''}({Path(path).name}:{line})"
    return op, where, why


def graph_name(request: dict, part: str, index: int, parts: int) -> str:
    from verl_backend.driver.aot.graphs import GraphRequest

    base = GraphRequest(**request).name
    if request["kind"] in WITH_BACKWARD:
        return f"{base}.{part}" if parts == 2 else f"{base}.{part}{index}"
    return base


def _job_model(job: dict):
    """The model of one lowering job and its kinds of block (:func:`block_kinds`): on the meta device, or for a
    numerics job on CPU with random weights far from zero (N(0, 0.2) on every matrix, so a wrong op shows in the
    numbers); in training mode (dropout on: random ops in the graphs) where the job asks for ``train_mode``."""
    import torch

    numerics = job.get("numerics")
    device = "cpu" if numerics is not None else "meta"
    model = build_model(
        job["config"], job["model_type"], _dtype(job["dtype"]), job["attention"], device, job.get("experts")
    )
    kinds = block_kinds(model)
    if numerics is not None:  # real random weights far from zero, so a wrong op shows in the numbers
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.2)
    if job.get("train_mode"):  # dropout on: random ops in the graphs
        model.train()
    return model, kinds


def _per_block_kind(requests: list[dict], kinds: list[dict]) -> list[tuple[dict, int, int | None]]:
    """The job's graph requests with each ``block`` / ``block_forward`` one made one per kind of block:
    ``[(request, block traced, blocks of its kind)]`` (a block request gets ``"block"``: the kind's label; any
    other request the block 0 and ``None``)."""
    expanded = []
    for request in requests:
        if request["kind"] in ("block", "block_forward"):
            expanded += [({**request, "block": k["label"]}, k["layer"], k["layers"]) for k in kinds]
        else:
            expanded.append((request, 0, None))
    return expanded


def _trace_request(model, request: dict, layer: int, numerics: dict | None) -> tuple[list, list | None]:
    """The graphs of ``request`` to lower (:func:`trace`) and, for a numerics job, each graph's torch eager inputs
    and outputs: ``(graphs, runs)``, ``runs`` ``None`` off a numerics job. A numerics job traces on CPU: once with a
    capturing recorder, whose run is the reference, then again with ``numerics["wrong"]``'s wrong decomposition
    when the job is the negative control (the graphs lowered are then the wrong ones).

    Raises:
        Exception: whatever dynamo / aot_autograd raise while tracing.
    """
    import torch

    if numerics is None:
        return trace(model, request, layer=layer), None
    # torch eager on CPU runs each graph once (the reference), then the graphs to lower are traced again, with a
    # wrong decomposition for the control
    ref = Recorder(capture=True)
    torch.manual_seed(1)
    graphs = trace(model, request, "cpu", ref, layer=layer)
    runs = ref.runs
    if numerics.get("wrong"):
        torch.manual_seed(1)
        graphs = trace(model, request, "cpu", Recorder(wrong=numerics["wrong"]), layer=layer)
    return graphs, runs


def _tracing_failure_record(base: dict, request: dict, exc: BaseException) -> dict:
    """The lowered.json record of a request whose tracing failed: no file, its ``op`` and a one-line ``error``
    naming the op, the module (:func:`tracing_failure`) and the graph."""
    from verl_backend.driver.aot.graphs import GraphRequest

    name = GraphRequest(**request).name
    op, where, why = tracing_failure(exc)
    return {
        **base,
        "graph": name,
        "file": None,
        "seconds": None,
        "mosaic": None,
        "op": op,
        "error": f"tracing failed: {op or 'an op'}{f' in {where}' if where else ''} of graph {name}: {why}",
    }


def lowering_failure_line(name: str, exc) -> str:
    """One line for graph ``name`` that TorchTPU could not lower (``exc``: its ``LoweringError``), naming the op and
    the module; a random op's says that it needs the TPU generator, hence a chip."""
    where = f" in {exc.module}" if exc.module else ""
    why = str(exc)
    if exc.op and any(w in exc.op for w in ("dropout", "rand", "bernoulli", "normal", "uniform")):
        why = f"a random op needs the TPU generator, which needs a chip ({why})"
    return f"TorchTPU cannot lower {exc.op or 'an op'}{where} of graph {name}: {why}"


def _lowering_failure_record(base: dict, name: str, exc) -> dict:
    """The lowered.json record of graph ``name`` that TorchTPU could not lower (``exc``: its ``LoweringError``): no
    file, its ``op`` and a one-line ``error`` (:func:`lowering_failure_line`)."""
    return {
        **base,
        "graph": name,
        "file": None,
        "seconds": None,
        "mosaic": None,
        "op": exc.op,
        "error": lowering_failure_line(name, exc),
    }


def _save_numerics(path: Path, run: tuple[list, list], constants: list) -> str:
    """Write one graph's torch eager run (``(inputs, outputs)``) beside its StableHLO ``path`` as ``.npz``: the
    tensor inputs, then the lifted constants (:func:`lift_constants`), as ``in<i>``, the tensor outputs as
    ``out<i>``. Returns the file's path."""
    import numpy as np
    import torch

    args, outs = run
    args = list(args) + [c.detach().clone() for c in constants]
    arrays = {f"in{i}": a.numpy() for i, a in enumerate(t for t in args if isinstance(t, torch.Tensor))}
    arrays.update({f"out{i}": o.numpy() for i, o in enumerate(t for t in outs if isinstance(t, torch.Tensor))})
    file = str(path.with_suffix(".npz"))
    np.savez(file, **arrays)
    return file


def _lower_graphs(
    graphs: list, request: dict, base: dict, folder: Path, runs: list | None, start: float, first: int
) -> list[dict]:
    """Lower each traced graph of ``request`` to StableHLO (:func:`lower`) and write it to ``folder/<n>.mlir``,
    ``n`` counting on from ``first`` (the records already made); with ``runs`` (a numerics job), its torch eager
    run beside it (:func:`_save_numerics`). ``start``: when the request's tracing began
    (``time.perf_counter()``, seconds). Returns one lowered.json record per graph; a graph TorchTPU cannot lower is
    a record with its one-line error, not an exception."""
    from verl_backend.patches.torch_tpu_aot import LoweringError

    records = []
    for index, (part, gm, example) in enumerate(graphs):
        name = graph_name(request, part, index, len(graphs))
        t0 = time.perf_counter()
        try:
            text, constants = lower(gm, example)
        except LoweringError as exc:
            records.append(_lowering_failure_record(base, name, exc))
            continue
        path = folder / f"{first + len(records)}.mlir"
        path.write_text(text)
        record = {
            **base,
            "graph": name,
            "file": str(path),
            "seconds": time.perf_counter() - t0,
            "trace_seconds": t0 - start,
            "mosaic": "tpu_custom_call" in text,
            "inputs": len(example),
            "error": None,
            # ATen ops after TorchTPU's decompositions: what strict eager mode would launch one by one
            "ops": sum(1 for n in gm.graph.nodes if n.op == "call_function"),
        }
        if runs is not None and index < len(runs):
            record["numerics"] = _save_numerics(path, runs[index], constants)
        records.append(record)
    return records


def run(spec: dict) -> list[dict]:
    """Lower every graph of ``spec`` (see the module docstring); returns the records written to lowered.json."""
    import torch

    from verl_backend.patches.torch_tpu_aot import apply

    apply()
    torch.manual_seed(0)
    out = Path(spec["out"])
    records = []
    for job in spec["jobs"]:
        folder = out / job["label"]
        folder.mkdir(parents=True, exist_ok=True)
        model, kinds = _job_model(job)
        for request, layer, count in _per_block_kind(job["graphs"], kinds):
            start = time.perf_counter()
            base = {
                "label": job["label"],
                "kind": request["kind"],
                "request": request,
                "block": request.get("block", ""),
                "block_layers": count,
            }
            try:
                graphs, runs = _trace_request(model, request, layer, job.get("numerics"))
            except Exception as exc:  # dynamo / aot tracing on meta
                records.append(_tracing_failure_record(base, request, exc))
                continue
            records += _lower_graphs(graphs, request, base, folder, runs, start, len(records))
    (out / "lowered.json").write_text(json.dumps(records, indent=1))
    return records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    spec = json.loads(Path(argv[0]).read_text())
    run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
