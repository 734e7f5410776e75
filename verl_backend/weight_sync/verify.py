"""Every weight sync verified through the rollout sampler's own compute path (issue #32, item 3).

Weight sync fails silently (VeRL #7495: a LoRA adapter never reached the rollout, the run sampled the initial
policy). Checking the bytes received proves nothing on the in-place route, where the rollout computes on the trainer's
own shared memory and the failure is a stale *packed copy* (:mod:`rl_tpu.sampler.packed`,
:mod:`rl_tpu.sampler.compiled_packed`, the lean decoder's fused query/key/value copies). So after each sync the rollout
proves that what it computes with is the trainer's model, with two checks:

1. **The probe** (catches anything that changes the numbers by more than the parity bound: stale weights, a sync
   that delivered nothing, stale packed copies, a wrong tensor). A fixed sequence per job (:func:`make_probe`:
   ``sequences x length`` token ids, default 2 x 16 of which the first 12 are the prompt, drawn from the job's
   seed) is scored by both sides:

   * trainer (:func:`trainer_probe`): one plain forward of the whole sequences through the trainer's module (an HF
     causal LM, peft- or FSDP-wrapped: every rank calls it, as every rank calls VeRL's weight export) right after the
     optimizer step;
   * rollout (:func:`rollout_probe`): :meth:`rl_tpu.sampler.Sampler.generate` itself, greedy, on the first
     ``prompt_len`` tokens, its token choice replaced by the probe's next token (teacher forcing,
     :func:`_forced_choice`): so the probe runs the sampler's prefill (packed prefill on the CPU, padded or compiled
     elsewhere) and its decode steps (lean decode, packed weights and the fused q/k/v copies, or the compiled graphs)
     exactly as sampling does, with the same packing decisions (a probe that finds the packed copies missing packs
     them, as the next generate would have: the packing is not an extra cost).

   Each side returns ``(sequences, length - prompt_len, 1 + k)`` float32: at every scored position the full
   vocabulary's log-softmax gathered at the probe's next token and at ``k`` fixed vocabulary ids
   (:attr:`Probe.vocab_ids`), 4 KB for the default. The bound (:func:`probe_bound`):

   * both sides float32: every value within ``1e-4 + 2e-5 * |log-prob|``. ``1e-4`` is the project's float32 parity
     bound (the sampler's log-prob parity tests, ``tests/rl_tpu/test_sampler.py``, and
     :data:`rl_tpu.sampler.fastpaths.LEAN_PROBE_TOLERANCE`), set on sampled, likely tokens; the probe's random ids
     sit at log-probs -7 to -25, where float32 rounding grows with the magnitude, hence the relative term;
   * a 16-bit side (bfloat16/float16): the *mean* |difference| within ``0.25``. Single values of a 16-bit probe
     differ by far more than a step moves them, so in 16 bits the probe is a gross check (a wrong or an untouched
     model) and the fingerprints carry the step-by-step check.

   What the bounds were set from (the differences measured on SmolLM2-135M, the room they leave, what one step moves)
   is in ``docs/weight-sync.md``, "Where the probe's bounds come from".

2. **Fingerprints** (catch any change of a tensor, however small, that the rollout's dtype can hold: a dropped
   tensor at the default learning rate, which no probe at a float32 parity bound sees, and name it). Per tensor a
   float64 weighted sum of a fixed strided sample of at most :data:`SAMPLE` elements (every element of a small tensor
   such as a norm weight), taken of the tensor as cast to the rollout's dtype (:func:`fingerprint`): the trainer
   fingerprints the stream it sends (:func:`fingerprint_stream`, or :func:`trainer_fingerprints` of a module), the
   rollout its own source tensors (``sampler._tensors``); equal to the bit for a faithful copy.

On a mismatch the rollout names the first differing tensor: a source tensor whose fingerprint differs, else a packed
copy that no longer computes its source weight's product (:func:`stale_packed_copies`), and
:func:`verify_sync` raises :class:`WeightSyncMismatch`, one line naming the replica, the weight version (trainer step)
and the tensor. Its result's :meth:`VerifyResult.as_metrics` is ``weight_sync/verified`` (1.0/0.0),
``weight_sync/verify_max_abs_diff`` and ``weight_sync/verify_seconds``.

Entry points: :func:`trainer_proof` (trainer side, every rank, before sending: the stream to send and a
:class:`SyncProof` of a few KB that travels with the sync) and :func:`check_sync` (rollout side, right after the new
weights are live). The packed copies a probe finds missing are packed then, as the next batch would have (not an
extra cost). The check's seconds per transport, and the command that measures them: ``docs/weight-sync.md``, "Per
transport: bytes, seconds and the check's cost".

Which check catches which failure (``tests/verl_backend/weight_sync/test_sync_verify.py``, the negative controls):

==========================================  ==================  =====================================
failure                                      probe (log-probs)   fingerprints / packed-copy check
==========================================  ==================  =====================================
one tensor dropped (smallest, 1e-5 rel.)     no (below bound)    yes: names it
stale weights (the previous version)         yes                 yes: names the first tensor
nothing delivered                            yes                 yes: names the first tensor
packed copies not rebuilt                    yes                 sources equal; packed check names it
==========================================  ==================  =====================================
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "Probe",
    "SyncProof",
    "VerifyResult",
    "WeightSyncMismatch",
    "check_sync",
    "fingerprint",
    "fingerprint_stream",
    "make_probe",
    "register_trainer_module",
    "take_proof",
    "trainer_proof",
    "probe_bound",
    "probe_score",
    "rollout_probe",
    "stale_packed_copies",
    "trainer_fingerprints",
    "trainer_probe",
    "verify_sync",
]

#: most elements of one tensor a fingerprint reads (a fixed stride through it); a tensor this small or smaller is read
#: whole
SAMPLE = 4096

#: both sides 32 bits or more: every probe value within ``ATOL_32 + RTOL_32 * |log-prob|`` (module doc)
ATOL_32, RTOL_32 = 1e-4, 2e-5
#: a 16-bit side: the probe's mean |difference| within this (module doc)
MEAN_16 = 0.25


class WeightSyncMismatch(RuntimeError):
    """What the rollout computes with is not the trainer's model; the message is one line (replica, version,
    first differing tensor where found)."""


# ------------------------------------------------------------------------------------------------------ the probe
@dataclass(frozen=True)
class Probe:
    """The fixed probe of a job.

    Attributes:
        token_ids: ``(sequences, length)`` int64, none of them a stop token of the sampler.
        prompt_len: tokens prefilled; positions ``prompt_len - 1 .. length - 2`` are scored (each predicting the next).
        vocab_ids: ``(k,)`` int64 vocabulary ids whose log-probs are compared at every scored position.
    """

    token_ids: torch.Tensor
    prompt_len: int
    vocab_ids: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """The log-probs' shape: ``(sequences, length - prompt_len, 1 + k)``."""
        s, length = self.token_ids.shape
        return (s, length - self.prompt_len, 1 + self.vocab_ids.numel())


