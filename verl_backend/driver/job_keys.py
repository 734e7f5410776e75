"""Reading a composed VeRL config the way the TPU job's plans do: the shared bottom of the memory plan
(:mod:`verl_backend.driver.memory_plan`) and the AOT graph list (:mod:`verl_backend.driver.aot.graphs`), so that the
imports between ``driver`` and ``driver/aot`` run one way (``aot`` reads the plan; the plan never imports ``aot``).
No torch import."""

from __future__ import annotations


def config_get(config, key: str, default=None):
    """The value at the dotted ``key`` of a nested config (a dict or OmegaConf node), else ``default`` (also for a
    null)."""
    node = config
    for part in key.split("."):
        node = node.get(part) if hasattr(node, "get") else None
        if node is None:
            return default
    return node


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def per_chip_micro_batch(get, key: str, ranks: int) -> int:
    """Sequences a chip runs at once for the VeRL micro batch ``key`` (a ``…_micro_batch_size_per_gpu``), read through
    ``get(key, default)``: its value, else VeRL's global ``…_micro_batch_size`` split over the ``ranks`` that share it
    (as VeRL's workers normalise it); 0 when neither is set."""
    per_chip = get(key, 0) or int(get(key[: -len("_per_gpu")], 0) or 0) // max(1, ranks)
    return int(per_chip or 0)


def runs_critic(get) -> bool:
    """Whether the job trains VeRL's critic: PPO with GAE (``algorithm.adv_estimator=gae``) and ``critic.enable``
    not ``false``, read through ``get(key, default)``."""
    return str(get("algorithm.adv_estimator", "grpo")) == "gae" and get("critic.enable", None) is not False
