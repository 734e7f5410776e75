"""Per-chip memory plan of a ``verl train`` job: what each chip (TPU) or worker process (CPU) holds, before a run.

:func:`plan_memory` reads the composed VeRL config and the model's ``config.json`` (no weights: parameters are counted
on a meta-device model, ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``, so every family is counted
exactly) and returns a :class:`MemoryPlan`: bytes per chip for each term, the peak, and the chip's HBM from
:mod:`rl_tpu.topology`. All sizes are bytes unless a name says GiB (2**30 bytes).

Terms and formulas (P: parameters, P_t: trainable ones, S: FSDP shards = the trainer's workers unless
``fsdp_config.fsdp_size`` says otherwise; b(x): bytes of dtype x):

- resident all run long: parameters ``P·b(model_dtype)/S``, gradients ``P_t·b(model_dtype)/S``, AdamW's two moments
  ``2·P_t·b(model_dtype)/S`` (torch keeps them in the parameter's dtype, fp32 by VeRL's default); the reference policy
  ``P·b(ref model_dtype)/S`` when a KL loss or penalty is on (none with LoRA: the base model is the reference); the
  critic's parameters, gradients and moments under PPO/GAE; with the sampler inside the worker (TPU:
  ``sampler_placement=worker``) its own unsharded copy ``P·b(rollout.dtype)``. Offloaded terms are 0.
- the update (actor micro batch of B sequences, N tokens):
  FSDP2's all-gather buffers: ``root·b(param_dtype) + 2 blocks·(b(param_dtype) + b(reduce_dtype))`` with tied
  embeddings (the root module stays gathered through the step; a block and the prefetched one, parameters and
  unsharded gradients), ``(max(block, V·h) + block)·(b(param_dtype) + b(reduce_dtype))`` untied (VeRL's
  ``apply_fsdp2`` then shards embedding and LM head apart); none on one plain (unwrapped) CPU rank.
  Activations saved for the backward, per token and block: the terms of Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv:2205.05198, §4.1, eq. 1: ``sbh(34 + 5as/h)`` bytes per layer for
  GPT at 16 bits) counted for this model's own widths, without dropout: ``4h + 2q + 2kv + 4I`` elements (two norm
  inputs, the QKV input, Q and K after RoPE, V, the output projection's input; SwiGLU's gate, up, act(gate) and
  product; ``q``/``kv`` the query and key/value widths, ``I`` the MLP width; a mixture of experts has
  ``E + k(h + 4I_e)`` for its MLP, k active of E experts), plus ``q + kv`` with query/key norms (Qwen3) and ``a·s``
  softmax outputs when attention is not fused (assumed on TPU); times ``L`` blocks, plus ``2h`` for the final norm,
  times ``b(param_dtype)``. With gradient checkpointing only each block's input ``h`` is kept, plus one block
  recomputed. The LM head's logits: ``tokens·V·(b(param_dtype) + 4 + 4)`` (its output, the fp32 log-softmax kept for
  the backward, its fp32 gradient), over response tokens only when the micro batch is packed and
  ``rl_tpu.response_only_logits`` is on.
- the log-prob forward (reference / old policy, no gradients): logits ``tokens·V·(b + 4)`` and one block's working set.
- generation (sampler in the worker): the KV cache ``2·L·kv·(prompt+response)·batch·b(rollout.dtype)``, the batch
  being the worker's share of ``train_batch_size·n`` up to ``rollout.max_num_seqs``, padded to a power of two, as the
  sampler's static buckets do (:mod:`rl_tpu.sampler.engine`), plus its last-position logits ``batch·V·4``.

On TPU (the profile's ``tpu_runtime``, padded micro batches) the update and generation terms are instead what the
job's compiled graphs hold, array by array, each sized as the TPU lays it out
(:func:`~verl_backend.driver.model_shape.tpu_bytes`: XLA pads the two minor dimensions it picks to 8x128 tiles), at
the micro batch's padded length (the power-of-two bucket with ``rl_tpu.compile_trainer``): ``activations`` is
``L`` block inputs plus one block's forward outputs (the tensors autograd saves for each op's backward with attention
as XLA ops in fp32, and the inputs and parameters the graph returns, which XLA copies) plus the rotary tables and
mask (:meth:`~verl_backend.driver.model_shape.ModelShape.block_graph`); ``LM head logits`` the LM head forward's
outputs (fp32 log-softmax, the head's input and weight) and its bf16 logits (``head_graph``); ``update
temporaries`` an upper bound on a block graph's (two fp32 score-sized arrays, the MLP's and q/k/v gradients); the
sampler's weights and KV cache are its decode step's arguments, ``sampler step outputs`` its results (the logits and
the rewritten cache: the cache arguments are not donated), ``sampler temporaries`` the prefill's or decode step's
(``sampler_graph``, ``sampler_temporaries``). ``verl train --aot-only`` prints these beside XLA's compiled numbers
(:func:`verl_backend.driver.aot.run.plan_comparison`, docs/tpu.md).

The peak is the resident sum plus the largest phase (update, log-prob, critic update, generation), which never
overlap in time. The python process, the runtime and XLA's own buffers are not counted: :data:`USABLE_FRACTION` of
the chip's HBM is what the plan may fill.

On the CPU backend every process of the job shares the host's memory, so the plan also counts what the other
processes hold (:attr:`MemoryPlan.host_terms`, :attr:`MemoryPlan.host_need`): the rollout server's own copy of the
weights ``P·b(rollout.dtype)`` (unless the sampler runs inside the worker), each trainer worker's runtime
(:data:`TRAINER_RUNTIME_BYTES`: Python, torch, VeRL and transformers, beyond the plan's tensors) and the job's fixed
processes (:data:`JOB_RUNTIME_BYTES`: the driver, Ray's daemons and VeRL's agent-loop, reward-loop, load-balancer and
transfer-queue actors). Both constants are measured (proportional set size at the job's peak,
``benchmarks/bench_scale.py``'s ``pss_at_peak_gib_by_role``, SmolLM2-135M, 2026-12-05). While the server generates
it also holds the sampler's packed copies (``rl_tpu.sampler.packed``: every float32 linear layer, the LM head's too,
and the query/key/value projections once more fused; ``packed_weights`` off: none) and its KV cache at
``min(pow2(train_batch_size·n), pow2(max_num_seqs))`` sequences; the trainer workers then hold their resident terms
less gradients. Under LoRA with adapter-only syncs the server, woken after the update, refills its released weights
from the model's safetensors and merges the adapter onto them with the files mapped: a third phase, ``sync``, the
files' size beside the trainer's resident terms less gradients. The host need is the largest phase
(:attr:`MemoryPlan.host_need`): within 4% of the measured peak of the 135M, 360M, 0.49B and both 1.51B-with-LoRA rows
of docs/scale.md (packed weights on: generation; off: sync).

What ``verl train`` does with the plan (print it, refuse a job that does not fit, sample without packed weights) is
:mod:`verl_backend.driver.memory_fit`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from verl_backend.driver.job_shape import JobShape, job_shape
from verl_backend.driver.model_shape import ModelShape, arrays_bytes, model_shape, shape_of_path, tpu_bytes

GIB = float(1 << 30)
USABLE_FRACTION = 0.9  # of a chip's HBM; the rest for the TPU runtime, XLA's scratch buffers and fragmentation
#: per trainer worker process on the CPU backend, beyond its tensors: the measured PSS of VeRL's WorkerDict at the
#: 135M job's peak (3.61 GiB) less the plan's terms for it (3.08 GiB)
TRAINER_RUNTIME_BYTES = 0.54 * GIB
#: the CPU job's processes that hold no model: the driver (0.48 GiB), VeRL's agent-loop, reward-loop, load-balancer
#: and transfer-queue actors (0.80) and Ray's daemons (GCS, raylet, dashboard and its agent, monitors: 0.41)
JOB_RUNTIME_BYTES = 1.69 * GIB
_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class Term:
    """One line of the plan: ``bytes`` per chip, held ``when`` (resident, update, log-prob, critic, generation)."""

    name: str
    bytes: float
    when: str
    how: str


@dataclass
class MemoryPlan:
    """Per-chip memory of a job (bytes), against the chip's HBM.

    Attributes:
        model: the model's :class:`ModelShape`; ``where``: the slice or device (``v6e-4 (4 chips)``, ``cpu``).
        workers: trainer workers (one per chip on TPU); ``shards``: FSDP shards of the parameters.
        terms: the :class:`Term` rows.
        hbm_bytes: one chip's HBM (``None`` off TPU slices: nothing to compare with).
        notes: assumptions worth a line under the table.
    """

    model: ModelShape
    where: str
    workers: int
    shards: int
    terms: list[Term]
    hbm_bytes: float | None = None
    notes: list[str] = field(default_factory=list)
    #: TPU only: what the plan expects each kind of compiled graph to hold, ``{name: bytes}`` (the names
    #: :func:`verl_backend.driver.aot.run.plan_comparison` sets beside XLA's numbers)
    graphs: dict[str, float] = field(default_factory=dict)
    #: CPU backend only: what the job's other processes hold on the same host (bytes; ``when`` is ``host``)
    host_terms: list[Term] = field(default_factory=list)

    def _host_phases(self) -> dict[str, float]:
        others = sum(t.bytes for t in self.host_terms if t.when == "host")
        resident = self.resident - sum(
            t.bytes for t in self.terms if t.when == "resident" and t.name.startswith("gradients")
        )
        phases = {"update": self.peak * self.workers + others}
        for phase in ("generation", "sync"):
            extra = [t.bytes for t in self.host_terms if t.when == f"host {phase}"]
            if extra:
                phases[phase] = resident * self.workers + sum(extra) + others
        return phases

    @property
    def host_need(self) -> float:
        """Bytes the whole job needs on one host (CPU backend), the largest of its phases: every trainer worker at
        its peak beside the other processes' resident :attr:`host_terms` (``host``); or the trainer workers' resident
        terms without gradients (freed after each update) beside all of those and, while the rollout server
        generates, ``host generation`` (its packed copies and KV cache), or, while it takes an adapter-only LoRA
        sync, ``host sync`` (the model's files it maps to refill and merge)."""
        return max(self._host_phases().values())

    @property
    def host_phase(self) -> str:
        """Which phase :attr:`host_need` is: ``update`` (the trainer's peak), ``generation`` or ``sync`` (the
        server's)."""
        phases = self._host_phases()
        return max(phases, key=phases.get)

    def term(self, name: str) -> float:
        """Bytes of the term whose name starts with ``name``."""
        return next(t.bytes for t in self.terms if t.name.startswith(name))

    @property
    def resident(self) -> float:
        return sum(t.bytes for t in self.terms if t.when == "resident")

    @property
    def peak_phase(self) -> tuple[str, float]:
        """The phase with the most transient bytes: ``(name, bytes)``."""
        phases: dict[str, float] = {}
        for t in self.terms:
            if t.when != "resident":
                phases[t.when] = phases.get(t.when, 0.0) + t.bytes
        return max(phases.items(), key=lambda kv: kv[1], default=("none", 0.0))

    @property
    def peak(self) -> float:
        """Estimated peak bytes per chip: resident terms plus the largest phase."""
        return self.resident + self.peak_phase[1]

    @property
    def usable_bytes(self) -> float | None:
        return None if self.hbm_bytes is None else self.hbm_bytes * USABLE_FRACTION

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes is None else self.peak <= self.usable_bytes

    @property
    def biggest(self) -> Term:
        """The largest term counted in the peak."""
        phase = self.peak_phase[0]
        return max((t for t in self.terms if t.when in ("resident", phase)), key=lambda t: t.bytes)

    def format(self) -> str:
        """The plan as one table (GiB), for ``verl train --print-config``."""
        m = self.model
        head = (
            f"memory plan per chip: {m.name} ({m.params / 1e9:.3g} B parameters) on {self.where}, "
            f"{self.workers} trainer worker(s), parameters sharded {self.shards} ways"
        )
        rows = [f"  {'term':<34}{'GiB':>9}  {'held':<12}how"]
        rows += [f"  {t.name:<34}{t.bytes / GIB:>9.3f}  {t.when:<12}{t.how}" for t in self.terms]
        phase, extra = self.peak_phase
        rows.append(
            f"  {'peak estimate':<34}{self.peak / GIB:>9.3f}  {'':<12}resident {self.resident / GIB:.3f} + "
            f"largest phase ({phase}) {extra / GIB:.3f}"
        )
        if self.hbm_bytes is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            rows.append(
                f"  {'usable HBM':<34}{self.usable_bytes / GIB:>9.3f}  {'':<12}{USABLE_FRACTION:.0%} of "
                f"{self.hbm_bytes / GIB:g} GiB per chip: {verdict}"
            )
        if self.host_terms:
            rows += [f"  {t.name:<34}{t.bytes / GIB:>9.3f}  {t.when:<12}{t.how}" for t in self.host_terms]
        return "\n".join([head, *rows, *(f"  note: {n}" for n in self.notes)])


def config_value(config, key: str, default=None):
    """The value at the dotted ``key`` of the composed config (OmegaConf), else ``default`` (also for a null)."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default, throw_on_missing=False)
    return default if value is None else value


def _bytes(dtype, hf_config=None) -> int:
    name = str(dtype).lower().replace("torch.", "")
    if name == "auto" and hf_config is not None:
        name = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32")
        name = name.lower().replace("torch.", "")
    if name not in _BYTES:
        raise ValueError(f"dtype {dtype!r}: the memory plan knows {', '.join(sorted(_BYTES))}")
    return _BYTES[name]


def resolve_slice(slice_spec):
    """``SliceTopology``, ``"v6e-4"`` / ``"v6e-4:2x2"`` (``rl_tpu.slice``) or ``None`` -> ``SliceTopology | None``."""
    if slice_spec is None or slice_spec == "":
        return None
    if isinstance(slice_spec, str):
        from rl_tpu.topology import parse_slice

        acc, _, topo = slice_spec.partition(":")
        return parse_slice(acc, topo or None)
    return slice_spec


def _files_refilled(job: JobShape, model_bytes: float) -> float:
    """Bytes of the model's files the CPU rollout server maps during an adapter-only LoRA sync. With shared-memory
    weights given back while it sleeps (``rl_tpu.shared_weights``, ``rollout.free_cache_engine``: the defaults) it
    refills them from the files and merges the adapter onto them (:func:`verl_backend.weight_sync.lora
    .unadapted_for_refill`), every page of the files mapped at once (measured: 5.63 GiB of file pages beside its
    5.61 GiB of weights, Qwen3-1.7B shaped, fp32 files); without the release it maps the adapted matrices' pages only,
    for which the files' size is an upper bound (not measured). 0 without LoRA. ``model_bytes`` stands in where no
    file is found."""
    import glob
    import os

    if not job.lora_rank:
        return 0.0
    files = glob.glob(os.path.join(job.model_path, "*.safetensors"))
    return float(sum(os.path.getsize(f) for f in files)) if files else float(model_bytes)


@dataclass(frozen=True)
class _Itemsizes:
    """Bytes per element of the job's dtypes: the actor's FSDP ``model_dtype`` (``model``), its mixed-precision
    ``param_dtype`` and ``reduce_dtype``, and the rollout's (``rollout``)."""

    model: int
    param: int
    reduce: int
    rollout: int


_DTYPE_NAME = {4: "fp32", 2: "bf16"}


def plan_memory(
    job, slice_spec, backend_profile, *, hf_config=None, workers: int | None = None, settings=None
) -> MemoryPlan:
    """Estimate per-chip memory of a job on ``slice_spec``.

    Args:
        job: the job's :class:`~verl_backend.driver.job_shape.JobShape`, or VeRL's composed config
            (``verl train --print-config`` prints it) to read one from (:func:`~verl_backend.driver.job_shape
            .job_shape`, with ``workers`` and ``settings``).
        slice_spec: a ``SliceTopology``, ``"v6e-4[:2x2]"`` or ``None`` (no HBM to compare with).
        backend_profile: the :class:`~verl_backend.driver.profiles.BackendProfile`; its ``tpu_runtime`` means
            attention is not assumed fused (XLA's sdpa keeps the softmax output) and arrays take the TPU's tiles.
        hf_config: the model's transformers config, or its :class:`ModelShape`; ``None`` reads the job's model
            folder's config.json.
        workers: with a config, the trainer workers (chips) to plan for; ``None``: ``trainer.n_gpus_per_node ×
            trainer.nnodes``.
        settings: with a config, the job's :class:`verl_backend.settings.RlTpuSettings` (``plain_module``,
            ``compile_trainer``, ``response_only_logits``, ``logits_chunk_mib`` are read); ``None``: the config's
            ``rl_tpu`` section.

    Returns:
        The :class:`MemoryPlan` (bytes per chip; formulas in this module's docstring).
    Raises:
        OSError, ValueError: the model's config.json cannot be read, or a dtype the plan does not know.
    """
    if not isinstance(job, JobShape):
        job = job_shape(job, workers, settings)
    elif workers is not None or settings is not None:
        raise TypeError("plan_memory: workers and settings go with a config; a JobShape already has them")
    spec = resolve_slice(slice_spec)
    if hf_config is None:  # counted once per model folder (the refusal plans a few slices)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(job.model_path, trust_remote_code=job.trust_remote_code)
        shape = shape_of_path(job.model_path, job.trust_remote_code)
    else:
        shape = model_shape(hf_config, job.trust_remote_code) if not isinstance(hf_config, ModelShape) else hf_config
    sizes = _Itemsizes(
        _bytes(job.model_dtype, hf_config),
        _bytes(job.param_dtype),
        _bytes(job.reduce_dtype),
        _bytes(job.rollout_dtype, hf_config),
    )
    tpu = backend_profile.tpu_runtime  # TPU: each array as the chip lays it out (tpu_bytes), the compiled graphs'
    terms = _resident_terms(job, shape, sizes, hf_config, tpu)
    notes: list[str] = []
    graphs: dict[str, float] = {}  # TPU, padded micro batches: what each compiled graph holds
    gather = _gather_buffers(job, shape, sizes, tpu)
    if gather is not None:
        terms.append(gather)
    if tpu and not job.packed:
        terms += _compiled_update_terms(job, shape, sizes, graphs, notes)
    else:
        terms += _eager_update_terms(job, shape, sizes, fused=not tpu)
    terms.append(_log_prob_term(job, shape, sizes, fused=not tpu))
    if graphs:  # XLA's: the no-grad LM head's logits and log-softmax, and one no-grad block's output and temporaries
        graphs["log-prob forward"] = terms[-1].bytes
    if job.critic:
        terms += _critic_terms(job, shape, sizes, fused=not tpu, graphs=graphs, notes=notes)
    if job.sampler_placement == "worker":
        terms += _generation_terms(job, shape, sizes, tpu, graphs)
    if job.packed:
        notes.append("packed micro batches: activations counted at the longest prompt and response (an upper bound)")
    host_terms = _host_terms(job, shape, sizes) if backend_profile.host_memory else []
    hbm = spec.hbm_gib * GIB if spec is not None else None
    where = f"{spec.accelerator_type} ({spec.chips} chips, {spec.hbm_gib:g} GiB HBM each)" if spec else job.device
    return MemoryPlan(shape, where, job.workers, job.shards, terms, hbm, notes, graphs, host_terms)


def _trainable(job: JobShape, shape: ModelShape) -> float:
    """Trainable parameters: the LoRA adapter's (rank × the adapted linear layers' widths), else all of them."""
    return job.lora_rank * shape.lora_linear if job.lora_rank else shape.params


def _resident_terms(job: JobShape, shape: ModelShape, sizes: _Itemsizes, hf_config, tpu: bool) -> list[Term]:
    """What a chip holds all run long: the actor's parameters, gradients and AdamW moments (sharded), the reference
    policy's parameters (a KL loss or penalty, not under LoRA), and the sampler's own unsharded weights when it runs
    inside the worker (TPU arrays as the chip tiles them)."""
    p, p_t, b, shards, lora = shape.params, _trainable(job, shape), sizes.model, job.shards, job.lora_rank
    dt = _DTYPE_NAME
    terms = [
        Term(
            f"parameters ({dt[b]})",
            0 if job.param_offload else p * b / shards,
            "resident",
            "offloaded" if job.param_offload else f"{p:.3e} x {b} B / {shards}",
        ),
        Term(
            f"gradients ({dt[b]})",
            0 if job.param_offload else p_t * b / shards,
            "resident",
            "offloaded"
            if job.param_offload
            else f"{p_t:.3e} x {b} B / {shards}" + (f" (LoRA rank {lora})" if lora else ""),
        ),
        Term(
            "optimizer (AdamW, 2 moments)",
            0 if job.optimizer_offload else 2 * p_t * b / shards,
            "resident",
            "offloaded" if job.optimizer_offload else f"2 x {p_t:.3e} x {b} B / {shards}",
        ),
    ]
    if job.reference and not lora:
        b_ref, off = _bytes(job.ref_model_dtype, hf_config), job.ref_param_offload
        terms.append(
            Term(
                f"reference policy ({dt[b_ref]})",
                0 if off else p * b_ref / shards,
                "resident",
                "offloaded" if off else f"{p:.3e} x {b_ref} B / {shards}",
            )
        )
    b_roll, in_worker = sizes.rollout, job.sampler_placement == "worker"
    weights = arrays_bytes(shape.sampler_graph(1, 1, 1, b_roll)["weights"]) if tpu else p * b_roll
    terms.append(
        Term(
            f"sampler weights ({dt[b_roll]}, unsharded)",
            weights if in_worker else 0,
            "resident",
            (f"{p:.3e} x {b_roll} B" + (", TPU tiles" if tpu else ""))
            if in_worker
            else "in the rollout server process",
        )
    )
    return terms


def _gather_buffers(job: JobShape, shape: ModelShape, sizes: _Itemsizes, tpu: bool) -> Term | None:
    """FSDP2's all-gather buffers during the update (VeRL's ``apply_fsdp2`` shards each block, and the embedding and
    LM head apart when untied; the root stays gathered), or ``None`` where nothing is gathered: one shard in the
    model's own dtype, or one plain (unwrapped) CPU rank (``rl_tpu.plain_module``)."""
    single_plain = job.shards == 1 and job.plain_module and not tpu
    if not (job.shards > 1 or (sizes.param != sizes.model and not single_plain)):
        return None

    def units(itemsize):  # (root or LM head, one block) in a dtype, as the TPU lays them out, else dense
        if not tpu:
            root = shape.root_params if shape.tied else shape.vocab * shape.hidden
            return root * itemsize, shape.layer_params * itemsize
        head = shape._params(shape.head_shapes, shape.vocab * shape.hidden, itemsize, "")
        block = shape._params(shape.block_shapes, shape.layer_params, itemsize, "")
        return arrays_bytes(head if shape.tied else head[-1:]), arrays_bytes(block)

    (root_p, block_p), (root_r, block_r) = units(sizes.param), units(sizes.reduce)
    if shape.tied:
        gathered = root_p + 2 * (block_p + block_r)
        how = "root (kept) + 2 blocks unsharded, params and grads"
    else:
        gathered = max(block_p, root_p) + block_p + max(block_r, root_r) + block_r
        how = "largest unit (LM head) + 1 block unsharded, params and grads"
    return Term("FSDP2 gather buffers", gathered, "update", how + (", TPU tiles" if tpu else ""))


def _update_length(job: JobShape) -> int:
    """The longest micro batch's length the update holds: prompt plus response, padded to the compiled trainer's
    power-of-two bucket when it pads (:attr:`JobShape.bucketed`)."""
    return job.padded_length if job.bucketed else job.sequence_length


def _compiled_update_terms(
    job: JobShape, shape: ModelShape, sizes: _Itemsizes, graphs: dict[str, float], notes: list[str]
) -> list[Term]:
    """The actor update's terms on TPU with padded micro batches: the compiled graphs' own arrays
    (:meth:`ModelShape.block_graph`, :meth:`ModelShape.head_graph`), tiled, at the micro batch's padded length;
    fills ``graphs`` with what each compiled graph is expected to hold and adds the MoE note to ``notes``."""
    seq, b_param = _update_length(job), sizes.param
    rows, micro_how, _, _ = _micro_batch_tokens(job, seq)
    length = math.ceil(seq / job.sequence_parallel)
    g, hg = shape.block_graph(rows, length, b_param), shape.head_graph(rows, length, b_param)
    x = tpu_bytes((rows, length, shape.hidden), b_param)
    fwd_out = arrays_bytes(g["saved"]) + arrays_bytes(g["returned"])
    shared = arrays_bytes(g["arguments"][-3:])  # cos, sin, mask: made once a forward, read by every block
    if job.gradient_checkpointing:
        acts = shape.layers * x + fwd_out + shared
        how = (
            f"checkpointed: {shape.layers} x block input + one block's forward outputs "
            f"({len(g['saved'])} saved tensors, its inputs and parameters returned) + rotary and mask"
        )
    else:
        acts = shape.layers * fwd_out + shared
        how = f"{shape.layers} x one block's forward outputs + rotary and mask"
    head = sum(arrays_bytes(hg[k]) for k in ("saved", "returned", "temporaries"))
    temps = arrays_bytes(shape.block_temporaries(rows, length, b_param))
    terms = [
        Term("activations", acts, "update", f"{micro_how}, padded to {rows}x{length}; {how}; TPU tiles"),
        Term(
            "LM head logits",
            head,
            "update",
            f"{rows * length} tokens x {shape.vocab}: logits ({b_param} B) + "
            f"fp32 log-softmax, the head's input and weight returned for the backward; TPU tiles",
        ),
        Term(
            "update temporaries",
            temps,
            "update",
            "one block graph's: 2 fp32 score-sized arrays + MLP and q/k/v "
            "gradients (an upper bound: XLA fuses them away at small widths)"
            + (" + the experts' weights gathered per token and their gradients (batched_mm)" if shape.experts else ""),
        ),
    ]
    if shape.experts:
        notes.append(
            f"MoE on TPU: experts run as transformers' batched_mm (grouped_mm's torch.cumsum lowers to "
            f"chlo.scan, which libtpu 0.0.52 refuses); each of {rows * length} tokens x "
            f"{shape.experts_active} experts gathers its expert's weights: "
            f"{rows * length * shape.experts_active * 3 * shape.intermediate * shape.hidden * b_param / GIB:.2f}"
            f" GiB a block graph (docs/tpu.md, MoE on TPU)"
        )
    graphs.update(
        {
            "block forward arguments": arrays_bytes(g["arguments"]),
            "activations": acts,
            "block backward outputs": arrays_bytes(g["gradients"]),
            "update temporaries": temps,
            "LM head forward arguments": arrays_bytes(hg["arguments"]),
            "LM head logits": head,
            "LM head backward outputs": arrays_bytes(hg["gradients"]),
        }
    )
    return terms


def _micro_batch_tokens(job: JobShape, seq: int) -> tuple[int, str, int, int]:
    """One update micro batch at the longest length ``seq``: ``(sequences, how, tokens per chip, LM-head tokens)``.
    Tokens are counted at the longest prompt and response; a packed micro batch under the prefix grouper holds each
    prompt once per group, a bucketed one ``seq`` a sequence; the LM head runs at response tokens only on packed micro
    batches with ``rl_tpu.response_only_logits``; ``use_dynamic_bsz`` holds ``ppo_max_token_len_per_gpu`` tokens."""
    if job.dynamic_batch:
        tokens = job.max_tokens_per_chip
        micro = max(1, tokens // seq)
        return micro, f"{tokens} tokens (use_dynamic_bsz)", math.ceil(tokens / job.sequence_parallel), tokens
    micro, n = job.update_micro_batch, job.rollout_n
    prompts = math.ceil(micro / n) if job.packed and job.prefix_grouper else micro
    tokens = prompts * job.prompt_length + micro * job.response_length
    how = f"{micro} seqs, {tokens} tokens" + (" (prompt once per group)" if prompts < micro else "")
    response_only = job.packed and job.response_only_logits
    logit_tokens = micro * job.response_length if response_only else micro * seq
    tokens = micro * seq if job.bucketed else tokens
    return micro, how, math.ceil(tokens / job.sequence_parallel), logit_tokens


def _eager_update_terms(job: JobShape, shape: ModelShape, sizes: _Itemsizes, fused: bool) -> list[Term]:
    """The actor update's terms off TPU (or with packed micro batches): the activations saved for the backward per
    token and block (Korthikanti et al. 2022, this module's docstring), checkpointed or not, and the LM head's
    logits with their fp32 log-softmax and gradient."""
    seq, b_param = _update_length(job), sizes.param
    _, micro_how, tokens, logit_tokens = _micro_batch_tokens(job, seq)
    block = shape.block_elements(seq, fused)
    if job.gradient_checkpointing:
        elems, how = shape.layers * shape.hidden + block, "checkpointed: L x h + 1 block"
    else:
        elems, how = shape.layers * block, f"L x {block} elements/token"
    chunk = job.logit_chunk_tokens(shape.vocab, logit_tokens)
    if chunk < logit_tokens:  # the chunked head's backward: one chunk's logits and ~4 fp32 softmax working copies
        head = Term(
            "LM head logits (chunked)",
            chunk * shape.vocab * (b_param + 16),
            "update",
            f"{chunk} of {logit_tokens} tokens a chunk (rl_tpu.logits_chunk_mib) x {shape.vocab} x ({b_param}+16) B",
        )
    else:
        head = Term(
            "LM head logits",
            logit_tokens * shape.vocab * (b_param + 8),
            "update",
            f"{logit_tokens} tokens x {shape.vocab} x ({b_param}+4+4) B",
        )
    return [Term("activations", tokens * (elems + 2 * shape.hidden) * b_param, "update", f"{micro_how}; {how}"), head]


def _log_prob_term(job: JobShape, shape: ModelShape, sizes: _Itemsizes, fused: bool) -> Term:
    """The forward-only log-probs (the reference policy's, the old policy's unless bypassed) at the larger of their
    micro batches: logits with their fp32 log-softmax, and one block's working set."""
    seq, b_param = _update_length(job), sizes.param
    lp = max(job.log_prob_micro_batch, job.ref_log_prob_micro_batch)
    lp_tokens = lp * (job.response_length if job.packed and job.response_only_logits else seq)
    chunk = job.logit_chunk_tokens(shape.vocab, lp_tokens)
    if chunk < lp_tokens:  # one chunk's logits, its fp32 log-softmax and the entropy's product
        logit_bytes, how = chunk * shape.vocab * (b_param + 8), f"a {chunk}-token chunk of logits x ({b_param}+8) B"
    else:
        logit_bytes, how = lp_tokens * shape.vocab * (b_param + 4), f"logits x ({b_param}+4) B"
    lp_bytes = logit_bytes + lp * seq * shape.block_elements(seq, fused) * b_param
    return Term("log-prob forward", lp_bytes, "log-prob", f"{lp} seqs: {how} + 1 block")


def _critic_terms(
    job: JobShape, shape: ModelShape, sizes: _Itemsizes, fused: bool, graphs: dict[str, float], notes: list[str]
) -> list[Term]:
    """PPO with GAE: the critic's parameters, gradients and AdamW moments (resident) and its update's activations
    (the compiled block graph's arrays plus the value head's on TPU, where ``graphs`` is filled; else per token)."""
    cshape = shape
    if job.critic_model_path:
        try:
            cshape = shape_of_path(job.critic_model_path, job.trust_remote_code)
        except (OSError, ValueError):
            notes.append(
                f"critic.model.path={job.critic_model_path} has no readable config.json: the critic is counted as "
                "the actor"
            )
    cb, shards, seq, b_param = _bytes(job.critic_model_dtype), job.shards, _update_length(job), sizes.param
    terms = [
        Term(
            f"critic params+grads+AdamW ({_DTYPE_NAME[cb]})",
            4 * cshape.params * cb / shards,
            "resident",
            f"4 x {cshape.params:.3e} x {cb} B / {shards}",
        )
    ]
    cmicro, ckpt, sp = job.critic_micro_batch, job.critic_gradient_checkpointing, job.sequence_parallel
    if graphs:  # the compiled block graph's arrays at the critic's micro batch, as the actor's, + the value head
        rows, length = cmicro, math.ceil(seq / sp)
        cg = cshape.block_graph(rows, length, b_param)
        x = tpu_bytes((rows, length, cshape.hidden), b_param)
        fwd_out = arrays_bytes(cg["saved"]) + arrays_bytes(cg["returned"])
        kept = cshape.layers * x + fwd_out if ckpt else cshape.layers * fwd_out
        head = 2 * x + 2 * tpu_bytes((rows, length), 4)  # its norm's output, the hidden states, rsqrt, values
        cacts = kept + arrays_bytes(cg["arguments"][-3:]) + head
        graphs["critic activations"] = cacts
        how = (
            f"{cmicro} seqs, padded to {rows}x{length}"
            + (", checkpointed" if ckpt else "")
            + "; as the actor's + the value head's outputs; TPU tiles"
        )
        terms.append(Term("critic activations", cacts, "critic", how))
    else:
        cblock = cshape.block_elements(seq, fused)
        celems = cshape.layers * cshape.hidden + cblock if ckpt else cshape.layers * cblock
        terms.append(
            Term(
                "critic activations",
                cmicro * seq / sp * (celems + 2 * cshape.hidden) * b_param,
                "critic",
                f"{cmicro} seqs" + (", checkpointed" if ckpt else ""),
            )
        )
    return terms


def _generation_terms(
    job: JobShape, shape: ModelShape, sizes: _Itemsizes, tpu: bool, graphs: dict[str, float]
) -> list[Term]:
    """Generation with the sampler inside the worker: its static KV cache at :attr:`JobShape.sampler_batch` rows
    and the largest cache bucket, and on TPU the compiled decode step's outputs and the prefill's or decode step's
    temporaries (:meth:`ModelShape.sampler_graph`, tiled; ``graphs`` filled), else its last-position logits."""
    b_roll, batch, rp, slots = sizes.rollout, job.sampler_batch, job.rollout_prompt_length, job.cache_slots
    kv_how = f"2 x {shape.layers} x {shape.kv_heads} x {shape.head_dim} x {slots} x {batch} x {b_roll} B"
    if not tpu:
        kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * slots * batch * b_roll
        return [
            Term("sampler KV cache", kv, "generation", kv_how),
            Term("sampler logits", batch * shape.vocab * 4, "generation", f"{batch} x {shape.vocab} x 4 B"),
        ]
    sg = shape.sampler_graph(batch, 1, slots, b_roll)
    kv, steps = arrays_bytes(sg["cache"]), arrays_bytes(sg["outputs"])
    prefill = arrays_bytes(shape.sampler_temporaries(batch, rp, slots, b_roll))
    decode = arrays_bytes(shape.sampler_temporaries(batch, 1, slots, b_roll))
    temporaries = (
        f"the prefill's: 2 fp32 score-sized arrays {batch}x{shape.heads}x{rp}x{slots} + keys/values repeated in fp32"
        if prefill >= decode
        else "the decode step's: a copy of each layer's key or value + keys/values repeated in fp32"
    )
    if graphs:
        weights = arrays_bytes(sg["weights"])
        inputs = arrays_bytes(sg["arguments"][len(sg["weights"]) :])  # the cache, ids, mask, positions
        graphs.update(
            {
                "sampler weights + KV cache": weights + inputs,
                "sampler step outputs": steps,
                "sampler temporaries": max(prefill, decode),
            }
        )
    return [
        Term("sampler KV cache", kv, "generation", kv_how + ", TPU tiles"),
        Term(
            "sampler step outputs",
            steps,
            "generation",
            f"a step's logits ({batch} x {shape.vocab} x {b_roll} B) "
            "and the KV cache rewritten into new arrays (its arguments are not donated)",
        ),
        Term("sampler temporaries", max(prefill, decode), "generation", temporaries),
    ]


def _host_terms(job: JobShape, shape: ModelShape, sizes: _Itemsizes) -> list[Term]:
    """CPU backend: what the job's other processes hold on the same host: the rollout server's own weights, its
    packed copies and KV cache while it generates, the model's files it maps during an adapter-only LoRA sync (unless
    the sampler runs inside the worker), each trainer worker's runtime and the job's fixed processes (measured
    constants, this module's docstring)."""
    terms: list[Term] = []
    p, b_roll, w = shape.params, sizes.rollout, job.workers
    if job.sampler_placement != "worker":
        terms.append(
            Term(
                f"rollout server weights ({_DTYPE_NAME[b_roll]})",
                p * b_roll,
                "host",
                f"{p:.3e} x {b_roll} B, the server's own copy",
            )
        )
        if b_roll == 4 and job.packed_weights is not False:
            # rl_tpu.sampler.packed: a packed copy of every float32 Linear (the LM head's too) while generating,
            # the query/key/value projections once more as one fused matrix
            linear = shape.layers * shape.layer_params + shape.vocab * shape.hidden
            fused = shape.layers * shape.hidden * (shape.heads + 2 * shape.kv_heads) * shape.head_dim
            terms.append(
                Term(
                    "rollout server packed weights",
                    (linear + fused) * 4,
                    "host generation",
                    f"({linear:.3e} + {fused:.3e} fused q/k/v) x 4 B, while it generates",
                )
            )
        slots, batch = job.cache_slots, job.server_batch
        terms.append(
            Term(
                "rollout server KV cache",
                2 * shape.layers * shape.kv_heads * shape.head_dim * slots * batch * b_roll,
                "host generation",
                f"2 x {shape.layers} x {shape.kv_heads} x {shape.head_dim} x {slots} x {batch} x {b_roll} B",
            )
        )
        refill = _files_refilled(job, p * sizes.model)
        if refill:  # the third phase: the rollout wakes and takes the adapter (LoRA, adapter-only sync)
            terms.append(
                Term(
                    "rollout server files (mapped)",
                    refill,
                    "host sync",
                    "the model's safetensors, mapped while the server refills its released weights "
                    "from them and merges the adapter (file pages, counted in its PSS)",
                )
            )
    terms.append(
        Term(
            "trainer worker runtime",
            w * TRAINER_RUNTIME_BYTES,
            "host",
            f"{w} x {TRAINER_RUNTIME_BYTES / GIB:.2f} GiB: Python, torch, VeRL (measured)",
        )
    )
    terms.append(
        Term(
            "driver and Ray processes",
            JOB_RUNTIME_BYTES,
            "host",
            "driver, Ray's daemons, VeRL's loop and queue actors (measured)",
        )
    )
    return terms
