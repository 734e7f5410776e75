"""Sampling settings and per-sample results of the native sampler, and the one place a vLLM-style request (what
VeRL's agent loop sends a rollout server) becomes :class:`SamplingParams`;
:func:`check_request`, what the sampler refuses before sampling."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class SamplerError(ValueError):
    """Bad sampler input; the message is one line naming the input, where it is, and the fix."""


@dataclass(frozen=True)
class SamplingParams:
    """How to draw completions (the names follow vLLM's ``SamplingParams``, which VeRL's rollout config uses).

    Frozen and hashable: a rollout server batches the requests whose settings are equal.

    Attributes:
        n: completions per prompt (the prompt rows are repeated ``n`` times).
        temperature: logits are divided by it before sampling; ``0`` means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability sums to at least
            ``top_p`` (``1.0`` keeps all). Applied after ``top_k``, on the renormalised top-k distribution.
        top_k: keep the ``top_k`` most likely tokens; ``-1`` (or ``0``) keeps all.
        max_new_tokens: most tokens generated per completion, stop token included.
        stop_token_ids: tokens that end a completion besides the sampler's EOS tokens; the stop token is kept in
            the output, as vLLM does (stored as a tuple).
        seed: seed of the samples' random streams (sample ``j`` of prompt ``i`` of a ``generate`` call draws from
            ``(seed, i, j)``, :mod:`rl_tpu.sampler.seeds`; per-prompt seeds given to ``generate`` take its place);
            ``None`` draws from torch's global generator. The same seed, prompts and settings give the same
            completions, however the call is cut into batches.
        repetition_penalty: ``> 0``; ``1.0`` is off. Each token already in the row (prompt or generated) has its
            logit divided by it when positive, multiplied when negative, before temperature: HF's
            ``RepetitionPenaltyLogitsProcessor`` and vLLM's ``repetition_penalty`` (both count the prompt).
        min_tokens: the EOS and stop tokens cannot be chosen before this many tokens are generated (their logits
            are ``-inf``): vLLM's ``min_tokens``, HF's ``MinNewTokensLengthLogitsProcessor``. ``0`` is off.
        logprobs: return each chosen token's log-prob (:attr:`SampleOutput.logprobs`); ``False`` gives ``None``
            there and spares the greedy path its log-softmax.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplerError(f"SamplingParams.n={self.n!r}: give a positive number of samples per prompt")
        if not self.temperature >= 0:
            raise SamplerError(f"SamplingParams.temperature={self.temperature!r}: give 0 (greedy) or a positive value")
        if not 0 < self.top_p <= 1:
            raise SamplerError(f"SamplingParams.top_p={self.top_p!r}: give a value in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplerError(f"SamplingParams.top_k={self.top_k!r}: give -1 (all tokens) or a positive count")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplerError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: give a positive count")
        if not self.repetition_penalty > 0:
            raise SamplerError(
                f"SamplingParams.repetition_penalty={self.repetition_penalty!r}: give a positive value (1.0 is off)"
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise SamplerError(
                f"SamplingParams.min_tokens={self.min_tokens!r}: give a count from 0 to max_new_tokens "
                f"({self.max_new_tokens})"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logprobs", bool(self.logprobs))

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0


@dataclass
class SampleOutput:
    """One completion.

    Attributes:
        token_ids: generated tokens, the stop/EOS token included when the completion stopped on one.
        logprobs: for each generated token, ``log_softmax(logits / temperature)`` at that token (plain
            ``log_softmax(logits)`` when greedy), taken *before* repetition penalty, min tokens and top-k/top-p;
            natural log, float. ``None`` when ``SamplingParams.logprobs`` is off.
        finish_reason: ``"stop"`` (ended on an EOS or stop token) or ``"length"`` (hit ``max_new_tokens``).
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str


# --------------------------------------------------------------------------------- requests (vLLM / SGLang names)
HONOURED, NO_EFFECT, DEFAULT_ONLY = "honoured", "no effect on sampling", "default only"

#: Every sampling-request key the native rollout knows: ``key -> (what happens, its default values)``.
#: HONOURED keys become :class:`SamplingParams` fields (``max_new_tokens``/``min_new_tokens`` are SGLang's names for
#: ``max_tokens``/``min_tokens``; ``logprobs`` is VeRL's bool, any truthy value returning the chosen tokens'
#: log-probs as VeRL's vLLM adapter does). NO_EFFECT keys pass with any value: they shape text output or
#: streaming, and the rollout returns token ids. DEFAULT_ONLY keys pass only at their default values (vLLM's
#: ``SamplingParams`` defaults, plus the empty forms a client may send), else :func:`request_params` refuses the
#: request. Any key not listed is refused unless ``None`` (vLLM's ``SamplingParams`` refuses unknown keys too).
REQUEST_KEYS: dict[str, tuple[str, tuple]] = {
    "temperature": (HONOURED, (1.0,)),
    "top_p": (HONOURED, (1.0,)),
    "top_k": (HONOURED, (-1, 0)),
    "max_tokens": (HONOURED, ()),
    "max_new_tokens": (HONOURED, ()),
    "stop_token_ids": (HONOURED, (None, ())),
    "repetition_penalty": (HONOURED, (1.0,)),
    "min_tokens": (HONOURED, (0,)),
    "min_new_tokens": (HONOURED, (0,)),
    "logprobs": (HONOURED, (None, False)),
    "seed": (HONOURED, (None,)),
    "detokenize": (NO_EFFECT, ()),
    "skip_special_tokens": (NO_EFFECT, ()),
    "spaces_between_special_tokens": (NO_EFFECT, ()),
    "include_stop_str_in_output": (NO_EFFECT, ()),
    "no_stop_trim": (NO_EFFECT, ()),
    "output_kind": (NO_EFFECT, ()),
    "flat_logprobs": (NO_EFFECT, ()),
    "n": (DEFAULT_ONLY, (1,)),
    "best_of": (DEFAULT_ONLY, (None, 1)),
    "presence_penalty": (DEFAULT_ONLY, (0.0,)),
    "frequency_penalty": (DEFAULT_ONLY, (0.0,)),
    "min_p": (DEFAULT_ONLY, (0.0,)),
    "ignore_eos": (DEFAULT_ONLY, (False,)),
    "stop": (DEFAULT_ONLY, (None, (), "")),
    "prompt_logprobs": (DEFAULT_ONLY, (None,)),
    "logit_bias": (DEFAULT_ONLY, (None, {})),
    "allowed_token_ids": (DEFAULT_ONLY, (None,)),
    "bad_words": (DEFAULT_ONLY, (None, ())),
    "logits_processors": (DEFAULT_ONLY, (None, ())),
    "truncate_prompt_tokens": (DEFAULT_ONLY, (None,)),
    "structured_outputs": (DEFAULT_ONLY, (None,)),
    "guided_decoding": (DEFAULT_ONLY, (None,)),
    "extra_args": (DEFAULT_ONLY, (None, {})),
}


def _at_default(value: Any, neutral: tuple) -> bool:
    if isinstance(value, list):
        value = tuple(value)
    return any(value == v for v in neutral)


def request_params(request: Mapping[str, Any], *, max_tokens: int) -> SamplingParams:
    """The :class:`SamplingParams` of one rollout request (one completion, ``n=1``).

    Args:
        request: the ``sampling_params`` dict of ``generate(request_id, prompt_ids, sampling_params)``, keys as in
            :data:`REQUEST_KEYS` (vLLM's names; SGLang's ``max_new_tokens``/``min_new_tokens`` too).
        max_tokens: the server's cap on new tokens; a request's ``max_tokens`` is clamped to ``[1, max_tokens]``
            and a request without one gets it (as VeRL's vLLM adapter does).

    Raises:
        SamplerError: one line naming a key whose value the native sampler cannot honour, its value, and what is
            supported; or a value :class:`SamplingParams` refuses.
    """
    for key, value in request.items():
        kind, neutral = REQUEST_KEYS.get(key, (None, (None,)))
        if kind in (HONOURED, NO_EFFECT) or _at_default(value, neutral):
            continue
        honoured = ", ".join(k for k, (how, _) in REQUEST_KEYS.items() if how == HONOURED)
        what = (
            "is not a sampling key the native rollout knows"
            if kind is None
            else f"is not supported by the native rollout (it passes only at {', '.join(map(repr, neutral))})"
        )
        raise SamplerError(
            f"sampling request {key}={value!r} {what}; supported keys: {honoured}; "
            "drop the key or use rollout.name=vllm"
        )

    def get(*names: str, default: Any) -> Any:
        return next((request[k] for k in names if request.get(k) is not None), default)

    want = get("max_tokens", "max_new_tokens", default=max_tokens)
    new = int(max(1, min(int(want), max_tokens)))
    top_k = int(get("top_k", default=-1))
    seed = get("seed", default=None)
    return SamplingParams(
        n=1,
        temperature=float(get("temperature", default=1.0)),
        top_p=float(get("top_p", default=1.0)),
        top_k=-1 if top_k == 0 else top_k,
        max_new_tokens=new,
        stop_token_ids=tuple(sorted(set(get("stop_token_ids", default=())))),
        seed=None if seed is None else int(seed),
        repetition_penalty=float(get("repetition_penalty", default=1.0)),
        min_tokens=int(get("min_tokens", "min_new_tokens", default=0)),
        logprobs=bool(get("logprobs", default=False)),
    )


def longrope_switch_length(config) -> int | None:
    """The sequence length (tokens) past which a ``longrope`` model (Phi-3 style, transformers'
    ``modeling_rope_utils.dynamic_rope_update``) switches every position's RoPE from ``short_factor`` to
    ``long_factor``, or ``None`` when the model has no such switch. The choice is made per forward call from the
    largest position id, so a KV cache filled below the switch disagrees with a forward over the whole sequence above
    it. Reads ``config.rope_parameters`` (transformers >= 5, possibly one dict per layer type) or ``rope_scaling``."""
    found = []
    for attr in ("rope_parameters", "rope_scaling"):
        spec = getattr(config, attr, None)
        if not isinstance(spec, dict):
            continue
        for d in [spec, *(v for v in spec.values() if isinstance(v, dict))]:
            if d.get("rope_type", d.get("type")) == "longrope":
                orig = d.get(
                    "original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None)
                )
                if orig is not None:
                    found.append(int(orig))
    return min(found) if found else None


def check_request(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    largest_prompt: int,
    largest_gen: int,
    vocab_size: int,
    config,
) -> None:
    """Refuse what the sampler cannot run, in one line (:class:`SamplerError`): ``params`` not a
    :class:`SamplingParams`, an empty prompt or one longer than ``largest_prompt`` tokens, a token id outside
    ``[0, vocab_size)``, ``max_new_tokens`` above ``largest_gen``, or prompt + new tokens past the model ``config``'s
    context length or its longrope switch (:func:`longrope_switch_length`)."""
    if not isinstance(params, SamplingParams):
        raise SamplerError(f"params is a {type(params).__name__}: pass rl_tpu.sampler.SamplingParams")
    longest = largest_prompt
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise SamplerError(f"prompt {i} is empty: give at least one token")
        if len(p) > longest:
            raise SamplerError(
                f"prompt {i} has {len(p)} tokens, more than the largest prompt bucket ({longest}): "
                "shorten or filter it, or pass larger prompt_buckets"
            )
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise SamplerError(
                f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size}): "
                "tokenize with the model's own tokenizer"
            )
    if params.max_new_tokens > largest_gen:
        raise SamplerError(
            f"max_new_tokens={params.max_new_tokens} is more than the largest generation bucket "
            f"({largest_gen}): lower it or pass larger gen_buckets"
        )
    ctx = getattr(config, "max_position_embeddings", None)
    need = max((len(p) for p in prompts), default=0) + params.max_new_tokens
    if ctx is not None and need > ctx:
        raise SamplerError(
            f"prompt + max_new_tokens = {need} tokens is past the model's context length ({ctx}): "
            "lower max_new_tokens or shorten the prompts"
        )
    switch = longrope_switch_length(config)
    if switch is not None and need > switch:
        raise SamplerError(
            f"prompt + max_new_tokens = {need} tokens is past {switch}, where this model's longrope RoPE switches "
            "from its short to its long factors: a sequence that crosses it is sampled with short-factor keys "
            "that a forward pass over the whole sequence computes with long factors (log-probs off by whole "
            f"nats). Keep prompt + max_new_tokens <= {switch}"
        )