def make_probe(
    vocab_size: int,
    seed: int = 0,
    sequences: int = 2,
    length: int = 16,
    prompt_len: int = 12,
    k: int = 64,
    avoid: Iterable[int] = (),
) -> Probe:
    """The job's probe: ``sequences x length`` token ids in ``[0, vocab_size)`` other than ``avoid`` (the sampler's
    stop tokens: a forced stop token would end a row) and ``k`` vocabulary ids, all drawn from ``seed``."""
    if not 1 <= prompt_len < length:
        raise ValueError(f"prompt_len={prompt_len} with length={length}: give 1 <= prompt_len < length")
    g = torch.Generator().manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    for t in avoid:
        if 0 <= int(t) < vocab_size:
            allowed[int(t)] = False
    pool = allowed.nonzero().squeeze(-1)
    ids = pool[torch.randint(0, pool.numel(), (sequences, length), generator=g)]
    vocab_ids = torch.randperm(vocab_size, generator=g)[: min(k, vocab_size)]
    return Probe(token_ids=ids, prompt_len=int(prompt_len), vocab_ids=vocab_ids)


def _gather(logits: torch.Tensor, probe: Probe) -> torch.Tensor:
    """``logits`` ``(sequences, scored, vocab)`` -> the probe's ``(sequences, scored, 1 + k)`` float32 log-probs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nxt = probe.token_ids[:, probe.prompt_len :].to(logp.device)  # (sequences, scored): each position's next token
    vocab = probe.vocab_ids.to(logp.device).expand(*nxt.shape, -1)
    return torch.cat([logp.gather(-1, nxt[..., None]), logp.gather(-1, vocab)], dim=-1).cpu()


def _hf_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward takes ``input_ids`` (FSDP1's wrapper forwards them; a peft model does too)."""
    return module


