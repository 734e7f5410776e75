"""The bypass guard: reuse the rollout's log-probs as the old policy's only where they are the same numbers.

VeRL's ``algorithm.rollout_correction.bypass_mode`` skips the trainer's old-log-prob forward and uses the log-probs
the rollout sampled with (VeRL 0.9.1 ``verl/trainer/ppo/rollout_corr_helper.py``, ``apply_bypass_mode``). PPO's
ratio ``pi_theta / pi_old`` is then right only if the rollout computes what the trainer computes. The CPU default
turns bypass on because there the native rollout samples with the trainer's own float32 weights. A rollout in
another precision than the actor's (e.g. ``rollout.dtype=bfloat16`` against a float32 actor: measured mean |Δ| 0.032,
max 0.28 nats per token on SmolLM2) does not: its log-probs would enter the loss as the old policy's.
"""

from __future__ import annotations

from verl_backend.errors import BadInputError

BYPASS_KEY = "algorithm.rollout_correction.bypass_mode"
_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}


def _dtype(name) -> str:
    return _DTYPES.get(str(name).strip().lower().removeprefix("torch."), str(name))


def rollout_trainer_mismatch(config) -> str | None:
    """Why the rollout's per-token log-probs would differ from the actor's for the same tokens, or ``None``.

    Compares the rollout's ``dtype`` with the dtype the actor computes in (its FSDP ``mixed_precision.param_dtype``,
    VeRL's default ``bf16`` when unset).
    """
    ref = config.actor_rollout_ref
    rollout = _dtype(ref.rollout.get("dtype", "bfloat16"))
    mp = ref.actor.get("fsdp_config", {}).get("mixed_precision", None) or {}
    actor = _dtype(mp.get("param_dtype", "bf16"))
    if rollout != actor:
        return f"the rollout samples in {rollout} (actor_rollout_ref.rollout.dtype) and the actor computes in {actor}"
    return None


def guard_bypass(config, user_keys: set[str]) -> str | None:
    """Turn bypass mode off where the rollout's log-probs are not the old policy's, or refuse the run.

    Args:
        config: the composed VeRL config (an OmegaConf mapping), changed in place.
        user_keys: the keys the user set (``--config`` file and command line).

    Returns:
        The line said to the user when bypass was turned off, else ``None``.

    Raises:
        BadInputError: the user asked for bypass mode themselves on a job where it would be wrong.
    """
    from omegaconf import OmegaConf, open_dict

    if not OmegaConf.select(config, BYPASS_KEY, default=False):
        return None
    why = rollout_trainer_mismatch(config)
    if why is None:
        return None
    if BYPASS_KEY in user_keys:
        raise BadInputError(
            f"{BYPASS_KEY}=true reuses the rollout's log-probs as the old policy's, but {why}: set "
            f"{BYPASS_KEY}=false (the trainer recomputes them) or give both the same dtype"
        )
    with open_dict(config):
        config.algorithm.rollout_correction.bypass_mode = False
    line = (
        f"[rl-tpu] {why}, so the rollout's log-probs are not the old policy's: {BYPASS_KEY} is off and the "
        "trainer recomputes them"
    )
    print(line, flush=True)
    return line
