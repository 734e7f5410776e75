"""The lowering subprocess: a TPU job's graphs to StableHLO through TorchTPU, on a machine without a chip.

Run as ``python -m verl_backend.driver.aot.lower SPEC.json`` by the interpreter that has torch-tpu
(:func:`verl_backend.driver.aot.run.aot_python`), never imported by the driver: TorchTPU's import takes 5-20 s and
an eager TPU op outside compile mode aborts the whole process.

``SPEC.json``: ``{"out": folder, "jobs": [{"label", "config" (a config.json dict), "model_type", "dtype"
("bfloat16"|"float32"), "attention" ("sdpa"|"eager"), "graphs": [GraphRequest fields…]}]}``. Each graph is traced on
the meta device (no weights: the model is built from its config on meta), through aot_autograd with TorchTPU's
decompositions and min-cut partitioning (forward and backward graphs), then every ``device=meta`` in it is pointed
at ``tpu`` and it is lowered on metadata-only TPU placeholders by TorchTPU's kernels
(:mod:`verl_backend.patches.torch_tpu_aot`). Writes ``<out>/<label>/<n>.mlir`` per graph and ``<out>/lowered.json``:
one record per graph, ``{"label", "graph", "file", "seconds", "mosaic", "inputs", "ops", "error"}`` (``ops``: the
graph's ATen calls after TorchTPU's decompositions); ``error`` is one line
(op, module, graph) or ``None``.
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


def build_model(config: dict, model_type: str, dtype, attention: str, device: str = "meta"):
    """A causal LM of ``config`` (a config.json dict) on ``device`` with ``attention`` as attention implementation."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    from rl_tpu.patches.transformers_internals import set_attn_implementation

    set_attn_implementation(cfg, attention)
    for sub in ("text_config",):
        if hasattr(cfg, sub):
            set_attn_implementation(getattr(cfg, sub), attention)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


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
        self.backend = aot_autograd(fw_compiler=self._record("fwd"), bw_compiler=self._record("bwd"),
                                    inference_compiler=self._record("fwd"), decompositions=table,
                                    partition_fn=min_cut_rematerialization_partition)

    def _record(self, part):
        def compiler(gm, example_inputs):
            index = len(self.graphs)
            self.graphs.append((part, gm, list(example_inputs)))
            if not self.capture:
                return gm

            def run(*args):
                out = gm(*args)
                if len(self.runs) <= index:
                    self.runs.append(([a.detach().clone() if hasattr(a, "detach") else a for a in args],
                                      [o.detach().clone() if hasattr(o, "detach") else o for o in out]))
                return out

            return run

        return compiler


def _causal_mask(batch, seq, dtype, device):
    import torch

    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None].expand(batch, 1, seq, seq).contiguous()  # (batch, 1, seq, seq) additive


def trace(model, request: dict, device: str = "meta", rec: Recorder | None = None) -> list[tuple[str, object, list]]:
    """The FX graphs of one :class:`~verl_backend.driver.aot.graphs.GraphRequest` (dict form) of ``model``:
    ``[(part, graph_module, example_inputs)]`` with part ``fwd`` or ``bwd``. Inputs live on ``device``; ``rec``:
    the recorder to trace with (default: a new one)."""
    import torch

    kind, batch, seq, cache_len = request["kind"], request["batch"], request["seq"], request["cache"]
    config = model.config
    dtype = next(model.parameters()).dtype
    rec = rec or Recorder()
    torch.compiler.reset()  # a new trace each time (dynamo caches per code object)
    inner = model.model
    hidden = config.hidden_size
    grad = kind in WITH_BACKWARD  # the update's graphs; the *_forward kinds run under no_grad (log-probs, values)
    if kind in ("block", "block_forward"):
        layer = inner.layers[0]
        x = torch.randn(batch, seq, hidden, dtype=dtype, device=device).requires_grad_(grad)
        pos = torch.arange(seq, device=device)[None].expand(batch, seq)
        rotary = inner.rotary_emb
        layer_types = getattr(config, "layer_types", None)
        if layer_types and "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma3: per layer type
            cos, sin = rotary(x, pos, layer_types[0])
        else:
            cos, sin = rotary(x, pos)
        mask = _causal_mask(batch, seq, dtype, device)

        def block(x, cos, sin, mask):
            out = layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

        with torch.set_grad_enabled(grad):
            out = torch.compile(block, backend=rec.backend, fullgraph=True, dynamic=False)(x, cos.detach(),
                                                                                         sin.detach(), mask)
        if grad:
            out.float().sum().backward()
    elif kind in ("lm_head", "lm_head_forward", "value_head", "value_head_forward"):
        norm = inner.norm
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
            out = torch.compile(fn, backend=rec.backend, fullgraph=True, dynamic=False)(*args)
        if grad:
            out.sum().backward()
    elif kind in ("prefill", "decode"):
        from transformers import StaticCache

        from rl_tpu.sampler.compiled import model_logits

        q = seq if kind == "prefill" else 1
        ids = torch.randint(0, config.vocab_size, (batch, q), device=device)
        mask = torch.ones(batch, cache_len, dtype=torch.long, device=device)
        pos = torch.arange(q, device=device)[None].expand(batch, q).contiguous()
        cache = StaticCache(config=config, max_cache_len=cache_len)
        # the cache's tensors are made at the first update, on the keys' device: make them now, outside the graph
        with torch.no_grad():
            head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
            probe = torch.zeros(batch, config.num_key_value_heads, 1, head_dim, dtype=dtype, device=device)
            for layer in cache.layers:
                layer.lazy_initialization(probe, probe)

        def step(ids, mask, pos, cache):
            return model_logits(model, ids, mask, pos, cache)

        with torch.no_grad():
            torch.compile(step, backend=rec.backend, fullgraph=True, dynamic=False)(ids, mask, pos, cache)
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
    args = [placeholder(t.shape, t.dtype) if isinstance(t, torch.Tensor) else t
            for t in list(example_inputs) + constants]
    return lower_fx_to_mlir(gm, args), constants