@torch.no_grad()
def trainer_probe(module: torch.nn.Module, probe: Probe, return_dtype: bool = False):
    """The probe's log-probs from the trainer's module: one forward of the whole sequences, no cache, eval mode for
    the call (training mode put back). Every FSDP rank must call it (the forward gathers the shards).

    Returns:
        ``(sequences, length - prompt_len, 1 + k)`` float32 on the CPU (:attr:`Probe.shape`); with
        ``return_dtype``, also the dtype the module computed its logits in (FSDP mixed precision: its param dtype),
        for :func:`verify_sync`'s ``trainer_dtype``.
    """
    was = module.training
    module.eval()
    try:
        device = next(module.parameters()).device
        ids = probe.token_ids.to(device)
        keep = probe.token_ids.shape[1] - probe.prompt_len + 1  # the scored positions and the last
        try:
            logits = _hf_module(module)(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
        except TypeError:  # a forward without logits_to_keep: every position
            logits = _hf_module(module)(input_ids=ids, use_cache=False).logits  # (sequences, length, vocab)
        out = _gather(logits[:, -keep:-1], probe)
        return (out, logits.dtype) if return_dtype else out
    finally:
        module.train(was)


_FORCED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("rl_tpu_probe_forcing", default=None)


def _forced_choice(original):
    def choose(logits, *args, **kwargs):
        state = _FORCED.get()
        if state is None:  # another thread sampling: untouched
            return original(logits, *args, **kwargs)
        t = len(state["logits"])
        state["logits"].append(logits.float().clone())  # (batch, vocab): the rows still in the batch
        tok = state["tokens"][:, t].to(logits.device)
        if tok.shape[0] != logits.shape[0]:
            raise RuntimeError(
                f"probe: the sampler's batch has {logits.shape[0]} rows at step {t}, the probe {tok.shape[0]}"
            )
        return tok, None

    choose.rl_tpu_forced = True
    return choose


@contextlib.contextmanager
def _forcing(tokens: torch.Tensor) -> Iterator[dict]:
    """Within the block, the sampler's token choice in this thread returns ``tokens[:, t]`` at step ``t`` and records
    the logits it was given; other threads choose as before."""
    import rl_tpu.sampler.engine as engine

    if not getattr(engine.choose_tokens, "rl_tpu_forced", False):
        engine.choose_tokens = _forced_choice(engine.choose_tokens)
    state = {"tokens": tokens, "logits": []}
    token = _FORCED.set(state)
    try:
        yield state
    finally:
        _FORCED.reset(token)


def rollout_probe(sampler, probe: Probe) -> torch.Tensor:
    """The probe's log-probs through the sampler's own forward path: :meth:`Sampler.generate` (greedy, one batch,
    ``length - prompt_len`` new tokens) on the first ``prompt_len`` tokens, each step fed the probe's next token.

    Returns:
        ``(sequences, length - prompt_len, 1 + k)`` float32 on the CPU (:attr:`Probe.shape`).
    """
    from rl_tpu.sampler import SamplingParams

    prompts = probe.token_ids[:, : probe.prompt_len].tolist()
    new = probe.token_ids.shape[1] - probe.prompt_len
    params = SamplingParams(temperature=0.0, max_new_tokens=new, logprobs=False)
    batch = sampler.max_batch_size
    sampler.max_batch_size = None  # one batch, the probe's rows in order (it sorts by length: all equal)
    try:
        with _forcing(probe.token_ids[:, probe.prompt_len :]) as state:
            outs = sampler.generate(prompts, params)
    finally:
        sampler.max_batch_size = batch
    got = [o.token_ids for o in outs]
    if got != probe.token_ids[:, probe.prompt_len :].tolist():
        raise RuntimeError("probe: the sampler did not take the probe's tokens (a stop token among them?)")
    logits = torch.stack(state["logits"], dim=1)[: probe.token_ids.shape[0]]  # (sequences, scored, vocab)
    return _gather(logits, probe)


def probe_bound(*dtypes: torch.dtype) -> tuple[str, float, float]:
    """The bound for probes computed in ``dtypes``: ``("max", atol, rtol)`` (every value within ``atol + rtol *
    |log-prob|``) when all are 32-bit or wider, else ``("mean", limit, 0)`` (module doc)."""
    if all(torch.finfo(d).bits >= 32 for d in dtypes):
        return ("max", ATOL_32, RTOL_32)
    return ("mean", MEAN_16, 0.0)


def probe_score(got: torch.Tensor, want: torch.Tensor, *dtypes: torch.dtype) -> float:
    """The probe's difference as a fraction of its bound (:func:`probe_bound`): at most 1 passes; NaN fails."""
    kind, atol, rtol = probe_bound(*dtypes)
    diff = (got.float() - want.float()).abs()
    if diff.numel() == 0:
        return 0.0
    if kind == "max":
        return float((diff / (atol + rtol * want.float().abs())).max())
    return float(diff.mean()) / atol


# ------------------------------------------------------------------------------------------------- fingerprints
def fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """A float64 weighted sum of a fixed strided sample (at most :data:`SAMPLE` elements, all of a smaller tensor)
    of ``tensor`` as cast to ``dtype`` (the rollout's; ``None``: its own). Weights ``1 + (i mod 13)``, so two
    elements' opposite changes do not cancel. Equal for two bit-equal tensors; cheap (the sample only is read)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0
    stride = max(1, n // SAMPLE)
    sample = flat[stride // 2 :: stride][:SAMPLE]
    if dtype is not None and sample.dtype != dtype:
        sample = sample.to(dtype)
    sample = sample.to("cpu", torch.float64)
    weights = 1.0 + (torch.arange(sample.numel(), dtype=torch.float64) % 13)
    return float((sample * weights).sum())


def fingerprint_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    into: dict[str, float],
    dtype: torch.dtype | None = None,
    also: dict[torch.dtype, dict[str, float]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``named_tensors`` (the trainer's weight stream) through unchanged, fingerprinting each tensor into
    ``into`` (name -> :func:`fingerprint` at ``dtype``) and into each ``also[d]`` at ``d`` as it goes; complete once
    the stream is consumed."""
    for name, tensor in named_tensors:
        if hasattr(tensor, "full_tensor"):  # gathered once here: the transport takes the whole tensor
            tensor = tensor.full_tensor()
        into[name] = fingerprint(tensor, dtype)
        for other, fps in (also or {}).items():
            fps[name] = fingerprint(tensor, other)
        yield name, tensor


def trainer_fingerprints(module: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, float]:
    """Fingerprints of a plain HF module's ``state_dict`` (its names are the rollout's) at ``dtype``. A wrapped
    module (FSDP, peft) is fingerprinted on what it sends instead: :func:`fingerprint_stream` over its export."""
    return {name: fingerprint(t, dtype) for name, t in module.state_dict().items()}


def _differs(a: float, b: float) -> bool:
    return abs(a - b) > 1e-12 * max(1.0, abs(a), abs(b))  # a reduction order's rounding at most


# --------------------------------------------------------------------------------------------- packed copies
@torch.no_grad()
def stale_packed_copies(sampler) -> list[str]:
    """Names (``<weight> (packed copy)``) of the sampler's packed copies that no longer compute their source
    weight's product: one fixed row through each copy against ``F.linear`` on the weight (float32 rounding ~1e-6
    relative; the bound 1e-4 relative). Reaches the eager packed weights, the lean decoder's fused q/k/v copies and
    the compiled steps' Python packing cache; the C++ op's cache is not reachable (the probe covers it)."""
    from rl_tpu.sampler import panel_kernel

    names = {id(m): n for n, m in sampler.model.named_modules()}
    out: list[str] = []

    def check(label: str, weight: torch.Tensor, run) -> None:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, weight.shape[1], generator=g)
        want = torch.nn.functional.linear(x, weight.detach().float())
        got = run(x)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            out.append(label)

    packed = getattr(sampler, "packed", None)
    if packed is not None and packed._packed is not None:
        for m, w in zip(packed.modules, packed._packed):
            check(
                f"{names.get(id(m), '?')}.weight (packed copy)",
                m.weight,
                lambda x, w=w, m=m: panel_kernel.linear(x, w, None, m.out_features),
            )
        for key, (w, _, splits, _) in list(packed._fused.items()):
            mods = [m for m in packed.modules if id(m) in key]
            mods.sort(key=lambda m: key.index(id(m)))
            weight = torch.cat([m.weight.detach() for m in mods])
            label = " + ".join(f"{names.get(id(m), '?')}.weight" for m in mods) + " (fused packed copy)"
            check(label, weight, lambda x, w=w, s=sum(splits): panel_kernel.linear(x, w, None, s))
    compiled = getattr(sampler, "compiled", None)
    cache = getattr(compiled, "packs", None) if compiled is not None else None
    if cache is not None:
        for name, m in sampler.model.named_modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight
                entry = cache._packed.get((w.data_ptr(), tuple(w.shape), tuple(w.stride())))
                if entry is not None:
                    check(
                        f"{name}.weight (compiled packed copy)",
                        w,
                        lambda x, p=entry[1], m=m: panel_kernel.linear(x, p, None, m.out_features),
                    )
    return out


