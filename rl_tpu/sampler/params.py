"""Sampling settings and per-sample results of the native sampler."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplerError(ValueError):
    """Bad sampler input; the message is one line naming the input, where it is, and the fix."""


@dataclass
class SamplingParams:
    """How to draw completions (the names follow vLLM's ``SamplingParams``, which VeRL's rollout config uses).

    Attributes:
        n: completions per prompt (the prompt rows are repeated ``n`` times).
        temperature: logits are divided by it before sampling; ``0`` means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability sums to at least
            ``top_p`` (``1.0`` keeps all). Applied after ``top_k``, on the renormalised top-k distribution.
        top_k: keep the ``top_k`` most likely tokens; ``-1`` (or ``0``) keeps all.
        max_new_tokens: most tokens generated per completion, stop token included.
        stop_token_ids: tokens that end a completion besides the sampler's EOS tokens; the stop token is kept in
            the output, as vLLM does.
        seed: seed of the sampling random generator; ``None`` draws one from torch's global generator. The same
            seed, prompts and settings give the same completions.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

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
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

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
            ``log_softmax(logits)`` when greedy), taken *before* top-k/top-p truncation; natural log, float.
        finish_reason: ``"stop"`` (ended on an EOS or stop token) or ``"length"`` (hit ``max_new_tokens``).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
