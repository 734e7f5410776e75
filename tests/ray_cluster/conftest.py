"""One real fake-slice Ray cluster for the ray_cluster tests: a 2-host v4-16 slice and a
1-host v6e-4 slice, on free ports and a temp dir, stopped by pid at the end."""

import os

import pytest

from ray_cluster import fake_slice, ray_nodes

SLICES = ["v4-16", "v6e-4"]


@pytest.fixture(scope="session")
def fake_cluster(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns token auth on if ~/.ray/auth_token exists
    state = tmp_path_factory.mktemp("cluster") / "state.json"
    # Default logical CPUs (8 head, 8 per chip on slice hosts, as real TPU VMs have).
    cluster = fake_slice.start(SLICES, object_store_mb=256, state_file=state, timeout_s=240)
    cluster.state_file = state
    yield cluster
    fake_slice.stop(state_file=state)
    assert not ray_nodes.tagged_processes(cluster.marker), "fake cluster processes left behind"


@pytest.fixture(scope="session")
def ray_driver(fake_cluster):
    import ray

    ray.init(address=fake_cluster.address, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
