"""The graphs a run executed on the ``tpu-on-cpu`` backend, counted and set against the job's bucket plan.

Each process of a run with ``rl_tpu.compile_backend=tpu-on-cpu`` writes its graphs to ``<compile_cache_dir>/stats/``
(:mod:`verl_backend.tpu_on_cpu`). At the end of the run the driver reads them (:func:`executed_entry`): how many
graphs were traced and how many distinct (the same code at the same shapes is one graph, as the chip's compilation
cache makes it), how many executions, per kind, and each graph's shapes set against the shapes the job's buckets
allow (:func:`planned_shapes`). A graph outside them is named with its shapes: on a chip it would be a compile the
plan did not foresee.
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_backend.driver.aot.graphs import GraphRequest, planned_shapes
from verl_backend.driver.job_shape import JobShape


def read_stats(folder: Path, since: float = 0.0) -> list[dict]:
    """Every process's graph rows under ``folder/stats`` (:class:`verl_backend.tpu_on_cpu.GraphStats` as dicts),
    each with ``"process"``: its file's name; only files written at or after ``since`` (seconds since the epoch: the
    run's start, when the folder is shared by runs); a file that does not parse is skipped (a process killed
    mid-write leaves only its temporary file, which is not read)."""
    rows = []
    for path in sorted((Path(folder) / "stats").glob("*.json")):
        try:
            if path.stat().st_mtime < since:
                continue
            rows += [{**row, "process": path.stem} for row in json.loads(path.read_text())]
        except (OSError, ValueError):
            continue
    return rows


def graph_request(row: dict) -> GraphRequest | None:
    """The :class:`GraphRequest` a row's graph is (its kind and shapes from the region's own inputs), ``None`` for a
    region this does not know. The sampler's step takes ``ids`` ``(batch, q)`` and ``mask`` ``(batch, cache)``
    (a decode when ``q`` is 1); a block its hidden states ``(batch, seq, hidden)``; the actor's training graphs
    (``fwd``, ``bwd``) are its update's ``block``, an inference graph (``inf``, no gradient) a ``block_forward``."""
    inputs = row.get("inputs") or {}
    if row["region"] == "sampler":
        ids = next((v for k, v in inputs.items() if "ids" in k), None)
        mask = next((v for k, v in inputs.items() if "mask" in k), None)
        if not ids or not mask or len(ids) != 2:
            return None
        kind = "decode" if ids[1] == 1 else "prefill"
        return GraphRequest(kind, ids[0], ids[1], mask[-1])
    if row["region"].endswith(".block"):
        hidden = next((v for k, v in inputs.items() if "hidden" in k), None) or next(iter(inputs.values()), None)
        if not hidden or len(hidden) != 3:
            return None
        kind = "block_forward" if row["part"] == "inf" else "block"
        return GraphRequest(kind, hidden[0], hidden[1])
    return None


def executed_entry(folder: Path, job: JobShape, since: float = 0.0) -> dict:
    """The run's executed graphs (:func:`read_stats`) counted (:func:`verl_backend.tpu_on_cpu.aggregate`) and set
    against the plan (:func:`planned_shapes`), from the stats written at or after ``since``: the aggregate plus ``"outside_plan"``: the names of the distinct
    graphs whose shapes the plan does not allow (or whose shapes this cannot read), ``"eager_lines"``: the first
    reason of each kind a graph ran as torch eager, and ``"line"``: one line for the console."""
    from verl_backend.tpu_on_cpu import aggregate

    rows = read_stats(folder, since)
    entry = aggregate(rows)
    plan = planned_shapes(job)
    outside, seen = [], set()
    for row in rows:
        request = graph_request(row)
        name = request.name if request else f"{row['region']}.{row['part']} {row.get('inputs')}"
        if name in seen:
            continue
        seen.add(name)
        if request is None or (request.batch, request.seq, request.cache) not in plan.get(request.kind, set()):
            outside.append(name)
    eager = list(dict.fromkeys(row["lowered"][len("eager: ") :] for row in rows if row["lowered"] != "xla-cpu"))
    kinds = ", ".join(
        f"{kind} {v['distinct']} ({v['executions']} runs)" for kind, v in sorted(entry["by_kind"].items())
    )
    line = (
        f"{entry['distinct']} distinct graphs ({entry['traced']} traced in {len({r['process'] for r in rows})} "
        f"processes) ran {entry['executions']} times as TorchTPU's StableHLO on XLA:CPU: {kinds or 'none'}; "
        f"{len(outside)} outside the bucket plan{': ' + ', '.join(outside[:4]) if outside else ''}; "
        f"{entry['eager']} ran as torch eager; lowering {entry['lower_s']:.0f} s, XLA:CPU compile "
        f"{entry['compile_s']:.0f} s, execution {entry['run_s']:.0f} s, DLPack {entry['copy_s']:.1f} s"
    )
    return {**entry, "outside_plan": outside, "eager_lines": eager[:5], "line": line}


#: per chip generation: inter-chip interconnect bandwidth, bytes/s, from the Cloud TPU "TPU versions" pages
#: (v4 2,400 Gbps, v5e 1,600 Gbps, v5p 4,800 Gbps, v6e 3,584 Gbps per chip); v7x's is not listed there: no estimate
ICI_BYTES_PER_S = {"v4": 2400e9 / 8, "v5litepod": 1600e9 / 8, "v5p": 4800e9 / 8, "v6e": 3584e9 / 8}


