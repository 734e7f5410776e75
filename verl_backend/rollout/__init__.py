"""The ``native`` rollout: VeRL's rollout replica/server contract served by the rl_tpu sampler, no vLLM."""

SERVER_NAME_PREFIX = "rl_tpu_native_server_"


def server_actor_name(replica_rank: int, suffix: str = "") -> str:
    """Ray actor name of the rollout server of one replica (looked up by the trainer's weight-sync adapter)."""
    return f"{SERVER_NAME_PREFIX}{replica_rank}{suffix}"
