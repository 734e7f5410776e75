"""Counting the ops a sampler decode step dispatches: what an eager device pays per op.

TorchTPU's default eager mode (``strict``, ``DEFER_NEVER``) dispatches every aten op to the chip as it comes, so a
decode step's cost there has a floor of (ops per step) x (launch cost per op), whatever the op does. Compiled steps
(:mod:`rl_tpu.sampler.compiled`) are one graph per step instead. :class:`OpCounter` counts the aten ops dispatched
while it is active (a ``TorchDispatchMode``: it sees each op below autograd, as a device backend receives it);
:func:`decode_step_ops` turns that into ops per decode step of :meth:`rl_tpu.sampler.Sampler.generate`, sampling
and bookkeeping included, at the batch and bucket given; a compiled step counts as one launch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rl_tpu.patches.torch_internals import disable_current_modes, dispatch_mode_base


class OpCounter(dispatch_mode_base()):
    """``with OpCounter() as c: ...``: ``c.counts`` maps each aten op's name (its overload packet, e.g. ``"mm"``,
    ``"add_"``) to how many times it was dispatched inside the block; ``c.total`` is their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Ops dispatched so far."""
        return sum(self.counts.values())


#: the name a compiled step's launch is counted under
GRAPH = "<compiled graph>"


def _one_launch(fn, counter: OpCounter):
    def call(*args):
        counter.counts[GRAPH] += 1
        with disable_current_modes():
            return fn(*args)

    return call


def decode_step_ops(
    sampler, prompts: Sequence[Sequence[int]], steps: tuple[int, int] = (4, 12), **params
) -> Counter[str]:
    """Aten ops per decode step of ``sampler.generate(prompts, ...)``, by op name (a float per op: a mean).

    Two generations that differ only in ``max_new_tokens`` (``steps``: both within one generation bucket, so the
    cache and every shape are the same) are counted; their difference over ``steps[1] - steps[0]`` is what one more
    decode step dispatches (the model's forward, the token choice and the bookkeeping), with the prefill and the
    set-up cancelled out. Give the sampler no EOS tokens (``eos_token_ids=[]``), so no row stops early and the batch
    keeps its size. A compiled sampler's steps (:mod:`rl_tpu.sampler.compiled`) count as one launch each, under
    :data:`GRAPH` (what a device that runs the graph as one executable receives); call ``generate`` once first, so
    that the shapes are compiled.

    Args:
        sampler: a :class:`rl_tpu.sampler.Sampler`.
        prompts: token-id lists (one batch: at most ``sampler.max_batch_size`` rows with their ``n`` samples).
        steps: the two ``max_new_tokens``, ``steps[0] < steps[1]``.
        params: further :class:`rl_tpu.sampler.SamplingParams` fields (``temperature``, ``n``, ...).
    """
    from rl_tpu.sampler.params import SamplingParams

    lo, hi = steps
    if not 0 < lo < hi:
        raise ValueError(f"steps={steps!r}: give two increasing token counts")
    totals = []
    compiled = getattr(sampler, "compiled", None)
    fns = dict(compiled._fns) if compiled is not None else {}
    for new in (lo, hi):
        with OpCounter() as counter:
            try:  # each compiled step counts as one launch (dynamo refuses to run under a dispatch mode)
                for kind, fn in fns.items():
                    compiled._fns[kind] = _one_launch(fn, counter)
                sampler.generate(prompts, SamplingParams(max_new_tokens=new, **params))
            finally:
                if compiled is not None:
                    compiled._fns.update(fns)
        totals.append(counter.counts)
    return Counter(
        {
            op: (totals[1][op] - totals[0][op]) / (hi - lo)
            for op in totals[1] | totals[0]
            if totals[1][op] != totals[0][op]
        }
    )