def collective_bytes(job: JobShape, params: int) -> dict[str, float]:
    """FSDP2's all-gathers and reduce-scatters of one training step, bytes each chip sends (a ring moves
    ``(n - 1) / n`` of the full tensor), which sit in no graph: per update micro batch two all-gathers of the bf16
    parameters (forward, and again for the backward: FSDP2 reshards after the forward) and one reduce-scatter of
    the fp32 gradients; per log-prob micro batch one all-gather (old policy; the reference policy's too); one
    all-gather of the weights for the in-worker rollout's sync. ``params``: the model's parameter count."""
    n = max(1, job.shards)
    ring = (n - 1) / n
    share = job.train_batch_size * job.rollout_n / max(1, job.data_parallel)  # sequences a chip trains per step
    updates = share / max(1, job.update_micro_batch) * max(1, getattr(job, "ppo_epochs", 1) or 1)
    forwards = (share / max(1, job.log_prob_micro_batch)) if job.old_log_probs else 0.0
    if job.reference:
        forwards += share / max(1, job.ref_log_prob_micro_batch)
    bf16, fp32 = 2 * params, 4 * params
    return {
        "update_all_gather": ring * updates * 2 * bf16,
        "update_reduce_scatter": ring * updates * fp32,
        "log_prob_all_gather": ring * forwards * bf16,
        "weight_sync_all_gather": ring * bf16,
    }


def step_estimate(folder: Path, rows: list[dict], job: JobShape, slice_name: str, steps: int, params: int) -> dict:
    """An estimated training step on the slice's chip: each distinct graph the run executed compiled by libtpu for
    the slice's topology (deviceless, :mod:`verl_backend.driver.aot.compile`) and counted at its roofline bound,
    ``max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)`` (:data:`verl_backend.driver.aot.run.CHIP_PEAKS`), as many
    times as it ran per step on one chip (its executions over the processes and the ``steps``, validation's
    included); plus FSDP2's collectives at their bytes over the chip's ICI bandwidth (:func:`collective_bytes`,
    :data:`ICI_BYTES_PER_S`). Not counted: the eager ops between the graphs (on a chip each is a launch of its own).
    Attention is the graphs' math SDPA (on a chip TorchTPU's Mosaic flash kernel, which XLA's cost analysis cannot
    see). Returns ``{"generation", "topology", "graphs_s", "collectives_s", "step_s", "graphs": [{"graph", "bound_s",
    "runs_per_step"}], "error"}`` (seconds); ``error`` one line where libtpu could not compile a graph.

    Raises:
        verl_backend.driver.aot.run.AotError: no torch-tpu, or the compile subprocess failed (one line).
    """
    from verl_backend.driver.aot.run import CHIP_PEAKS, _env, _run, aot_python, jax_topology

    topology, generation, _ = jax_topology(slice_name)
    peak_flops, bandwidth = CHIP_PEAKS[generation]
    processes = max(1, len({r["process"] for r in rows}))
    runs: dict[str, int] = {}
    names: dict[str, str] = {}
    for row in rows:
        if row["lowered"] != "xla-cpu":
            continue
        runs[row["key"]] = runs.get(row["key"], 0) + row["runs"]
        request = graph_request(row)
        names.setdefault(row["key"], f"{request.name if request else row['region']}.{row['part']}")
    keys = [k for k in runs if (Path(folder) / f"{k}.mlir").is_file()]
    lowered = [
        {"graph": names[k], "file": str(Path(folder) / f"{k}.mlir"), "label": "executed", "kind": "executed"}
        for k in keys
    ]
    work = Path(folder) / "estimate"
    work.mkdir(parents=True, exist_ok=True)
    (work / "lowered.json").write_text(json.dumps(lowered))
    out = work / f"compiled-{topology.replace(':', '_')}.json"
    _run(
        [aot_python(), "-m", "verl_backend.driver.aot.compile", str(work / "lowered.json"), topology, str(out)],
        f"libtpu's compile for {topology} (subprocess)",
        1800,
        work / "compile.log",
        _env({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
    )
    compiled = json.loads(out.read_text())
    per_graph, errors = [], []
    by_name = {rec["graph"]: key for key, rec in zip(keys, lowered)}
    for g in compiled.get("graphs", []):
        if g.get("error"):
            errors.append(g["error"])
            continue
        bound = max(g["flops"] / peak_flops, g["bytes_accessed"] / bandwidth)
        per_step = runs[by_name[g["graph"]]] / processes / max(1, steps)
        per_graph.append({"graph": g["graph"], "bound_s": bound, "runs_per_step": per_step})
    graphs_s = sum(g["bound_s"] * g["runs_per_step"] for g in per_graph)
    ici = ICI_BYTES_PER_S.get(generation)
    collectives_s = sum(collective_bytes(job, params).values()) / ici if ici else None
    return {
        "generation": generation,
        "topology": topology,
        "graphs_s": graphs_s,
        "collectives_s": collectives_s,
        "step_s": graphs_s + (collectives_s or 0.0),
        "graphs": sorted(per_graph, key=lambda g: -g["bound_s"] * g["runs_per_step"]),
        "error": compiled.get("error") or (errors[0] if errors else None),
    }
