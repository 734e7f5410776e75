"""Which graphs a TPU job compiles, with their shapes: the input of ``verl train --aot-only`` (no torch import).

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

:func:`job_graphs` reads them off a composed VeRL config the way the trainer and the sampler pick their shapes.
"""

from __future__ import annotations

import dataclasses

# the config readers the memory plan shares (re-exported: graphs.config_get etc. still work)
from verl_backend.driver.job_keys import config_get, per_chip_micro_batch, pow2, runs_critic  # noqa: F401

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


def job_graphs(config, workers: int) -> list[GraphRequest]:
    """The graphs one chip compiles for a composed VeRL ``config`` run on ``workers`` trainer workers, each listed
    once (a shape two models share is one graph: the blocks' parameters are graph inputs).

    Trainer, at the padded length of prompt plus response (a power of two): the actor's update at its micro batch
    (``actor.ppo_micro_batch_size_per_gpu``, else 1); the no-grad log-prob forward at
    ``rollout.log_prob_micro_batch_size_per_gpu`` when the old policy's log-probs are recomputed
    (``algorithm.rollout_correction.bypass_mode`` false) and at ``ref.log_prob_micro_batch_size_per_gpu`` when a
    reference policy runs (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``); with GAE the critic's update at
    ``critic.ppo_micro_batch_size_per_gpu`` and its values forward at ``critic.forward_micro_batch_size_per_gpu``
    (else the update's), on the actor's model shape. Sampler (in the worker): this worker's share of
    ``train_batch_size × rollout.n`` (at most ``rollout.max_num_seqs``, a power of two), at the largest of the
    rollout's buckets (:func:`verl_backend.rollout.sampling._buckets`: powers of two up to the rollout's
    ``prompt_length`` and ``response_length``, those limits last): a prefill of ``prompt_length`` tokens against a
    cache of ``prompt_length + response_length`` slots; decode also at every halved batch bucket (the sampler drops
    finished rows), down to 1. Smaller prompt and generation buckets compile graphs of their own, not listed.
    """

    def get(key, default):
        return config_get(config, key, default)

    def micro(key, fallback):
        return per_chip_micro_batch(get, key, workers) or fallback

    aro = "actor_rollout_ref"
    prompt, response = int(get("data.max_prompt_length", 512)), int(get("data.max_response_length", 512))
    update = micro(f"{aro}.actor.ppo_micro_batch_size_per_gpu", 1)
    seq = pow2(prompt + response)
    out = [GraphRequest("block", update, seq), GraphRequest("lm_head", update, seq)]
    forwards = []
    if not _true(get("algorithm.rollout_correction.bypass_mode", False)):  # the old policy's log-probs, recomputed
        forwards.append(micro(f"{aro}.rollout.log_prob_micro_batch_size_per_gpu", update))
    if _true(get(f"{aro}.actor.use_kl_loss", False)) or _true(get("algorithm.use_kl_in_reward", False)):
        forwards.append(micro(f"{aro}.ref.log_prob_micro_batch_size_per_gpu", update))
    for rows in forwards:
        out += [GraphRequest("block_forward", rows, seq), GraphRequest("lm_head_forward", rows, seq)]
    if runs_critic(get):
        critic = micro("critic.ppo_micro_batch_size_per_gpu", 1)
        values = micro("critic.forward_micro_batch_size_per_gpu", critic)
        out += [
            GraphRequest("block", critic, seq),
            GraphRequest("value_head", critic, seq),
            GraphRequest("block_forward", values, seq),
            GraphRequest("value_head_forward", values, seq),
        ]
    rows = int(get("data.train_batch_size", 1)) * int(get(f"{aro}.rollout.n", 1))
    share = max(1, -(-rows // max(1, workers)))
    batch = pow2(min(share, int(get(f"{aro}.rollout.max_num_seqs", share) or share)))
    p = int(get(f"{aro}.rollout.prompt_length", prompt) or prompt)  # the rollout's largest buckets
    cache = p + int(get(f"{aro}.rollout.response_length", response) or response)
    out.append(GraphRequest("prefill", batch, p, cache))
    b = batch
    while b >= 1:
        out.append(GraphRequest("decode", b, 1, cache))
        b //= 2
    return list(dict.fromkeys(out))  # each shape once, in the order first listed


def _true(value) -> bool:
    return value is True or str(value).lower() == "true"


def job_workers(config) -> int:
    """The trainer workers of a composed config (``trainer.n_gpus_per_node × trainer.nnodes``): one per chip."""
    return int(config_get(config, "trainer.n_gpus_per_node", 1)) * int(config_get(config, "trainer.nnodes", 1))


def graph_list(config) -> list[dict]:
    """The job's (graph, input shapes) list as ``--aot-only`` lowers it (:func:`job_graphs` over
    :func:`job_workers`), as JSON records: ``{"graph": name, "kind", "batch", "seq", "cache", "block"}`` (``block``
    empty: the lowering adds a graph per kind of block); what the TPU dry run records in its run folder
    (``aot/graphs.json``)."""
    return [{"graph": g.name, **dataclasses.asdict(g)} for g in job_graphs(config, job_workers(config))]


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
