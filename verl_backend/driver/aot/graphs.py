"""Which graphs a TPU job compiles, with their shapes: the input of ``verl train --aot-only``.

A :class:`GraphRequest` is one graph kind at one shape:

- ``block``: one transformer block of the trainer, forward and backward (two graphs, ``…fwd`` and ``…bwd``), on a
  padded micro batch ``(batch, seq)`` with ``seq`` a power of two (``rl_tpu.compile_trainer`` pads to one): the
  actor's update, and the critic's when its micro batch is another;
- ``lm_head``: the final norm, LM head and the log-probs of the labels, ``(batch, seq)``, forward and backward;
- ``block_forward`` and ``lm_head_forward``: the same without gradients (one graph each, no saved tensors), at the
  log-prob micro batch: the old policy's log-probs (``algorithm.rollout_correction.bypass_mode=false``) and the
  reference policy's (a KL loss or KL reward);
- ``value_head`` (forward and backward) and ``value_head_forward``: the critic's final norm and one-output ``score``
  projection (VeRL's critic is the model's ``…ForTokenClassification`` with one label), at the critic's update and
  forward micro batches (PPO with GAE); its blocks are ``block`` / ``block_forward`` graphs;
- ``prefill``: the sampler's whole-model forward over ``(batch, prompt)`` tokens against a static KV cache of
  ``cache`` slots (``rl_tpu.sampler``'s buckets), last-position logits;
- ``decode``: the same with ``(batch, 1)`` tokens.

:func:`job_graphs` reads them off the job's :class:`~verl_backend.driver.job_shape.JobShape` the way the trainer and
the sampler pick their shapes.
"""

from __future__ import annotations

import dataclasses

from verl_backend.driver.job_shape import JobShape, job_shape

#: graph kinds of the trainer worker's models (actor, reference policy), of the critic, and of the sampler
TRAINER_KINDS = ("block", "lm_head", "block_forward", "lm_head_forward")
CRITIC_KINDS = ("value_head", "value_head_forward")
SAMPLER_KINDS = ("prefill", "decode")
#: kinds traced with a backward (two graphs, ``.fwd`` and ``.bwd``)
WITH_BACKWARD = ("block", "lm_head", "value_head")


@dataclasses.dataclass(frozen=True)
class GraphRequest:
    """One graph kind at one shape (see the module docstring); sizes are token counts."""

    kind: str
    batch: int
    seq: int = 0  # block / lm_head: padded sequence length; prefill: prompt bucket; decode: 1
    cache: int = 0  # prefill / decode: KV cache slots (prompt bucket + generation bucket)
    #: block / block_forward: the kind of block traced, when a model has several (``moe``, ``dense``, ``sliding``,
    #: ``full``, ...: :func:`verl_backend.driver.aot.lower.block_kinds`); ``""`` for a model of one kind of block.
    #: Set by the lowering, which sees the model; the job's list leaves it empty
    block: str = ""

    @property
    def name(self) -> str:
        """A stable name, e.g. ``trainer.block[4x1024]``, ``trainer.block[4x1024|moe]`` (one kind of block of
        several) or ``sampler.decode[64x1|cache 1536]``."""
        where = "critic" if self.kind in CRITIC_KINDS else "trainer" if self.kind in TRAINER_KINDS else "sampler"
        cache = f"|cache {self.cache}" if self.cache else ""
        block = f"|{self.block}" if self.block else ""
        return f"{where}.{self.kind}[{self.batch}x{self.seq}{cache}{block}]"


def job_graphs(job, workers: int | None = None) -> list[GraphRequest]:
    """The graphs one chip compiles for a job, each listed once (a shape two models share is one graph: the blocks'
    parameters are graph inputs).

    Args:
        job: the job's :class:`~verl_backend.driver.job_shape.JobShape`, or a composed VeRL config to read one from.
        workers: with a config, the trainer workers (``None``: :func:`job_workers`).

    Trainer, at the padded length of prompt plus response (:attr:`JobShape.padded_length`, the compiled trainer's
    bucket): the actor's update at its micro batch; the no-grad log-prob forward at the old policy's log-prob micro
    batch when its log-probs are recomputed (``algorithm.rollout_correction.bypass_mode`` false) and at the
    reference policy's when one runs (a KL loss or KL reward); with GAE the critic's update and its values forward
    at the critic's micro batches, on the actor's model shape. Sampler (in the worker): :attr:`JobShape
    .sampler_batch` rows at the largest of the rollout's buckets (:func:`verl_backend.rollout.sampling._buckets`:
    powers of two up to the rollout's ``prompt_length`` and ``response_length``, those limits last): a prefill of
    ``prompt_length`` tokens against a cache of ``prompt_length + response_length`` slots; decode also at every
    halved batch bucket (the sampler drops finished rows), down to 1. Smaller prompt and generation buckets compile
    graphs of their own, not listed.
    """
    if not isinstance(job, JobShape):
        job = job_shape(job, workers)
    seq, update = job.padded_length, job.update_micro_batch
    out = [GraphRequest("block", update, seq), GraphRequest("lm_head", update, seq)]
    forwards = [job.log_prob_micro_batch] if job.old_log_probs else []
    if job.reference:
        forwards.append(job.ref_log_prob_micro_batch)
    for rows in forwards:
        out += [GraphRequest("block_forward", rows, seq), GraphRequest("lm_head_forward", rows, seq)]
    if job.critic:
        out += [
            GraphRequest("block", job.critic_micro_batch, seq),
            GraphRequest("value_head", job.critic_micro_batch, seq),
            GraphRequest("block_forward", job.critic_forward_micro_batch, seq),
            GraphRequest("value_head_forward", job.critic_forward_micro_batch, seq),
        ]
    batch, prompt, cache = job.sampler_batch, job.rollout_prompt_length, job.cache_slots
    out.append(GraphRequest("prefill", batch, prompt, cache))
    while batch >= 1:
        out.append(GraphRequest("decode", batch, 1, cache))
        batch //= 2
    return list(dict.fromkeys(out))  # each shape once, in the order first listed


