"""Placement of VeRL's resource pools on TPU slices, through Ray's own ``ray.util.tpu``.

A slice is reserved with :class:`ray.util.tpu.SlicePlacementGroup`: one bundle per host holding
all of that host's chips; on a multi-host slice Ray first claims worker 0's
``TPU-<pod type>-head`` resource and pins every bundle to that slice's ``ray.io/tpu-slice-name``
label, so the bundles are gang-scheduled on one slice and never straddle two. What this module
adds on top:

- checks before asking Ray: the type and topology (``rl_tpu.topology``), whether the cluster has
  such a slice at all (from ``ray.cluster_resources()``) — a placement group for a slice that
  does not exist would wait forever — and a timeout on ``ready()`` with a message that says why;
- whole-chip actor requests (1, 2, 4 or 8 chips, at most one host) turned into ``.options()``;
- the rollout/trainer layout of two pools lives in :mod:`ray_cluster.pools`.

Ray must already be initialised (``ray.init(address=...)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_tpu.topology import (
    SliceTopology,
    TopologyError,
    check_chip_request,
    parse_slice,
)

from .errors import ClusterError

POD_TYPE_LABEL = "ray.io/tpu-pod-type"


def cluster_slices(resources: dict[str, float] | None = None) -> dict[str, int]:
    """TPU slices a Ray cluster has, by Ray pod type: ``{"v6e-16": 1, "v4-16": 2}``.

    Multi-host and single-host slices alike are counted by their worker-0
    ``TPU-<pod type>-head`` resource. ``resources`` defaults to ``ray.cluster_resources()``.
    """
    resources = ray.cluster_resources() if resources is None else resources
    out = {}
    for key, value in resources.items():
        if key.startswith("TPU-") and key.endswith("-head"):
            out[key[4:-5]] = int(value)
    return out


def check_cluster_has(spec: SliceTopology, count: int) -> None:
    total = ray.cluster_resources()
    have = cluster_slices(total).get(spec.pod_type, 0)
    if have >= count:
        return
    inventory = ", ".join(f"{n}x {t}" for t, n in sorted(cluster_slices(total).items())) or "no TPU slices"
    raise ClusterError(
        f"slice {spec.accelerator_type} ({spec.topology}, {spec.hosts} hosts x {spec.chips_per_host} chips) "
        f"x{count} requested but this cluster has {have} (it has {inventory}, "
        f"{int(total.get('TPU', 0))} TPU chips in all); ask for a slice it has, or add one "
        f"(locally: rl-tpu cluster up --fake-slice {spec.accelerator_type})"
    )


def _node_labels() -> dict[str, dict[str, str]]:
    return {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes() if n.get("Alive")}


@dataclass
class SlicePlacement:
    """A reserved TPU slice: one placement-group bundle per host, each with all its chips.

    Attributes:
        spec: the slice shape.
        handle: Ray's ``SlicePlacementGroup``.
        cpus_per_bundle: CPUs reserved with each host's chips (for the actors' processes).
        slice_name: the Ray slice (``TPU_NAME``) the bundles landed on, once ready.
    """

    spec: SliceTopology
    handle: ray.util.tpu.SlicePlacementGroup
    cpus_per_bundle: float
    slice_name: str | None = None
    _used: dict[int, int] = field(default_factory=dict)

    @property
    def placement_group(self):
        return self.handle.placement_group

    @property
    def num_bundles(self) -> int:
        """One per host."""
        return self.handle.num_bundles

    def ready(self, timeout_s: float = 60.0) -> SlicePlacement:
        """Wait until every bundle is placed.

        Raises:
            ClusterError: not placed within ``timeout_s`` (the slice exists but is busy, or
                its hosts lack the CPUs asked per bundle); the reservation is released.
        """
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            self.shutdown()
            raise ClusterError(
                f"slice {self.spec.accelerator_type} was not placed within {timeout_s:.0f} s: it exists "
                f"but its chips or {self.cpus_per_bundle:g} CPUs per host are taken (available: "
                f"TPU {ray.available_resources().get('TPU', 0):g}, CPU "
                f"{ray.available_resources().get('CPU', 0):g}); free them, ask fewer CPUs per host, or wait longer"
            )
        # Ray suggests releasing the head reservation now; we keep it until shutdown() so a
        # second request for this slice fails at the head ("no free slice") instead of
        # grabbing the head and then waiting on chips that are taken.
        labels = [_node_labels().get(n, {}) for n in self.bundle_node_ids()]
        names = {l.get("ray.io/tpu-slice-name") for l in labels}
        self.slice_name = names.pop() if len(names) == 1 else None
        return self

    def bundle_node_ids(self) -> list[str]:
        """Ray node id of each bundle (bundle order), once placed."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.placement_group)
        where = table.get("bundles_to_node_id", {})
        return [where.get(i) for i in range(self.num_bundles)]

    def actor_options(self, bundle_index: int, chips: float, num_cpus: float = 0.0) -> dict:
        """``.options(**...)`` for an actor that owns ``chips`` whole chips of host ``bundle_index``.

        Args:
            bundle_index: host index within the slice, 0..num_bundles-1.
            chips: 1, 2, 4 or 8 whole chips, at most one host's worth.
            num_cpus: CPUs for the actor, taken from the bundle's ``cpus_per_bundle``.

        Raises:
            TopologyError: a fractional or odd chip count, or more than a host has.
            ClusterError: ``bundle_index`` out of range, or the host's chips already handed out.
        """
        n = check_chip_request(chips, self.spec)
        if not 0 <= bundle_index < self.num_bundles:
            raise ClusterError(
                f"bundle index {bundle_index} outside slice {self.spec.accelerator_type} "
                f"(0..{self.num_bundles - 1}, one per host)"
            )
        used = self._used.get(bundle_index, 0)
        if used + n > self.spec.chips_per_host:
            raise ClusterError(
                f"host {bundle_index} of {self.spec.accelerator_type} has {self.spec.chips_per_host - used} "
                f"chips left, {n} asked; use another host or fewer chips per actor"
            )
        self._used[bundle_index] = used + n
        return {
            "num_cpus": num_cpus,
            "resources": {"TPU": n},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=True,
            ),
        }

    def worker_options(self, chips_per_worker: float, num_cpus: float = 0.0) -> list[dict]:
        """Options for a full set of workers: ``chips_per_host / chips_per_worker`` per host,
        host-major (rank r sits on host ``r // per_host``).

        Raises:
            TopologyError: a chip count that is not a whole-chip request or does not divide a host.
        """
        n = check_chip_request(chips_per_worker, self.spec)
        per_host = _workers_per_host(self.spec, n)
        return [self.actor_options(h, n, num_cpus) for h in range(self.num_bundles) for _ in range(per_host)]

    def shutdown(self) -> None:
        """Release the reservation (idempotent)."""
        self.handle.shutdown()


