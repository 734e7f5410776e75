"""What each host of a TPU slice looks like from inside: its Ray resources and its environment variables.

Ray's TPU detection gives every host of a slice the same resources GKE's TPU nodes get, and GKE sets the same
``TPU_*`` variables; a fake slice (``ray_cluster.fake_slice``) and KubeRay manifests (``ray_cluster.kuberay``) must
set exactly these. The slice itself (hosts, chips, topology) is ``rl_tpu.topology``.

Example::

    >>> from rl_tpu.topology import parse_slice
    >>> host_resources(parse_slice("v4-16"), worker_id=0, slice_name="my-slice")
    {'TPU': 4.0, 'my-slice': 1.0, 'TPU-v4-16-head': 1.0, 'accelerator_type:TPU-V4': 1.0}
"""

from __future__ import annotations

from collections.abc import Sequence

from rl_tpu.topology import SliceTopology, TopologyError

__all__ = ["host_env", "host_resources"]


def _check_worker(spec: SliceTopology, worker_id: int) -> None:
    if not isinstance(worker_id, int) or not 0 <= worker_id < spec.hosts:
        raise TopologyError(
            f"worker id {worker_id!r} is outside {spec.accelerator_type} ({spec.hosts} hosts): use 0..{spec.hosts - 1}"
        )


def host_resources(spec: SliceTopology, worker_id: int, slice_name: str) -> dict[str, float]:
    """Ray resources one host of the slice offers, as Ray's TPU detection sets them.

    ``{"TPU": chips_per_host, <slice_name>: 1, "accelerator_type:TPU-<GEN>": 1}`` plus
    ``"TPU-<accelerator_type>-head": 1`` on worker 0 only (the handle
    ``ray.util.tpu`` uses to find a slice).

    Raises:
        TopologyError: ``worker_id`` not in ``0..hosts-1`` or an empty ``slice_name``.
    """
    _check_worker(spec, worker_id)
    if not slice_name or not isinstance(slice_name, str):
        raise TopologyError(f"slice name {slice_name!r} is empty; give the slice a name (TPU_NAME)")
    res = {"TPU": float(spec.chips_per_host), slice_name: 1.0}
    if worker_id == 0:
        res[spec.head_resource] = 1.0
    res[f"accelerator_type:{spec.ray_accelerator_type}"] = 1.0
    return res


def host_env(
    spec: SliceTopology,
    worker_id: int,
    slice_name: str,
    hostnames: Sequence[str] | None = None,
) -> dict[str, str]:
    """Environment variables a host of the slice has on GKE (and a fake slice must set).

    Args:
        spec: the slice.
        worker_id: this host's index, 0..hosts-1.
        slice_name: ``TPU_NAME``.
        hostnames: one per host, worker 0 first; default ``<slice_name>-<i>``.

    Returns:
        ``TPU_ACCELERATOR_TYPE``, ``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_TOPOLOGY``,
        ``TPU_WORKER_HOSTNAMES`` (comma separated).

    Raises:
        TopologyError: bad ``worker_id`` or a ``hostnames`` list of the wrong length.
    """
    _check_worker(spec, worker_id)
    if not slice_name or not isinstance(slice_name, str):
        raise TopologyError(f"slice name {slice_name!r} is empty; give the slice a name (TPU_NAME)")
    names = list(hostnames) if hostnames is not None else [f"{slice_name}-{i}" for i in range(spec.hosts)]
    if len(names) != spec.hosts:
        raise TopologyError(
            f"{len(names)} hostnames given for {spec.accelerator_type}, which has "
            f"{spec.hosts} hosts; give exactly one per host"
        )
    return {
        "TPU_ACCELERATOR_TYPE": spec.accelerator_type,
        "TPU_NAME": slice_name,
        "TPU_WORKER_ID": str(worker_id),
        "TPU_TOPOLOGY": spec.topology,
        "TPU_WORKER_HOSTNAMES": ",".join(names),
    }