# ------------------------------------------------------------------------------------------------ the verdict
@dataclass
class VerifyResult:
    """One sync's verification: ``ok``; the probe's ``max_abs_diff``, ``mean_abs_diff``, ``score`` (its difference
    as a fraction of its bound, :func:`probe_score`) and ``probe_ok``; ``seconds`` (the rollout side's check: its probe
    and fingerprints); ``pack_seconds`` (packing the sampler's weight copies before the probe: work the next batch would
    do anyway, so not the check's cost); ``differing`` (tensors whose fingerprint differs, else stale packed copies),
    ``first_tensor`` (the first of them, or ``None``), ``unchecked`` (fingerprints sent under names the model does not
    have, e.g. an adapter-only LoRA payload's matrices: the rollout merges them, so only the probe checks them) and the
    one-line ``message``."""

    ok: bool
    max_abs_diff: float
    mean_abs_diff: float
    score: float
    probe_ok: bool
    seconds: float
    pack_seconds: float = 0.0
    first_tensor: str | None = None
    differing: list[str] = field(default_factory=list)
    unchecked: int = 0
    message: str = ""

    def as_metrics(self) -> dict[str, float]:
        return {
            "weight_sync/verified": 1.0 if self.ok else 0.0,
            "weight_sync/verify_max_abs_diff": float(self.max_abs_diff),
            "weight_sync/verify_probe_score": float(self.score),
            "weight_sync/verify_seconds": float(self.seconds),
            "weight_sync/verify_pack_seconds": float(self.pack_seconds),
        }


