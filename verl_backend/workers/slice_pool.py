"""VeRL's resource pools reserved as one TPU slice through ``ray.util.tpu.SlicePlacementGroup``.

VeRL 0.9.1 reserves each resource pool with one ``STRICT_PACK`` placement group per node
(``RayResourcePool.get_placement_groups``): nothing ties those nodes to one TPU slice, so a pool of
``trainer.nnodes`` x ``trainer.n_gpus_per_node`` chips can straddle two slices (no ICI between them) or
wait forever for a shape the cluster lacks. When ``verl train --slice`` (or ``$TPU_ACCELERATOR_TYPE``)
names a slice, :func:`place_pools_on_slices` (run after VeRL's ``create_resource_pool``) replaces the pool whose
shape is that slice's (``[chips_per_host] * hosts``) by a :class:`SliceResourcePool`: the whole slice reserved at
once with Ray's own slice placement (:func:`ray_cluster.placement.reserve_slice_workers`), one bundle per chip,
bundle ``r`` on host ``r // chips_per_host``.

VeRL's worker group gives rank ``r`` the bundle with index ``r`` of the pool's placement group when the
pool is one "node" of ``hosts * chips_per_host`` processes, so the pool declares exactly that
(``process_on_nodes=[chips]``); ranks, world size and ``MASTER_ADDR`` (bundle 0 = host 0) come out as on
a per-node pool. Each worker still sees only its own chip (Ray sets ``TPU_VISIBLE_CHIPS``), so
``LOCAL_RANK`` stays 0 as VeRL expects; only ``RAY_LOCAL_WORLD_SIZE`` (read by the vLLM/SGLang rollouts,
not by ours) reads the slice's chip count instead of a host's.

With ``rl_tpu.rollout_slice`` (``trainer_mode=separate_async``), VeRL's standalone rollout replicas each ask for a
pool of their own (``rollout_pool_<replica rank>``, ``RolloutReplica.init_standalone``); :class:`RolloutSlice`
reserves the rollout slice whole once, on the first such request, and hands each replica the next block of its
bundles as VeRL's ``SubRayResourcePool`` (replica ``k`` of size ``w`` gets bundles ``[k*w, (k+1)*w)``).
"""

from __future__ import annotations

import re

from verl.single_controller.ray.base import RayResourcePool, SubRayResourcePool

from rl_tpu.topology import SliceTopology, parse_slice

CPUS_PER_WORKER = 1.0  # the bundle's CPU: VeRL schedules a 1-CPU task on bundle 0 to find MASTER_ADDR


STANDALONE_POOL = re.compile(r"rollout_pool_\d+")  # VeRL 0.9.1 replica.py: a standalone rollout replica's pool


def slice_of(value: str | None) -> SliceTopology | None:
    """A slice setting's value (``rl_tpu.slice`` or ``rl_tpu.rollout_slice``, e.g. ``"v6e-16:4x4"``, handed down by
    the caller that read the job's record) as a :class:`SliceTopology`, or ``None`` when it is empty.

    Raises:
        rl_tpu.topology.TopologyError: an accelerator type or topology that is not a TPU slice.
    """
    value = str(value or "").strip()
    if not value:
        return None
    acc, _, topo = value.partition(":")
    return parse_slice(acc, topo or None)