def _workers_per_host(spec: SliceTopology, chips_per_worker: int) -> int:
    """Workers of ``chips_per_worker`` chips on one host; TopologyError if they do not divide its chips."""
    if spec.chips_per_host % chips_per_worker:
        raise TopologyError(
            f"{chips_per_worker} chips per worker does not divide the {spec.chips_per_host} chips of a "
            f"{spec.accelerator_type} host; use one of "
            f"{tuple(c for c in (1, 2, 4, 8) if spec.chips_per_host % c == 0)}"
        )
    return spec.chips_per_host // chips_per_worker


def _slice_placement_group(spec: SliceTopology, timeout_s: float, **kwargs):
    """``ray.util.tpu.SlicePlacementGroup`` for ``spec`` (``kwargs``: bundles, strategy, name, selectors).

    Raises:
        ClusterError: a shape Ray's own table lacks (e.g. v4 beyond 12x12x16), or no free slice of that
            type within ``timeout_s`` (its head resource held by other placement groups).
    """
    from ray.util.tpu import SlicePlacementGroup

    try:
        return SlicePlacementGroup(
            topology=spec.topology,
            accelerator_version=spec.generation,
            chips_per_vm=spec.chips_per_host,
            head_reservation_timeout_s=timeout_s,
            **kwargs,
        )
    except ValueError as e:
        raise ClusterError(
            f"Ray {ray.__version__} cannot place {spec.accelerator_type} {spec.topology}: {e}; "
            f"use one of its standard shapes"
        ) from None
    except TimeoutError:
        raise ClusterError(
            f"no free {spec.accelerator_type} slice within {timeout_s:.0f} s: every one in the "
            f"cluster is reserved by other placement groups; release them or wait longer"
        ) from None


WORKER_ID_LABEL = "ray.io/tpu-worker-id"


