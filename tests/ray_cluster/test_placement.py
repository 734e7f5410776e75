"""Slice placement on the real fake-slice cluster: one bundle per host, actors see their chips."""

import os
import time

import pytest

from ray_cluster.errors import ClusterError
from ray_cluster.fake_slice import list_alive_nodes
from ray_cluster.placement import cluster_slices, reserve_slice
from ray_cluster.pools import PoolLayout, place_pools
from rl_tpu.slice_hosts import host_resources
from rl_tpu.topology import TopologyError, parse_slice


def test_nodes_offer_real_slice_resources_and_labels(fake_cluster):
    nodes = list_alive_nodes(fake_cluster.dashboard_url)
    tpu_nodes = [n for n in nodes if n["resources_total"].get("TPU")]
    assert len(nodes) == 1 + 2 + 1 and len(tpu_nodes) == 3
    for s in fake_cluster.slices:
        spec = parse_slice(s["accelerator_type"], s["topology"])
        mine = [n for n in tpu_nodes if n["labels"].get("ray.io/tpu-slice-name") == s["name"]]
        assert len(mine) == spec.hosts
        for n in mine:
            w = int(n["labels"]["ray.io/tpu-worker-id"])
            want = host_resources(spec, w, s["name"])
            got = {k: v for k, v in n["resources_total"].items() if k in want or k.startswith("TPU")}
            assert got == want
            assert n["labels"]["ray.io/tpu-topology"] == spec.topology
            assert n["labels"]["ray.io/tpu-pod-type"] == spec.pod_type


def test_cluster_slices_inventory(ray_driver):
    assert cluster_slices() == {"v4-16": 1, "v6e-4": 1}


@pytest.fixture
def actor_cls(ray_driver):
    ray = ray_driver

    @ray.remote
    class ChipProbe:
        def where(self):
            ctx = ray.get_runtime_context()
            return {
                "node": ctx.get_node_id(),
                "chips": sorted(ctx.get_accelerator_ids()["TPU"]),
                "visible": os.environ.get("TPU_VISIBLE_CHIPS"),
                "worker_id": os.environ.get("TPU_WORKER_ID"),
                "slice": os.environ.get("TPU_NAME"),
            }

    return ChipProbe


def test_multi_host_slice_one_bundle_per_host_and_chip_ids(ray_driver, actor_cls):
    ray = ray_driver
    p = reserve_slice("v4-16", cpus_per_host=0.5, timeout_s=60)
    try:
        assert p.num_bundles == 2
        nodes = p.bundle_node_ids()
        assert len(set(nodes)) == 2, "the two bundles must sit on two different hosts"
        assert p.slice_name.startswith("fake-v4-16")
        opts = p.worker_options(chips_per_worker=1)
        assert len(opts) == 8
        actors = [actor_cls.options(**o).remote() for o in opts]
        seen = ray.get([a.where.remote() for a in actors], timeout=120)
        by_worker = {}
        for rank, s in enumerate(seen):
            assert s["node"] == nodes[rank // 4]  # host-major ranks
            assert s["slice"] == p.slice_name
            assert s["visible"] == ",".join(s["chips"])
            by_worker.setdefault(s["worker_id"], []).extend(s["chips"])
        assert {w: sorted(c) for w, c in by_worker.items()} == {"0": ["0", "1", "2", "3"], "1": ["0", "1", "2", "3"]}
        for a in actors:
            ray.kill(a)
        # A host's chips are handed out once: a fifth 1-chip actor on host 0 is refused.
        with pytest.raises(ClusterError, match="has 0 chips left"):
            p.actor_options(0, 1)
    finally:
        p.shutdown()


def test_single_host_slice_two_chip_actors(ray_driver, actor_cls):
    ray = ray_driver
    p = reserve_slice("v6e-4", cpus_per_host=0, timeout_s=60)
    try:
        assert p.num_bundles == 1 and p.slice_name.startswith("fake-v6e-4")
        actors = [actor_cls.options(**o).remote() for o in p.worker_options(2)]
        chips = sorted(tuple(s["chips"]) for s in ray.get([a.where.remote() for a in actors], timeout=120))
        assert chips == [("0", "1"), ("2", "3")]
        for a in actors:
            ray.kill(a)
    finally:
        p.shutdown()


@pytest.mark.parametrize("chips,needle", [(3, "whole-chip"), (0.5, "whole-chip"), (8, "exceeds the 4 chips")])
def test_bad_chip_requests(ray_driver, chips, needle):
    p = reserve_slice("v6e-4", cpus_per_host=0, timeout_s=60)
    try:
        with pytest.raises(TopologyError, match=needle):
            p.actor_options(0, chips)
    finally:
        p.shutdown()


def test_slice_missing_from_cluster_fails_fast(ray_driver):
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as err:
        reserve_slice("v6e-16", timeout_s=60)
    assert time.monotonic() - t0 < 5, "must not wait for a slice the cluster does not have"
    msg = str(err.value)
    assert "v6e-16" in msg and "1x v4-16, 1x v6e-4" in msg and "rl-tpu cluster up" in msg


def test_busy_slice_times_out_with_clear_error(ray_driver):
    p = reserve_slice("v4-16", timeout_s=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match="no free v4-16 slice within 3 s|not placed within"):
            reserve_slice("v4-16", timeout_s=3)
        assert time.monotonic() - t0 < 20
    finally:
        p.shutdown()
    # Released: it can be reserved again.
    reserve_slice("v4-16", timeout_s=60).shutdown()


def test_colocated_and_separate_layouts(ray_driver):
    pools = place_pools(PoolLayout("v4-16", colocate=True, chips_per_worker=1))
    try:
        assert pools["trainer"] is pools["rollout"]
    finally:
        pools["trainer"].shutdown()
    pools = place_pools(PoolLayout("v4-16", rollout_slice="v6e-4", colocate=False))
    try:
        assert pools["trainer"].slice_name.startswith("fake-v4-16")
        assert pools["rollout"].slice_name.startswith("fake-v6e-4")
        assert set(pools["trainer"].bundle_node_ids()).isdisjoint(pools["rollout"].bundle_node_ids())
    finally:
        for p in pools.values():
            p.shutdown()
    # Two separate v4-16 slices: the cluster has one, said before anything is reserved.
    with pytest.raises(ClusterError, match="x2 requested but this cluster has 1"):
        place_pools(PoolLayout("v4-16", colocate=False))
    with pytest.raises(ClusterError, match="colocate=True"):
        place_pools(PoolLayout("v4-16", rollout_slice="v6e-4", colocate=True))
