"""What ``verl train`` does with the job's memory plan (:mod:`verl_backend.driver.memory_plan`) before anything
starts: ``--print-config`` shows it (:func:`show_memory_plan`); a TPU job past its chips' HBM, or a CPU job past this
host's memory, is refused in one line naming the biggest term and the fixes (:func:`check_memory_fits`); a CPU job
that fits only without the rollout's packed weights runs without them, said in one line (:func:`fit_packed_weights`).

All sizes are bytes unless a name says GiB (2**30 bytes).
"""

from __future__ import annotations

import os

from verl_backend.driver.memory_plan import GIB, USABLE_FRACTION, MemoryPlan, config_value, plan_memory, resolve_slice
from verl_backend.errors import BadInputError
from verl_backend.rollout.native_kwargs import native_engine_kwargs


#: how each phase of the CPU job's host peak (MemoryPlan.host_phase) reads in a line
HOST_PHASES = {
    "update": "the trainer updates",
    "generation": "the rollout generates",
    "sync": "the rollout takes a LoRA adapter",
}


def refusal(plan: MemoryPlan, model_path: str, slice_name: str, bigger: tuple[str, float] | None) -> str:
    """One line: the model, the slice, the estimate against usable HBM, the biggest term and the fixes."""
    big = plan.biggest
    more = f"more chips ({bigger[0]}: {bigger[1] / GIB:.1f} GiB per chip)" if bigger else "a generation with more HBM"
    fixes = [more]
    if plan.term("parameters") or plan.term("optimizer"):
        fixes.append("actor_rollout_ref.actor.fsdp_config.param_offload/optimizer_offload=true")
    fixes.append("a smaller actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    if "checkpointed" not in next(t.how for t in plan.terms if t.name == "activations"):
        fixes.append("actor_rollout_ref.model.enable_gradient_checkpointing=true")
    return (
        f"memory plan: {plan.model.name} ({model_path}) on {slice_name} needs about {plan.peak / GIB:.1f} GiB per "
        f"chip, over the {plan.usable_bytes / GIB:.1f} GiB usable ({USABLE_FRACTION:.0%} of {plan.hbm_bytes / GIB:g}"
        f" GiB HBM); biggest term: {big.name} {big.bytes / GIB:.1f} GiB. Fix: {', '.join(fixes[:-1])} or "
        f"{fixes[-1]} (`verl train --print-config` shows the table)"
    )


def _memory_plan(config, slice_name: str | None, backend):
    """The job's :class:`~verl_backend.driver.memory_plan.MemoryPlan`, or ``None`` (with the reason) when the model's
    config.json cannot be read (the model folder check names that)."""
    try:
        return plan_memory(config, slice_name or None, backend), ""
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def show_memory_plan(config, slice_name: str | None, backend) -> None:
    """``--print-config``: print the per-chip memory plan under the config when the job has a slice or runs on TPU,
    as YAML comment lines (``# ``), so that the output still loads as the config."""
    if not (slice_name or backend.tpu_runtime or backend.host_memory):
        return
    plan, why = _memory_plan(config, slice_name, backend)
    text = plan.format() if plan is not None else f"memory plan: not made ({why})"
    if plan is not None and backend.host_memory:
        host = host_memory_bytes()
        need = plan.host_need
        verdict = "fits" if need <= host * USABLE_FRACTION else "DOES NOT FIT"
        phase = HOST_PHASES[plan.host_phase]
        text += (
            f"\n  this host: {plan.workers} trainer worker(s) x {plan.peak / GIB:.3f} GiB at their peak; with the "
            f"rollout server and the job's other processes the whole job = {need / GIB:.3f} GiB at its peak "
            f"(while {phase}) against {USABLE_FRACTION:.0%} of {host / GIB:.1f} GiB: {verdict}"
        )
    print("\n".join(f"# {line}" for line in text.splitlines()))


def host_memory_bytes() -> float:
    """This host's memory in bytes: ``MemTotal``, or the cgroup's ``memory.max`` when that is lower (a container)."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, float(limit))
    except OSError:
        pass
    return total


def host_refusal(plan: MemoryPlan, model_path: str, host_bytes: float) -> str | None:
    """One line when the whole CPU job (its trainer workers, the rollout server's copy, every process's runtime:
    :attr:`MemoryPlan.host_need`), all on this host, passes :data:`USABLE_FRACTION` of its memory (``None``: it
    fits)."""
    need, usable = plan.host_need, host_bytes * USABLE_FRACTION
    if need <= usable:
        return None
    big = plan.biggest
    fixes = []
    if plan.term("gradients") == plan.term("parameters"):  # full fine-tuning
        fixes.append("actor_rollout_ref.model.lora_rank=16 (LoRA: gradients and AdamW moments for the adapter only)")
    if any(t.name.startswith("reference policy") and t.bytes for t in plan.terms):
        fixes.append("actor_rollout_ref.actor.use_kl_loss=false (no reference copy)")
    fixes.append("a smaller actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    if "checkpointed" not in next(t.how for t in plan.terms if t.name == "activations"):
        fixes.append("actor_rollout_ref.model.enable_gradient_checkpointing=true")
    fixes.append("a host with more memory")
    phase = HOST_PHASES[plan.host_phase]
    return (
        f"memory plan: {plan.model.name} ({model_path}) needs about {need / GIB:.1f} GiB on this host "
        f"({plan.workers} trainer worker(s) x {plan.peak / GIB:.1f} GiB at their peak, the rollout server and the "
        f"job's other processes; the whole job's peak is while {phase}), over the {usable / GIB:.1f} GiB usable "
        f"({USABLE_FRACTION:.0%} of {host_bytes / GIB:.1f} GiB); biggest term: {big.name} {big.bytes / GIB:.1f} "
        f"GiB. Fix: {'; '.join(fixes)} (`verl train --print-config` shows the table)"
    )


def fit_packed_weights(config, backend, host_bytes: float | None = None) -> str | None:
    """A CPU job that passes this host's memory only because of the rollout's packed weights (a packed copy of every
    float32 linear layer while it generates, :mod:`rl_tpu.sampler.packed`: 6.5 GiB for a 1.5 B model) runs without
    them: ``actor_rollout_ref.rollout.engine_kwargs.native.packed_weights`` is set false in ``config`` (decode on the
    plain weights, slower). Left alone when the job fits, when it does not fit either way, or when the key was given.
    ``host_bytes``: the host's memory (``None``: :func:`host_memory_bytes`).

    Returns:
        The one line said to the user when it turned them off, else ``None``.
    """
    if not backend.host_memory:
        return None
    rollout = config_value(config, "actor_rollout_ref.rollout", {})
    try:
        given = native_engine_kwargs(rollout).packed_weights
    except ValueError:  # refused in one line by preflight.check_native_rollout
        return None
    if str(config_value(config, "actor_rollout_ref.rollout.name", "")) != "native" or given is not None:
        return None
    plan, _ = _memory_plan(config, None, backend)
    if plan is None:
        return None
    usable = (host_memory_bytes() if host_bytes is None else host_bytes) * USABLE_FRACTION
    packed = sum(t.bytes for t in plan.host_terms if t.name == "rollout server packed weights")
    if not packed or plan.host_need <= usable:
        return None
    from omegaconf import OmegaConf, open_dict

    with open_dict(config):
        OmegaConf.update(config, "actor_rollout_ref.rollout.engine_kwargs.native.packed_weights", False, force_add=True)
    after = plan_memory(config, None, backend, hf_config=plan.model)
    if after.host_need > usable:  # no help: put it back, the refusal names the real fixes
        with open_dict(config):
            del config.actor_rollout_ref.rollout.engine_kwargs.native["packed_weights"]
        return None
    return (
        f"[rl-tpu] memory plan: {plan.model.name} would need {plan.host_need / GIB:.1f} GiB of this host's "
        f"{usable / GIB:.1f} usable with the rollout's packed weights ({packed / GIB:.1f} GiB while it generates): "
        f"sampling on the plain weights instead ({after.host_need / GIB:.1f} GiB; decode is slower). "
        "actor_rollout_ref.rollout.engine_kwargs.native.packed_weights=true keeps them"
    )


def check_memory_fits(config, slice_name: str | None, backend) -> None:
    """Refuse, before anything starts, a TPU job whose estimated per-chip peak passes the usable part of the chip's
    HBM (:data:`USABLE_FRACTION`), or a CPU job whose trainer workers together pass it of this host's memory
    (:func:`host_refusal`; the CPU backend's fake slices included: their workers are host processes).

    Raises:
        BadInputError: one line naming the model, the slice or host, the estimate against the memory, the biggest
            term, the smallest larger slice of the same generation that fits (TPU, if any) and the other fixes.
    """
    if backend.host_memory:
        plan, _ = _memory_plan(config, None, backend)
        reason = plan and host_refusal(plan, str(config.actor_rollout_ref.model.path), host_memory_bytes())
        if reason:
            raise BadInputError(reason)
        return
    if not (backend.tpu_runtime and slice_name):
        return
    from rl_tpu.topology import accelerator_types, parse_slice

    plan, _ = _memory_plan(config, slice_name, backend)
    if plan is None or plan.fits is not False:
        return
    spec = resolve_slice(slice_name)
    bigger = None
    for name in accelerator_types(spec.generation):
        other = parse_slice(name)
        if other.chips > spec.chips:
            est = plan_memory(config, other, backend, hf_config=plan.model, workers=other.chips)
            if est.fits:
                bigger = (name, est.peak)
                break
    raise BadInputError(refusal(plan, str(config.actor_rollout_ref.model.path), spec.accelerator_type, bigger))