def _powers_of_two(limit: int, smallest: int = 1) -> set[int]:
    out, b = set(), smallest
    while b <= limit:
        out.add(b)
        b *= 2
    return out


def planned_shapes(job: JobShape) -> dict[str, set[tuple]]:
    """The shapes the job's buckets allow, per graph kind: ``{"prefill": {(batch, prompt, cache)}, "decode":
    {(batch, 1, cache)}, "block": {(batch, seq, 0)}, "block_forward": {(batch, seq, 0)}}``.

    Sampler (:mod:`rl_tpu.sampler.engine`): a batch bucket is a power of two up to the sampler's cap
    (``rollout.max_num_seqs``, default 64: the requests that arrive together, a validation's included, are batched up
    to it), or the cap itself and its halvings (finished rows dropped); a prompt bucket one of the rollout's
    (:func:`verl_backend.rollout.sampling._buckets`: powers of two from 16 up to ``prompt_length``, it last); the
    cache the prompt's bucket plus a generation bucket (``rl_tpu.sampler.engine``: the batch's prompt bucket plus the
    bucket of its ``max_new_tokens``). Trainer (:mod:`rl_tpu.compiled_blocks`): the update's micro batch
    (and the critic's, with GAE) for ``block``, the log-prob micro batches (and the critic's values forward) for
    ``block_forward``, each padded to a power of two from
    ``MIN_BUCKET`` up to the bucket of the job's longest sequence."""
    from rl_tpu.compiled_blocks import MIN_BUCKET, bucket_length
    from verl_backend.rollout.sampling import _buckets

    top = job.max_num_seqs or 64  # the sampler's cap (verl_backend.rollout.sampling): validation batches up to it too
    batches = _powers_of_two(top) | {top >> i for i in range(top.bit_length()) if top >> i}
    prompts = set(_buckets(job.rollout_prompt_length))
    gens = set(_buckets(job.rollout_response_length))
    caches = {p + g for p in prompts for g in gens}
    seqs = _powers_of_two(bucket_length(job.padded_length), MIN_BUCKET)
    updates, forwards = {job.update_micro_batch}, {job.log_prob_micro_batch, job.ref_log_prob_micro_batch}
    if job.critic:
        updates.add(job.critic_micro_batch)
        forwards.add(job.critic_forward_micro_batch)
    return {
        "prefill": {(b, p, p + g) for b in batches for p in prompts for g in gens},
        "decode": {(b, 1, c) for b in batches for c in caches},
        "block": {(b, s, 0) for b in updates for s in seqs},
        "block_forward": {(b, s, 0) for b in forwards for s in seqs},
    }


def planned_graphs(job: JobShape) -> list[GraphRequest]:
    """Every graph the job's bucket plan allows (:func:`planned_shapes`), what ``--aot-only --aot-all-buckets``
    lowers and compiles: each trainer ``block`` / ``block_forward`` shape with its ``lm_head`` / ``lm_head_forward``
    (with a critic, its ``value_head`` / ``value_head_forward`` too: a micro batch either model may run), then the
    sampler's prefills and decodes, smallest first. On a chip each is a compile; a whole run compiles those of its
    shapes that occur (the TPU dry run counts them: :mod:`verl_backend.driver.aot.executed`)."""
    plan = planned_shapes(job)
    heads = {"block": ["lm_head"], "block_forward": ["lm_head_forward"]}
    if job.critic:
        heads = {"block": ["lm_head", "value_head"], "block_forward": ["lm_head_forward", "value_head_forward"]}
    out = []
    for kind in ("block", "block_forward"):
        for batch, seq, _ in sorted(plan[kind]):
            out += [GraphRequest(kind, batch, seq)] + [GraphRequest(h, batch, seq) for h in heads[kind]]
    for kind in SAMPLER_KINDS:
        out += [GraphRequest(kind, batch, seq, cache) for batch, seq, cache in sorted(plan[kind])]
    return list(dict.fromkeys(out))


def graph_list(job) -> list[dict]:
    """The (graph, input shapes) list of ``job`` (a :class:`~verl_backend.driver.job_shape.JobShape` or a composed
    config) as ``--aot-only`` lowers it (:func:`job_graphs`), as JSON records:
    ``{"graph": name, "kind", "batch", "seq", "cache", "block"}`` (``block`` empty: the lowering adds a graph per kind
    of block); what the TPU dry run records in its run folder (``aot/graphs.json``)."""
    return [{"graph": g.name, **dataclasses.asdict(g)} for g in job_graphs(job)]


def graph_list_differences(ours: list[dict], theirs: list[dict]) -> list[str]:
    """Where two (graph, input shapes) lists differ, one line each (empty: the same list, in the same order): a
    graph in one only, a graph at other shapes, or the same graphs in another order."""

    def key(g):
        return (g["kind"], int(g["batch"]), int(g.get("seq", 0)), int(g.get("cache", 0)))

    a, b = [key(g) for g in ours], [key(g) for g in theirs]
    names = {key(g): g.get("graph") or GraphRequest(*key(g)).name for g in [*ours, *theirs]}
    lines = [f"only in the first list: {names[k]}" for k in a if k not in b]
    lines += [f"only in the second list: {names[k]}" for k in b if k not in a]
    if not lines and a != b:
        lines.append(
            "the same graphs in another order"
            if sorted(a) == sorted(b)
            else "the same graphs, some listed more often in one list"
        )
    return lines