def _native_compiled_packs(sampler) -> bool:
    """Whether the sampler's compiled steps multiply by packed copies in the C++ op's cache."""
    from rl_tpu.sampler import panel_kernel

    compiled = getattr(sampler, "compiled", None)
    return compiled is not None and compiled.packs is not None and panel_kernel.backend() == "panel"


def _compute_dtype(sampler) -> torch.dtype:
    return next(sampler.model.parameters()).dtype


def _probe_difference(
    got: torch.Tensor, want: torch.Tensor, dtypes: tuple[torch.dtype, torch.dtype]
) -> tuple[float, float, float]:
    """The rollout's probe log-probs ``got`` against the trainer's ``want`` (both ``(sequences, scored, 1 + k)``
    float32 on the CPU), the sides computed in ``dtypes`` (trainer, rollout).

    Returns:
        ``(max_abs_diff, mean_abs_diff, score)``: the differences (0.0 for an empty probe) and :func:`probe_score`
        (pass: at most 1.0; NaN fails).
    """
    diff = (got - want).abs()
    max_diff, mean_diff = (float(diff.max()), float(diff.mean())) if diff.numel() else (0.0, 0.0)
    return max_diff, mean_diff, probe_score(got, want, *dtypes)


def _differing_fingerprints(sampler, trainer_fps: dict[str, float] | None) -> tuple[list[str], int]:
    """The sampler's source tensors whose :func:`fingerprint` at its compute dtype differs from the trainer's.

    Returns:
        ``(differing, unchecked)``: the differing names in the trainer's order (the first named is the first sent;
        ``[]`` without ``trainer_fps``), and how many fingerprints name no tensor of the model (an adapter-only LoRA
        payload's A/B matrices: the probe covers what they became).
    """
    differing: list[str] = []
    unchecked = 0
    if trainer_fps:
        own = sampler._tensors
        dtype = _compute_dtype(sampler)
        for name, fp in trainer_fps.items():  # in the trainer's order: the first named is the first sent
            t = own.get(name)
            if t is None:  # not a model tensor (an adapter-only LoRA payload's A/B): the probe covers what it became
                unchecked += 1
            elif _differs(fingerprint(t, dtype), fp):
                differing.append(name)
    return differing, unchecked


