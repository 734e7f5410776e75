"""Per-sample random streams: each sampled row draws its uniforms from a seed of its own, so a completion depends on
its seed, its prompt and the model, never on which other rows share its batch or where it sits in it.

A row's seed is :func:`sample_seed` of whatever identifies the sample (a rollout server uses the job seed, the
rollout seed, the weight version, VeRL's request id and the prompt's tokens); its stream is a CPU
``torch.Generator`` (Mersenne Twister) seeded with it, from which :func:`row_uniforms` takes one uniform per
generated token. The token choice (:func:`rl_tpu.sampler.processing.choose_tokens`) is inverse-CDF: the row's
uniform for step ``t`` against that row's own processed distribution, so one uniform per row and step suffices
(Gumbel-max would need one per vocabulary entry) and temperature, top-k and top-p mean what they meant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

SEED_BITS = 63  # torch.Generator.manual_seed takes any non-negative 64-bit value; 63 keeps it a positive int64


def sample_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (ints, strings, ``None``, or flat sequences of ints such as token ids): BLAKE2b
    of their canonical text, so the same parts give the same seed in every process and run (unlike ``hash()``,
    which ``PYTHONHASHSEED`` salts) and different parts practically never share one."""
    h = hashlib.blake2b(digest_size=8, person=b"rl-tpu-sample")
    for p in parts:
        if isinstance(p, (list, tuple)):
            text = "[" + ",".join(str(int(x)) for x in p) + "]"
        elif isinstance(p, (bool, int)):
            text = str(int(p))
        else:
            text = repr(p)
        h.update(text.encode())
        h.update(b"\x1f")  # unit separator: ("1", "23") and ("12", "3") differ
    return int.from_bytes(h.digest(), "little") >> (64 - SEED_BITS)


def row_uniforms(
    seeds: Sequence[int], steps: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``(len(seeds), steps)`` uniforms in ``[0, 1)``: row ``r`` is the first ``steps`` float64 draws of a CPU
    ``torch.Generator`` seeded with ``seeds[r]`` (so a row's first ``k`` draws do not depend on ``steps``), moved to
    ``device`` as ``dtype`` (float32 where the device has no fast float64)."""
    out = torch.empty((len(seeds), steps), dtype=torch.float64)
    gen = torch.Generator()
    for r, seed in enumerate(seeds):
        gen.manual_seed(int(seed))
        torch.rand(steps, dtype=torch.float64, generator=gen, out=out[r])
    return out.to(device=device, dtype=dtype) if device is not None or dtype != torch.float64 else out