def graph_name(request: dict, part: str, index: int, parts: int) -> str:
    from verl_backend.driver.aot.graphs import GraphRequest

    base = GraphRequest(**request).name
    if request["kind"] in WITH_BACKWARD:
        return f"{base}.{part}" if parts == 2 else f"{base}.{part}{index}"
    return base


def run(spec: dict) -> list[dict]:
    """Lower every graph of ``spec`` (see the module docstring); returns the records written to lowered.json."""
    import torch

    from verl_backend.patches.torch_tpu_aot import LoweringError, apply

    apply()
    torch.manual_seed(0)
    out = Path(spec["out"])
    records = []
    for job in spec["jobs"]:
        folder = out / job["label"]
        folder.mkdir(parents=True, exist_ok=True)
        numerics = job.get("numerics")
        device = "cpu" if numerics is not None else "meta"
        model = build_model(job["config"], job["model_type"], _dtype(job["dtype"]), job["attention"], device)
        if numerics is not None:  # real random weights far from zero, so a wrong op shows in the numbers
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.normal_(0, 0.2)
        if job.get("train_mode"):  # dropout on: random ops in the graphs
            model.train()
        for request in job["graphs"]:
            start = time.perf_counter()
            base = {"label": job["label"], "kind": request["kind"], "request": request}
            runs = None
            try:
                if numerics is None:
                    graphs = trace(model, request)
                else:  # torch eager on CPU runs each graph once (the reference), then the graphs to lower are
                    ref = Recorder(capture=True)  # traced again, with a wrong decomposition for the control
                    torch.manual_seed(1)
                    graphs = trace(model, request, "cpu", ref)
                    runs = ref.runs
                    if numerics.get("wrong"):
                        torch.manual_seed(1)
                        graphs = trace(model, request, "cpu", Recorder(wrong=numerics["wrong"]))
            except Exception as exc:  # dynamo / aot tracing on meta
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                from verl_backend.driver.aot.graphs import GraphRequest

                records.append({**base, "graph": GraphRequest(**request).name, "file": None, "seconds": None,
                                "mosaic": None, "error": f"tracing failed: {type(exc).__name__}: {first}"})
                continue
            for index, (part, gm, example) in enumerate(graphs):
                name = graph_name(request, part, index, len(graphs))
                t0 = time.perf_counter()
                try:
                    text, constants = lower(gm, example)
                except LoweringError as exc:
                    where = f" in {exc.module}" if exc.module else ""
                    why = str(exc)
                    if exc.op and any(w in exc.op for w in ("dropout", "rand", "bernoulli", "normal", "uniform")):
                        why = f"a random op needs the TPU generator, which needs a chip ({why})"
                    records.append({**base, "graph": name, "file": None, "seconds": None, "mosaic": None,
                                    "op": exc.op, "error": f"TorchTPU cannot lower {exc.op or 'an op'}{where} of "
                                                          f"graph {name}: {why}"})
                    continue
                path = folder / f"{len(records)}.mlir"
                path.write_text(text)
                record = {**base, "graph": name, "file": str(path), "seconds": time.perf_counter() - t0,
                          "trace_seconds": t0 - start, "mosaic": "tpu_custom_call" in text,
                          "inputs": len(example), "error": None,
                          # ATen ops after TorchTPU's decompositions: what strict eager mode would launch one by one
                          "ops": sum(1 for n in gm.graph.nodes if n.op == "call_function")}
                if runs is not None and index < len(runs):
                    import numpy as np

                    args, outs = runs[index]
                    args = list(args) + [c.detach().clone() for c in constants]
                    arrays = {f"in{i}": a.numpy() for i, a in enumerate(t for t in args if isinstance(t, torch.Tensor))}
                    arrays.update({f"out{i}": o.numpy() for i, o in
                                   enumerate(t for t in outs if isinstance(t, torch.Tensor))})
                    record["numerics"] = str(path.with_suffix(".npz"))
                    np.savez(record["numerics"], **arrays)
                records.append(record)
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