def _mismatch_message(
    sampler,
    differing: list[str],
    dtypes: tuple[torch.dtype, torch.dtype],
    max_diff: float,
    mean_diff: float,
    probe_ok: bool,
    replica: int | str,
    version: int | None,
) -> str:
    """The one line of a failed verification: the replica, the weight version, the first differing tensor (or why
    none was found) and the probe's differences against its bound (:func:`probe_bound` of ``dtypes``)."""
    first = differing[0] if differing else None
    if first:
        what = f"first differing tensor {first}" + (f" (+{len(differing) - 1} more)" if len(differing) > 1 else "")
    elif _native_compiled_packs(sampler):
        what = (
            "every source tensor matches: the compiled steps' packed copies (rl-tpu's C++ cache, not readable "
            "from here) are stale"
        )
    else:
        what = "no single tensor found (every fingerprint and reachable packed copy matches)"
    kind, atol, rtol = probe_bound(*dtypes)
    bound = f"each within {atol:g} + {rtol:g}|log-prob|" if kind == "max" else f"mean within {atol:g}"
    return (
        f"weight sync not verified: rollout replica {replica}, weight version {version}: {what}; probe "
        f"log-probs differ by max {max_diff:.3g}, mean {mean_diff:.3g} ({bound}: "
        f"{'passed' if probe_ok else 'failed'})"
    )


