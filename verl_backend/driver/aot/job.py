"""The ``--aot-only`` step of ``verl train``: the composed TPU job's graphs, lowered and compiled for its slice, as
tables on stdout (see :mod:`verl_backend.driver.aot.run`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from verl_backend.driver.aot.graphs import SAMPLER_KINDS, GraphRequest, job_graphs, planned_graphs
from verl_backend.driver.job_shape import JobShape, job_shape
from verl_backend.driver.aot.run import (
    AotError,
    errors,
    jax_topology,
    lower_and_compile,
    per_chip_bytes,
    plan_comparison,
    table,
)

_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
}


def model_config(path: str) -> dict:
    """The ``config.json`` of the model folder ``path`` (no weights are read).

    Raises:
        AotError: no ``config.json`` there.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise AotError(
            f"--aot-only builds the model from its config.json, and {path} has none: give "
            "actor_rollout_ref.model.path=<folder with config.json>"
        )
    return json.loads(file.read_text())


def aot_jobs(
    job: JobShape,
    attention: str = "sdpa",
    model_path: str | None = None,
    requests: list[GraphRequest] | None = None,
) -> list[dict]:
    """The lowering subprocess's ``jobs`` for a job's :class:`~verl_backend.driver.job_shape.JobShape`: the trainer's
    graphs in its FSDP ``param_dtype`` (VeRL's default bf16) and the sampler's in the rollout's dtype; the model is
    ``model_path``'s config.json when given, else the job's; the graphs are ``requests`` when given, else the job's
    largest of each kind (:func:`~verl_backend.driver.aot.graphs.job_graphs`)."""
    cfg = model_config(str(model_path or job.model_path))
    model_type = cfg.get("model_type")
    if not model_type:
        raise AotError("the model's config.json has no model_type")
    train_dtype = _DTYPES.get(job.param_dtype, "bfloat16")
    sample_dtype = _DTYPES.get(job.rollout_dtype, "bfloat16")
    graphs = [dataclasses.asdict(g) for g in (job_graphs(job) if requests is None else requests)]
    trainer = [g for g in graphs if g["kind"] not in SAMPLER_KINDS]  # the actor's, the reference's, the critic's
    sampler = [g for g in graphs if g["kind"] in SAMPLER_KINDS]
    base = {"config": cfg, "model_type": model_type, "attention": attention}
    return [
        {**base, "label": "trainer", "dtype": train_dtype, "graphs": trainer},
        {**base, "label": "sampler", "dtype": sample_dtype, "graphs": sampler},
    ]


