"""The native rollout's sampler set-up and requests: the sampler a rollout server (or an in-worker rollout) builds
over the policy's checkpoint, VeRL's sampling request as :class:`rl_tpu.sampler.SamplingParams`, and the
environment a rollout server actor starts with."""

from __future__ import annotations

import os
from typing import Any

import torch

from verl_backend.rollout.native_kwargs import native_engine_kwargs
from verl_backend.settings import RolloutSettings


def build_sampler(
    model_path: str,
    rollout_config: Any,
    device: torch.device | str,
    trust_remote_code: bool = False,
    settings: RolloutSettings | None = None,
):
    """An :class:`rl_tpu.sampler.Sampler` over a fresh inference copy of the HF model at ``model_path``.

    Buckets: powers of two up to ``rollout.prompt_length`` / ``rollout.response_length``; batch up to
    ``rollout.max_num_seqs``; dtype ``rollout.dtype``; compiled steps when ``settings.compile_sampler`` (the job's
    ``rl_tpu.compile_sampler``) is on (:mod:`rl_tpu.sampler.compiled`); the CPU fast paths as
    ``rollout.engine_kwargs.native`` fixes them (:func:`sampler_fast_paths`), else the sampler's per-device default.

    Args:
        settings: the rollout's section of the job's settings (:class:`verl_backend.settings.RolloutSettings`,
            built by the caller's entry point); ``None``: the table's defaults.

    Raises:
        ValueError: a fast-path switch that is not true or false (:func:`sampler_fast_paths`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_tpu.expert_slices import has_fused_experts, tpu_experts_kwargs
    from rl_tpu.sampler import Sampler

    from verl_backend.tpu_on_cpu import compile_backend

    settings = RolloutSettings() if settings is None else settings
    device = torch.device(device)
    dtype = getattr(torch, str(getattr(rollout_config, "dtype", "float32") or "float32"))
    experts = tpu_experts_kwargs(device.type)  # MoE on TPU: batched_mm, no torch.cumsum (rl_tpu.expert_slices)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation="sdpa",
        **experts,
    )
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []), tok.eos_token_id} - {None})
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    fast_paths = sampler_fast_paths(rollout_config)
    backend = (
        compile_backend(settings.compile_backend, "sampler", settings.compile_cache_dir)
        if settings.compile_sampler
        else None
    )
    if backend is not None:  # the chip's graphs: the model's own linear layers, not oneDNN's packed copies
        if fast_paths.get("packed_weights"):
            raise ValueError(
                "rollout.engine_kwargs.native.packed_weights=true with rl_tpu.compile_backend=tpu-on-cpu: packed "
                "weights are oneDNN's and no TPU graph has them; leave packed_weights unset"
            )
        fast_paths["packed_weights"] = False
    sampler = Sampler(
        model,
        pad_token_id=pad,
        eos_token_ids=eos_ids,
        prompt_buckets=_buckets(int(getattr(rollout_config, "prompt_length", 512))),
        gen_buckets=_buckets(int(getattr(rollout_config, "response_length", 512))),
        max_batch_size=max(1, int(getattr(rollout_config, "max_num_seqs", 64) or 64)),
        device=device,
        compile=bool(settings.compile_sampler),
        compile_backend=backend,
        **fast_paths,
    )
    on = {True: "on", False: "off"}
    float32 = next(sampler.model.parameters()).dtype == torch.float32  # oneDNN packs float32 weights only
    packed = float32 and (
        sampler.packed is not None or (sampler.compiled is not None and sampler.compiled.packs is not None)
    )
    print(
        f"[rl-tpu] native sampler ({dtype}, {device.type}): packed prefill {on[sampler.packed_prefill]}, lean "
        f"decode {on[sampler.lean_decode]}, packed weights {on[packed]}, compiled "
        f"{on[sampler.compiled is not None]}"
        + (f", experts {experts['experts_implementation']}" if experts and has_fused_experts(model) else ""),
        flush=True,
    )
    return sampler


def sampler_fast_paths(rollout_config: Any) -> dict[str, bool]:
    """The sampler's CPU fast paths the job's config fixes (``packed_prefill``, ``lean_decode``, ``packed_weights``
    of :class:`~verl_backend.rollout.native_kwargs.NativeEngineKwargs`); a key not given is left out (the sampler's
    per-device default).

    Raises:
        ValueError: a bad ``engine_kwargs.native`` (:func:`~verl_backend.rollout.native_kwargs.native_engine_kwargs`).
    """
    return native_engine_kwargs(rollout_config).fast_paths()


def _buckets(limit: int) -> tuple[int, ...]:
    """Powers of two from 16 up to ``limit`` (``limit`` itself last): a bounded set of compiled shapes."""
    out, b = [], 16
    while b < limit:
        out.append(b)
        b *= 2
    out.append(int(limit))
    return tuple(out)


def sampling_params_from_request(
    request: dict[str, Any], rollout_config: Any, response_length: int, replica_rank: int = 0
):
    """The one place VeRL's ``sampling_params`` dict becomes :class:`rl_tpu.sampler.SamplingParams`.

    As VeRL 0.9.1's vLLM adapter (``vllm_async_server.generate``) does, ``repetition_penalty`` and ``ignore_eos``
    default to the rollout config's keys and, with ``rollout.full_determinism``, ``seed`` to ``replica_rank +
    rollout.seed``; new tokens are capped at ``rollout.response_length``. Every key is then honoured or refused by
    :func:`rl_tpu.sampler.params.request_params` (its table :data:`~rl_tpu.sampler.params.REQUEST_KEYS`).

    Raises:
        rl_tpu.sampler.SamplerError: a key with a value the native sampler cannot honour (one line naming it).
    """
    from rl_tpu.sampler.params import request_params

    request = dict(request)
    request.setdefault("repetition_penalty", getattr(rollout_config, "repetition_penalty", 1.0))
    request.setdefault("ignore_eos", getattr(rollout_config, "ignore_eos", False))
    if getattr(rollout_config, "full_determinism", False) is True:
        request.setdefault("seed", replica_rank + int(getattr(rollout_config, "seed", 0)))
    return request_params(request, max_tokens=response_length)


def run_sampler(
    sampler, prompts: list[list[int]], params, seeds: list[int] | None = None, threads: int = 0
) -> list[tuple[list[int], list[float] | None]]:
    """Sample one response per prompt with ``params`` (:class:`rl_tpu.sampler.SamplingParams`, ``n=1``; the
    in-worker sampler receives it through Ray as ``key``) -> ``(token ids, log-probs or None)`` per prompt.
    ``seeds``: each prompt's random stream (:func:`verl_backend.rollout.server.sample_seed_of`).
    Samples with ``threads`` torch threads (:attr:`verl_backend.settings.RolloutSettings.threads`, handed down by the
    caller; 0: the process's count), the calling thread's count put back after (a trainer worker that samples
    in-process keeps its own count for the update)."""
    before = torch.get_num_threads()
    if threads and threads != before:
        torch.set_num_threads(threads)
    try:
        outs = sampler.generate(prompts, params, seeds=seeds)
    finally:
        if threads and threads != before:
            torch.set_num_threads(before)
    return [(list(o.token_ids), None if o.logprobs is None else [float(x) for x in o.logprobs]) for o in outs]


def server_env() -> dict[str, str]:
    """Environment for the server actor: the job's settings record and :data:`verl_backend.settings.FORWARDED_ENV`
    (thread count, OpenMP wait policy, TorchTPU autoload) as in the process that creates it (Ray merges these into
    the job's own runtime_env)."""
    from verl_backend.settings import FORWARDED_ENV, RECORD_ENV

    keep = (RECORD_ENV, *FORWARDED_ENV)
    return {k: os.environ[k] for k in keep if k in os.environ}
