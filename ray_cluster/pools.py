"""The rollout/trainer layout on TPU slices: VeRL's trainer (actor/ref/critic) and rollout workers both on one slice
(colocated, VeRL's hybrid engine) or each on its own slice, reserved through :mod:`ray_cluster.placement`.

Ray must already be initialised (``ray.init(address=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_tpu.topology import SliceTopology, check_chip_request, parse_slice

from .errors import ClusterError
from .placement import SlicePlacement, check_cluster_has, reserve_slice


@dataclass(frozen=True)
class PoolLayout:
    """Where VeRL's trainer (actor/ref/critic) and rollout workers go.

    Attributes:
        trainer_slice: accelerator type (``"v6e-16"`` or ``"v6e-16:4x4"``) for the trainer.
        rollout_slice: accelerator type for the rollout; None = same type as the trainer.
        colocate: True puts both on one slice (VeRL hybrid engine); False reserves two slices.
        chips_per_worker: whole chips per worker actor (1, 2, 4 or 8).
        cpus_per_host: CPUs reserved per host bundle.
    """

    trainer_slice: str
    rollout_slice: str | None = None
    colocate: bool = True
    chips_per_worker: int = 1
    cpus_per_host: float = 1.0

    def specs(self) -> dict[str, SliceTopology]:
        """Parsed slices by pool name (``trainer``, ``rollout``)."""
        t_type, _, t_topo = self.trainer_slice.partition(":")
        trainer = parse_slice(t_type, t_topo or None)
        if self.colocate:
            if self.rollout_slice and parse_slice(*_split(self.rollout_slice)) != trainer:
                raise ClusterError(
                    f"colocate=True puts rollout and trainer on one slice, but rollout_slice "
                    f"{self.rollout_slice!r} differs from trainer_slice {self.trainer_slice!r}; "
                    f"drop rollout_slice or set colocate=False"
                )
            return {"trainer": trainer, "rollout": trainer}
        rollout = parse_slice(*_split(self.rollout_slice)) if self.rollout_slice else trainer
        return {"trainer": trainer, "rollout": rollout}


def _split(text: str) -> tuple[str, str | None]:
    a, _, t = text.partition(":")
    return a, (t or None)


def place_pools(layout: PoolLayout, timeout_s: float = 60.0) -> dict[str, SlicePlacement]:
    """Reserve the slices of ``layout``: ``{"trainer": ..., "rollout": ...}`` (the same object
    when colocated).

    Raises:
        TopologyError: bad slice or chip count. ClusterError: the slices are not in the cluster
        (all of them are checked before anything is reserved) or stay busy.
    """
    specs = layout.specs()
    for spec in specs.values():
        check_chip_request(layout.chips_per_worker, spec)
    if layout.colocate:
        p = reserve_slice(
            specs["trainer"].accelerator_type,
            specs["trainer"].topology,
            cpus_per_host=layout.cpus_per_host,
            name="rl-tpu-colocated",
            timeout_s=timeout_s,
        )
        return {"trainer": p, "rollout": p}
    same = specs["trainer"].pod_type == specs["rollout"].pod_type
    check_cluster_has(specs["trainer"], 2 if same else 1)
    check_cluster_has(specs["rollout"], 2 if same else 1)
    out: dict[str, SlicePlacement] = {}
    try:
        for pool in ("trainer", "rollout"):
            s = specs[pool]
            out[pool] = reserve_slice(
                s.accelerator_type,
                s.topology,
                cpus_per_host=layout.cpus_per_host,
                name=f"rl-tpu-{pool}",
                timeout_s=timeout_s,
                _count=2 if same else 1,
            )
    except BaseException:
        for p in out.values():
            p.shutdown()
        raise
    return out