def run_aot_only(
    config,
    slice_name: str | None,
    folder: Path | None = None,
    model_path: str | None = None,
    all_buckets: bool = False,
) -> int:
    """Lower and compile the job's graphs for ``slice_name`` (e.g. ``v6e-8``) and print the tables; ``model_path``:
    a folder whose config.json replaces the job's model (``actor_rollout_ref.model.path=`` given to ``--aot-only``,
    which needs no weights); ``all_buckets`` (``--aot-all-buckets``): every graph the job's bucket plan allows
    (:func:`~verl_backend.driver.aot.graphs.planned_graphs`), not only the largest of each kind.

    Returns:
        0 when every graph lowered and compiled, 1 when some did not (each said in one line).
    Raises:
        AotError: no slice, torch-tpu missing, a chip libtpu does not know, a subprocess that crashed.
    """
    if not slice_name:
        raise AotError("--aot-only compiles for a slice's chip: give --slice, e.g. --slice v6e-8")
    topo, generation, hbm_gib = jax_topology(slice_name)
    job = job_shape(config)
    jobs = aot_jobs(job, model_path=model_path, requests=planned_graphs(job) if all_buckets else None)
    which = "every bucket the plan allows: " if all_buckets else ""
    print(
        f"[rl-tpu] --aot-only: lowering {which}{sum(len(j['graphs']) for j in jobs)} graph shapes of "
        f"{jobs[0]['model_type']} with TorchTPU, compiling for {slice_name} ({topo}) with libtpu, no chip",
        flush=True,
    )
    result = lower_and_compile(jobs, [topo], folder)
    compiled = result.compiled[topo]
    if compiled.get("error"):
        raise AotError(compiled["error"])
    mosaic = {r["graph"]: bool(r.get("mosaic")) for r in result.lowered}
    print(table(compiled, generation, mosaic))
    note = (
        "* Mosaic attention kernel (tpu_custom_call): left out of XLA's FLOPs and bytes"
        if any(mosaic.values())
        else "attention lowered as XLA ops (no Mosaic tpu_custom_call): counted in FLOPs and bytes"
    )
    print(f"bound ms: max(FLOPs / peak, bytes / HBM bandwidth) at {generation}'s peaks; {note}")
    layers = int(jobs[0]["config"].get("num_hidden_layers", 1))
    checkpointed = job.gradient_checkpointing
    chip = per_chip_bytes(compiled, layers, checkpointed)
    hbm = hbm_gib * 2**30
    kept = "gradient checkpointing: each block's input" if checkpointed else "every block's saved tensors"
    print(
        f"per chip, from XLA ({kept}): {layers} blocks' saved activations "
        f"{chip['saved_activations'] / 2**30:.2f} GiB + "
        f"largest trainer graph {chip['largest_trainer_graph'] / 2**30:.2f} GiB = "
        f"{chip['training_peak'] / 2**30:.2f} GiB ({100 * chip['training_peak'] / hbm:.0f}% of {hbm_gib:g} GiB "
        f"HBM); largest sampler graph {chip['largest_sampler_graph'] / 2**30:.2f} GiB "
        f"({100 * chip['largest_sampler_graph'] / hbm:.0f}%); StableHLO and logs in {result.folder}"
    )
    print(plan_lines(job, slice_name, compiled, model_path))
    failed = errors(result)
    for line in failed:
        print(f"[rl-tpu] {line}")
    return 1 if failed else 0


def planned_as_compiled(job: JobShape) -> tuple[JobShape, list[str]]:
    """The job ``--aot-only`` compiles, for its memory plan: ``rl_tpu.compile_trainer`` on (the graphs are compiled
    whatever the job says; the sampler's too, which the plan counts from its placement). Returns ``(job, notes)``: a
    line for each setting changed here."""
    if job.compile_trainer:
        return job, []
    return dataclasses.replace(job, compile_trainer=True), ["rl_tpu.compile_trainer=true"]


def plan_lines(job: JobShape, slice_name: str, compiled: dict, model_path: str | None = None) -> str:
    """The memory plan (``--print-config``'s, for the job as compiled: :func:`planned_as_compiled`) beside XLA's
    compiled bytes, term by term (:func:`plan_comparison`), with the ratio plan / XLA, as text; one line saying why
    when the plan cannot be made."""
    try:
        from transformers import AutoConfig

        from verl_backend.driver.memory_plan import plan_memory
        from verl_backend.driver.profiles import profile

        hf = AutoConfig.from_pretrained(model_path) if model_path else None
        planned, notes = planned_as_compiled(job)
        plan = plan_memory(planned, slice_name, profile("tpu"), hf_config=hf)
    except Exception as exc:  # the plan is a comparison here, never a reason to fail the compile report
        return f"memory plan: not made ({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]})"
    return comparison_table(plan_comparison(plan, compiled, job.gradient_checkpointing), notes)


def comparison_table(rows: list[tuple[str, float | None, float | None, str]], notes: list[str] = ()) -> str:
    """:func:`plan_comparison`'s rows as text: term, plan GiB, XLA GiB, plan / XLA, what XLA's number is."""
    table = [("term", "plan GiB", "XLA GiB", "plan/XLA", "XLA's number")]
    for name, plan, xla, how in rows:
        ratio = "" if xla is None else (f"{plan / xla:.2f}" if xla else "inf" if plan else "1.00")
        table.append((name, f"{plan / 2**30:.3f}", "-" if xla is None else f"{xla / 2**30:.3f}", ratio, how))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = [
        "memory plan (verl train --print-config) beside XLA's compiled bytes, per chip"
        + (f" (planned with {', '.join(notes)})" if notes else "")
        + ":"
    ]
    lines += [
        "  " + "  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:4], widths[1:])), r[4]])
        for r in table
    ]
    return "\n".join(lines)