def verify_sync(
    sampler,
    probe: Probe,
    trainer_logprobs: torch.Tensor,
    trainer_fps: dict[str, float] | None,
    *,
    replica: int | str,
    version: int | None,
    trainer_dtype: torch.dtype = torch.float32,
    raise_on_mismatch: bool = True,
) -> VerifyResult:
    """Verify the sync just applied to ``sampler`` against what the trainer sent.

    Args:
        sampler: the rollout's :class:`rl_tpu.sampler.Sampler`, its new weights live (call right after the apply,
            before the next generate, with no batch running).
        probe: the job's :func:`make_probe`.
        trainer_logprobs: :func:`trainer_probe` of the trainer's module at this version.
        trainer_fps: :func:`fingerprint_stream` / :func:`trainer_fingerprints` at the rollout's dtype (``None``: the
            probe only).
        replica, version: named in the message (the rollout replica; the trainer step of the weights).
        trainer_dtype: the dtype the trainer's probe was computed in (with the rollout's: :func:`probe_bound`).
        raise_on_mismatch: raise :class:`WeightSyncMismatch` (one line) instead of returning a failed result.
    """
    pack_start = time.perf_counter()
    packed = getattr(sampler, "packed", None)
    if packed is not None:  # what the next batch would pack anyway: timed apart from the check
        packed.prepare()
    start = time.perf_counter()
    pack_seconds = start - pack_start
    got = rollout_probe(sampler, probe)
    want = trainer_logprobs.to(torch.float32).cpu()
    if got.shape != want.shape:
        raise WeightSyncMismatch(
            f"weight sync not verified: rollout replica {replica}, weight version {version}: "
            f"probe shapes differ (trainer {tuple(want.shape)}, rollout {tuple(got.shape)})"
        )
    dtypes = (trainer_dtype, _compute_dtype(sampler))
    max_diff, mean_diff, score = _probe_difference(got, want, dtypes)
    probe_ok = score <= 1.0  # NaN fails
    differing, unchecked = _differing_fingerprints(sampler, trainer_fps)
    if not probe_ok and not differing:  # the sources are the trainer's: the copies the sampler computes with?
        differing = stale_packed_copies(sampler)
    ok = probe_ok and not differing
    first = differing[0] if differing else None
    message = ""
    if not ok:
        message = _mismatch_message(sampler, differing, dtypes, max_diff, mean_diff, probe_ok, replica, version)
    result = VerifyResult(
        ok=ok,
        max_abs_diff=max_diff,
        mean_abs_diff=mean_diff,
        score=score,
        probe_ok=probe_ok,
        seconds=time.perf_counter() - start,
        pack_seconds=pack_seconds,
        first_tensor=first,
        differing=differing,
        unchecked=unchecked,
        message=message,
    )
    if not ok and raise_on_mismatch:
        raise WeightSyncMismatch(message)
    return result


# ----------------------------------------------------------------------------- one sync's proof, end to end
@dataclass
class SyncProof:
    """What the trainer sends with a sync for the rollout to verify it (a few KB; picklable, so it travels by Ray).

    Attributes:
        version: the trainer step of the weights.
        probe: the probe (its token ids travel: the rollout needs no seed of its own).
        logprobs: :func:`trainer_probe` of the trainer's module at ``version``.
        dtype: the dtype name the trainer computed the probe in (``"float32"``).
        fingerprints: name -> :func:`fingerprint` at the rollout's dtype of every tensor sent, in the order sent;
            complete once the stream :func:`trainer_proof` returned is consumed.
        fingerprints_at: when the sender did not know the rollout's dtype (the ``gloo`` engine between pools):
            dtype name -> such fingerprints at that dtype, one set per candidate; :func:`check_sync` takes the set of
            the sampler's dtype (``fingerprints`` is then the first candidate's).
    """

    version: int | None
    probe: Probe
    logprobs: torch.Tensor
    dtype: str
    fingerprints: dict[str, float] = field(default_factory=dict)
    fingerprints_at: dict[str, dict[str, float]] = field(default_factory=dict)

    def fingerprints_for(self, dtype: torch.dtype) -> dict[str, float] | None:
        """The fingerprints to compare a rollout computing in ``dtype`` with (``None``: none were taken at it, the
        probe alone checks the sync)."""
        if not self.fingerprints_at:
            return self.fingerprints
        return self.fingerprints_at.get(str(dtype).removeprefix("torch."))