class RolloutSlice:
    """The rollout slice (``rl_tpu.rollout_slice``) reserved whole with ``ray.util.tpu``, one bundle per chip, and
    cut into VeRL's standalone rollout replica pools in the order the replicas ask (one TaskRunner per job).

    Args:
        spec: the slice. timeout_s: seconds to wait for it before :class:`ray_cluster.errors.ClusterError`.
    """

    def __init__(self, spec: SliceTopology, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.placement = None
        self.blocks: dict[str, int] = {}  # pool name -> first bundle
        self.next_bundle = 0

    def pool(self, name: str, nodes: list[int], max_colocate_count: int) -> SubRayResourcePool:
        """Replica pool ``name`` asking for ``nodes`` (``[chips per node] * nnodes``): its block of the slice.

        Raises:
            ClusterError: the slice is not in the cluster or stays busy; the replicas ask for more chips than it has
                (a rollout ``tensor_model_parallel_size`` that does not divide the slice's chips).
        """
        from ray_cluster.errors import ClusterError
        from ray_cluster.placement import reserve_slice_workers

        if self.placement is None:
            self.placement = reserve_slice_workers(
                self.spec.accelerator_type,
                self.spec.topology,
                chips_per_worker=1,
                cpus_per_worker=CPUS_PER_WORKER,
                name="rollout_pool_rl_tpu_slice",
                timeout_s=self.timeout_s,
            )
            print(
                f"[rl-tpu] rollout slice {self.spec.accelerator_type} "
                f"({self.placement.slice_name or 'single host'}) reserved with ray.util.tpu for the standalone "
                f"rollout replicas, {self.spec.chips} chips, host of each: {self.placement.bundle_hosts()}",
                flush=True,
            )
        size = sum(nodes)
        if name not in self.blocks:
            if self.next_bundle + size > self.spec.chips:
                raise ClusterError(
                    f"rollout replica pool {name} needs {size} chips past the {self.next_bundle} of "
                    f"{self.spec.chips} already given out on rollout slice {self.spec.accelerator_type}; make "
                    f"actor_rollout_ref.rollout.tensor_model_parallel_size divide {self.spec.chips}"
                )
            self.blocks[name] = self.next_bundle
            self.next_bundle += size
        return SubRayResourcePool(
            placement_groups=[self.placement.placement_group],
            start_bundle_index=self.blocks[name],
            subgroup_world_size=size,
            process_on_nodes=[self.spec.chips],
            use_gpu=True,
            name_prefix=name,
            max_colocate_count=max_colocate_count,
        )


_ROLLOUT_SLICE: list[RolloutSlice] = []  # this process's (the TaskRunner's) reservation, made on first use


def rollout_slice_pool(
    name: str, nodes: list[int], max_colocate_count: int, timeout_s: float, spec: SliceTopology | None
):
    """The pool of standalone rollout replica ``name`` on the job's rollout slice ``spec`` (``rl_tpu.rollout_slice``,
    :func:`slice_of`), or ``None`` when the job has no rollout slice (``spec`` is ``None``) or ``name`` is not a
    standalone rollout pool (:class:`RolloutSlice`; ``timeout_s``: seconds to wait for its reservation)."""
    if spec is None or not STANDALONE_POOL.fullmatch(name):
        return None
    if not _ROLLOUT_SLICE or _ROLLOUT_SLICE[0].spec != spec:
        _ROLLOUT_SLICE[:] = [RolloutSlice(spec, timeout_s)]
    return _ROLLOUT_SLICE[0].pool(name, list(nodes), max_colocate_count)


class SliceResourcePool(RayResourcePool):
    """A VeRL resource pool that is one whole TPU slice, one worker per chip.

    Args:
        spec: the slice (``rl_tpu.topology.parse_slice``).
        name_prefix, max_colocate_count: as VeRL's ``RayResourcePool``.
        timeout_s: seconds to wait for the slice before :class:`ray_cluster.errors.ClusterError`.
    """

    def __init__(self, spec: SliceTopology, *, name_prefix: str, max_colocate_count: int, timeout_s: float = 600.0):
        super().__init__(
            process_on_nodes=[spec.chips], use_gpu=True, name_prefix=name_prefix, max_colocate_count=max_colocate_count
        )
        self.spec = spec
        self.timeout_s = timeout_s
        self.placement = None

    def get_placement_groups(self, strategy="STRICT_PACK", name=None, device_name=None):
        """The slice's placement group (a one-element list, as VeRL expects), reserved on first call.

        Raises:
            ClusterError: the cluster has no such slice, or it stays busy past ``timeout_s``.
        """
        if self.pgs is None:
            from ray_cluster.placement import reserve_slice_workers

            self.placement = reserve_slice_workers(
                self.spec.accelerator_type,
                self.spec.topology,
                chips_per_worker=1,
                cpus_per_worker=CPUS_PER_WORKER,
                name=name or f"{self.name_prefix}rl_tpu_slice",
                timeout_s=self.timeout_s,
            )
            self.pgs = [self.placement.placement_group]
            print(
                f"[rl-tpu] resource pool {self.name_prefix}: slice {self.spec.accelerator_type} "
                f"({self.placement.slice_name or 'single host'}) reserved with ray.util.tpu, "
                f"{self.spec.chips} workers, host of each: {self.placement.bundle_hosts()}",
                flush=True,
            )
        return self.pgs


def place_pools_on_slices(manager) -> None:
    """After VeRL's ``ResourcePoolManager.create_resource_pool`` (the plugin's feature ``resource_pools``, run by
    its patch, :data:`verl_backend.patches.verl.FEATURES`): with ``rl_tpu.slice`` set, a pool of ``manager`` shaped
    ``[chips_per_host] * hosts`` of that slice becomes a :class:`SliceResourcePool`; with ``rl_tpu.rollout_slice``
    too, each standalone rollout replica's pool (``rollout_pool_<rank>``) is its block of the rollout slice
    (:class:`RolloutSlice`); every other pool (and every pool without a slice) stays VeRL's own.

    This is where the TaskRunner's pool creation reads the job's settings record, once
    (:func:`verl_backend.settings.current`), and hands the slices and ``rl_tpu.slice_timeout_s`` down.

    Raises:
        verl_backend.settings.SettingsMissingError: this process was not started by a ``verl train`` job.
    """
    from verl_backend.settings import current

    settings = current()  # the one read of the job's record in pool creation
    spec, rollout_spec = slice_of(settings.slice), slice_of(settings.rollout_slice)
    if spec is None:
        return
    timeout_s = settings.slice_timeout_s
    for pool_name, nodes in manager.resource_pool_spec.items():
        on_rollout_slice = rollout_slice_pool(pool_name, nodes, manager.max_colocate_count, timeout_s, rollout_spec)
        if on_rollout_slice is not None:
            manager.resource_pool_dict[pool_name] = on_rollout_slice
        elif list(nodes) == [spec.chips_per_host] * spec.hosts:
            manager.resource_pool_dict[pool_name] = SliceResourcePool(
                spec, name_prefix=pool_name, max_colocate_count=manager.max_colocate_count, timeout_s=timeout_s
            )
