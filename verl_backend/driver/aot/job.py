"""The ``--aot-only`` step of ``verl train``: the composed TPU job's graphs, lowered and compiled for its slice, as
tables on stdout (see :mod:`verl_backend.driver.aot.run`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from verl_backend.driver.aot.graphs import config_get as _get
from verl_backend.driver.aot.graphs import SAMPLER_KINDS, job_graphs, job_workers
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


def aot_jobs(config, workers: int, attention: str = "sdpa", model_path: str | None = None) -> list[dict]:
    """The lowering subprocess's ``jobs`` for a composed VeRL ``config``: the trainer's graphs in its FSDP
    ``param_dtype`` (VeRL's default bf16) and the sampler's in ``rollout.dtype``; the model is ``model_path``'s
    config.json when given, else the job's ``actor_rollout_ref.model.path``."""
    cfg = model_config(str(model_path or _get(config, "actor_rollout_ref.model.path")))
    model_type = cfg.get("model_type")
    if not model_type:
        raise AotError("the model's config.json has no model_type")
    train_dtype = _DTYPES.get(
        str(_get(config, "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", "bf16")), "bfloat16"
    )
    sample_dtype = _DTYPES.get(str(_get(config, "actor_rollout_ref.rollout.dtype", "bfloat16")), "bfloat16")
    graphs = [dataclasses.asdict(g) for g in job_graphs(config, workers)]
    trainer = [g for g in graphs if g["kind"] not in SAMPLER_KINDS]  # the actor's, the reference's, the critic's
    sampler = [g for g in graphs if g["kind"] in SAMPLER_KINDS]
    base = {"config": cfg, "model_type": model_type, "attention": attention}
    return [
        {**base, "label": "trainer", "dtype": train_dtype, "graphs": trainer},
        {**base, "label": "sampler", "dtype": sample_dtype, "graphs": sampler},
    ]


def run_aot_only(config, slice_name: str | None, folder: Path | None = None, model_path: str | None = None) -> int:
    """Lower and compile the job's graphs for ``slice_name`` (e.g. ``v6e-8``) and print the tables; ``model_path``:
    a folder whose config.json replaces the job's model (``actor_rollout_ref.model.path=`` given to ``--aot-only``,
    which needs no weights).

    Returns:
        0 when every graph lowered and compiled, 1 when some did not (each said in one line).
    Raises:
        AotError: no slice, torch-tpu missing, a chip libtpu does not know, a subprocess that crashed.
    """
    if not slice_name:
        raise AotError("--aot-only compiles for a slice's chip: give --slice, e.g. --slice v6e-8")
    topo, generation, hbm_gib = jax_topology(slice_name)
    jobs = aot_jobs(config, job_workers(config), model_path=model_path)
    print(
        f"[rl-tpu] --aot-only: lowering {sum(len(j['graphs']) for j in jobs)} graph shapes of "
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
    checkpointed = bool(_get(config, "actor_rollout_ref.model.enable_gradient_checkpointing", True))
    chip = per_chip_bytes(compiled, layers, checkpointed)
    hbm = hbm_gib * 2**30
    kept = "gradient checkpointing: each block's input" if checkpointed else "every block's saved tensors"
    print(
        f"per chip, from XLA ({kept}): {layers} blocks' saved activations {chip['saved_activations'] / 2**30:.2f} GiB + "
        f"largest trainer graph {chip['largest_trainer_graph'] / 2**30:.2f} GiB = "
        f"{chip['training_peak'] / 2**30:.2f} GiB ({100 * chip['training_peak'] / hbm:.0f}% of {hbm_gib:g} GiB "
        f"HBM); largest sampler graph {chip['largest_sampler_graph'] / 2**30:.2f} GiB "
        f"({100 * chip['largest_sampler_graph'] / hbm:.0f}%); StableHLO and logs in {result.folder}"
    )
    print(plan_lines(config, slice_name, compiled, checkpointed, model_path))
    failed = errors(result)
    for line in failed:
        print(f"[rl-tpu] {line}")
    return 1 if failed else 0


def planned_as_compiled(config, workers: int):
    """A copy of ``config`` for the memory plan of the job ``--aot-only`` compiles: ``rl_tpu.compile_trainer`` and
    ``rl_tpu.compile_sampler`` on (the graphs are compiled with both, whatever the job says), and the actor's micro
    batch the graphs use (:func:`~verl_backend.driver.aot.graphs.job_graphs`) where the config has none. Returns
    ``(config, notes)``: a line for each key set here."""
    import copy

    from omegaconf import OmegaConf

    planned = copy.deepcopy(config) if OmegaConf.is_config(config) else OmegaConf.create(config)
    OmegaConf.set_struct(planned, False)
    notes = []
    for key in ("rl_tpu.compile_trainer", "rl_tpu.compile_sampler"):
        if not _get(planned, key, False):
            OmegaConf.update(planned, key, True, force_add=True)
            notes.append(f"{key}=true")
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    if not _get(planned, micro, None):
        block = next(g for g in job_graphs(planned, workers) if g.kind == "block")
        OmegaConf.update(planned, micro, block.batch, force_add=True)
        notes.append(f"{micro}={block.batch} (the graphs' micro batch; the job sets none)")
    return planned, notes


def plan_lines(config, slice_name: str, compiled: dict, checkpointed: bool, model_path: str | None = None) -> str:
    """The memory plan (``--print-config``'s, for the job as compiled: :func:`planned_as_compiled`) beside XLA's
    compiled bytes, term by term (:func:`plan_comparison`), with the ratio plan / XLA, as text; one line saying why
    when the plan cannot be made."""
    try:
        from transformers import AutoConfig

        from verl_backend.driver.memory_plan import plan_memory
        from verl_backend.driver.profiles import profile

        hf = AutoConfig.from_pretrained(model_path) if model_path else None
        planned, notes = planned_as_compiled(config, job_workers(config))
        plan = plan_memory(planned, slice_name, profile("tpu"), hf_config=hf)
    except Exception as exc:  # the plan is a comparison here, never a reason to fail the compile report
        return f"memory plan: not made ({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]})"
    return comparison_table(plan_comparison(plan, compiled, checkpointed), notes)


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