def reserve_slice_workers(
    accelerator_type: str,
    topology: str | None = None,
    *,
    chips_per_worker: int = 1,
    cpus_per_worker: float = 1.0,
    name: str = "",
    timeout_s: float = 60.0,
) -> SliceWorkers:
    """Reserve one whole TPU slice as one placement-group bundle per worker, host-major.

    This is the shape VeRL's worker groups schedule into (one actor per bundle, bundle index =
    rank): bundle ``r`` holds ``chips_per_worker`` chips of host ``r // workers_per_host``. It is
    still one ``ray.util.tpu.SlicePlacementGroup``: Ray claims the slice's worker-0 head
    resource and pins every bundle to that slice's ``ray.io/tpu-slice-name``; we add a
    ``ray.io/tpu-worker-id`` selector per bundle so the host order is fixed, and, for a
    single-host slice (which Ray does not pin), the pod type.

    Args:
        accelerator_type: e.g. ``"v6e-16"``; topology: optional chip grid.
        chips_per_worker: whole chips per worker (1, 2, 4 or 8; must divide a host's chips).
        cpus_per_worker: CPUs reserved in each bundle for the worker's process.
        name: placement group name. timeout_s: seconds to wait for the slice.

    Returns:
        The placed reservation (:class:`SliceWorkers`).

    Raises:
        TopologyError: bad type, topology or chip request.
        ClusterError: no such slice in the cluster (checked before asking Ray), or it stays
            busy past ``timeout_s``; nothing stays reserved.
    """

    spec = parse_slice(accelerator_type, topology)
    n = check_chip_request(chips_per_worker, spec)
    per_host = _workers_per_host(spec, n)
    if cpus_per_worker < 0:
        raise ClusterError(f"cpus_per_worker {cpus_per_worker} is negative; use 0 or more")
    check_cluster_has(spec, 1)
    selectors = [
        {POD_TYPE_LABEL: spec.pod_type, WORKER_ID_LABEL: str(b // per_host)} for b in range(spec.hosts * per_host)
    ]
    start = time.monotonic()
    handle = _slice_placement_group(
        spec,
        timeout_s,
        resources_per_bundle={"TPU": n, "CPU": cpus_per_worker},
        # Single-host slices get no slice-name pin from Ray: STRICT_PACK keeps their bundles on
        # one host. Multi-host bundles are pinned by slice name + worker id already.
        strategy="STRICT_PACK" if spec.hosts == 1 else "PACK",
        name=name,
        bundle_label_selector=selectors,
    )
    placement = SliceWorkers(spec=spec, handle=handle, cpus_per_bundle=cpus_per_worker, chips_per_worker=n)
    placement.ready(max(1.0, timeout_s - (time.monotonic() - start)))
    return placement


@dataclass
class SliceWorkers(SlicePlacement):
    """A reserved TPU slice with one bundle per worker (:func:`reserve_slice_workers`).

    Bundle ``r`` is worker rank ``r``'s: ``chips_per_worker`` chips on host ``r // workers_per_host``.
    """

    chips_per_worker: int = 1

    @property
    def workers_per_host(self) -> int:
        return self.spec.chips_per_host // self.chips_per_worker

    def bundle_hosts(self) -> list[int]:
        """TPU worker id (host index in the slice) of each bundle's node, once placed."""
        labels = _node_labels()
        return [int(labels.get(n, {}).get(WORKER_ID_LABEL, -1)) for n in self.bundle_node_ids()]

    def actor_options(self, bundle_index: int, chips: float | None = None, num_cpus: float = 0.0) -> dict:
        """``.options(**...)`` for worker ``bundle_index`` (its bundle's chips, or ``chips`` of them)."""
        n = self.chips_per_worker if chips is None else check_chip_request(chips, self.spec)
        if not 0 <= bundle_index < self.num_bundles or n > self.chips_per_worker:
            raise ClusterError(
                f"worker {bundle_index} with {n} chips does not fit slice {self.spec.accelerator_type} "
                f"reserved as {self.num_bundles} workers x {self.chips_per_worker} chips"
            )
        return {
            "num_cpus": num_cpus,
            "resources": {"TPU": n},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=True,
            ),
        }


def reserve_slice(
    accelerator_type: str,
    topology: str | None = None,
    *,
    cpus_per_host: float = 1.0,
    name: str = "",
    timeout_s: float = 60.0,
    wait: bool = True,
    _count: int = 1,
) -> SlicePlacement:
    """Reserve one TPU slice with Ray's ``slice_placement_group``.

    Args:
        accelerator_type: e.g. ``"v6e-16"``, ``"v4-16"``, ``"v5litepod-8"``.
        topology: optional chip grid; default the type's standard one.
        cpus_per_host: CPUs reserved in each host's bundle next to its chips.
        name: placement group name (for ``ray list placement-groups``).
        timeout_s: how long to wait for the slice (head reservation and bundles).
        wait: False returns before the bundles are placed (call ``.ready()``).

    Returns:
        The placement, ready unless ``wait`` is False.

    Raises:
        TopologyError: bad type or topology.
        ClusterError: the cluster has no such slice (checked first, so nothing waits forever),
            or it stays busy past ``timeout_s``.
    """

    spec = parse_slice(accelerator_type, topology)
    if cpus_per_host < 0:
        raise ClusterError(f"cpus_per_host {cpus_per_host} is negative; use 0 or more")
    check_cluster_has(spec, _count)
    start = time.monotonic()
    handle = _slice_placement_group(
        spec,
        timeout_s,
        resources_per_bundle={"TPU": spec.chips_per_host, "CPU": cpus_per_host},
        name=name,
        # Single-host slices get no slice-name pin from Ray; pin them to the pod type so
        # a v6e-8 request never lands on, say, a v4-8 host with as many chips.
        bundle_label_selector=[{POD_TYPE_LABEL: spec.pod_type}] * spec.hosts,
    )
    placement = SlicePlacement(spec=spec, handle=handle, cpus_per_bundle=cpus_per_host)
    if wait:
        placement.ready(max(1.0, timeout_s - (time.monotonic() - start)))
    return placement