def _stop_ids(module: torch.nn.Module) -> list[int]:
    ids: set[int] = set()
    for cfg in (getattr(module, "config", None), getattr(module, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return sorted(ids)


def trainer_proof(
    module: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    version: int | None,
    rollout_dtype: torch.dtype | str | tuple | None = None,
    seed: int = 0,
    probe: Probe | None = None,
) -> tuple[Iterator[tuple[str, torch.Tensor]], SyncProof]:
    """Trainer side of one sync, right after the optimizer step and before sending (every FSDP rank calls it: the
    probe's forward is collective there): the probe's log-probs from ``module`` now, and ``weights`` passed through
    :func:`fingerprint_stream` at ``rollout_dtype`` (the rollout's ``actor_rollout_ref.rollout.dtype``; a tuple of
    dtypes when the sender does not know it: one set of fingerprints per dtype, :attr:`SyncProof.fingerprints_at`).

    Returns:
        ``(stream to send, proof)``; ``proof.fingerprints`` fills as the stream is consumed.
    """
    inner = module.get_base_model() if hasattr(module, "get_base_model") else module
    if probe is None:
        vocab = (
            int(inner.get_output_embeddings().weight.shape[0])
            if inner.get_output_embeddings() is not None
            else int(inner.config.vocab_size)
        )
        probe = make_probe(vocab, seed=seed, avoid=_stop_ids(inner))
    logprobs, dtype = trainer_probe(module, probe, return_dtype=True)
    candidates = [
        getattr(torch, d) if isinstance(d, str) else d
        for d in (rollout_dtype if isinstance(rollout_dtype, (tuple, list)) else (rollout_dtype,))
    ]
    proof = SyncProof(version=version, probe=probe, logprobs=logprobs, dtype=str(dtype).removeprefix("torch."))
    also: dict[torch.dtype, dict[str, float]] = {}
    if len(candidates) > 1:
        proof.fingerprints_at = {str(d).removeprefix("torch."): {} for d in candidates}
        proof.fingerprints = proof.fingerprints_at[str(candidates[0]).removeprefix("torch.")]
        also = {d: proof.fingerprints_at[str(d).removeprefix("torch.")] for d in candidates[1:]}
    return fingerprint_stream(weights, proof.fingerprints, candidates[0], also), proof


def check_sync(sampler, proof: SyncProof, replica: int | str, raise_on_mismatch: bool = True) -> VerifyResult:
    """Rollout side of one sync: :func:`verify_sync` of ``sampler`` (its new weights live) against ``proof``."""
    fps = proof.fingerprints_for(_compute_dtype(sampler))
    return verify_sync(
        sampler,
        proof.probe,
        proof.logprobs,
        fps,
        replica=replica,
        version=proof.version,
        trainer_dtype=getattr(torch, proof.dtype),
        raise_on_mismatch=raise_on_mismatch,
    )


# ------------------------------------------------------- the engine -> adapter hand-over inside a trainer worker
_MODULES: dict[str, tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]] = {}  # role -> module


def register_trainer_module(
    module: torch.nn.Module | None,
    role: str = "actor",
    probe_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> None:
    """The trainer's engine names its module (an HF causal LM, peft- or FSDP-wrapped) to this process's rollout
    adapter, which scores the probe on it at each sync (:func:`take_proof`); ``None`` withdraws it.
    ``probe_context``: entered around the probe's forward (the compiled trainer's
    :meth:`rl_tpu.compiled_blocks.CompiledBlocks.eager`: the probe's shape costs no graph)."""
    if module is None:
        _MODULES.pop(role, None)
    else:
        _MODULES[role] = (module, probe_context or contextlib.nullcontext)


def take_proof(
    weights: Iterable[tuple[str, torch.Tensor]],
    version: int | None,
    rollout_dtype: torch.dtype | str | tuple | None,
    role: str = "actor",
):
    """The rollout adapter, on every rank, as VeRL hands it the export right after the optimizer step:
    ``(stream to send, SyncProof)`` (:func:`trainer_proof` on the registered module: the probe scored now, the
    stream fingerprinted at ``rollout_dtype`` as it passes); ``(weights, None)`` when no module is registered in this
    process (a standalone rollout replica fed by the pool transports: there the proof comes from the ``gloo``
    engine's source, after the stream, :attr:`~verl_backend.weight_sync.pool_stream.ReceivedWeights.proof`)."""
    entry = _MODULES.get(role)
    if entry is None:
        return weights, None
    module, probe_context = entry
    with probe_context():
        return trainer_proof(module, weights, version, rollout_dtype)
