"""Slice topology tables against the published slice shapes and Ray 2.60's own TPU tables."""

import math

import pytest

from rl_tpu.slice_hosts import host_env, host_resources
from rl_tpu.topology import (
    GENERATIONS,
    TopologyError,
    accelerator_types,
    check_chip_request,
    default_topology,
    parse_slice,
    valid_topologies,
)

# (accelerator type, topology, hosts, chips/host, chips, cores/chip, mesh) from the Cloud TPU
# "versions" pages and the GKE TPU planning tables.
REAL_SLICES = [
    ("v4-8", "2x2x1", 1, 4, 4, 2, (2, 2, 1)),
    ("v4-16", "2x2x2", 2, 4, 8, 2, (2, 2, 2)),
    ("v4-32", "2x2x4", 4, 4, 16, 2, (2, 2, 4)),
    ("v4-128", "4x4x4", 16, 4, 64, 2, (4, 4, 4)),
    ("v5p-8", "2x2x1", 1, 4, 4, 2, (2, 2, 1)),
    ("v5p-16", "2x2x2", 2, 4, 8, 2, (2, 2, 2)),
    ("v5p-256", "4x4x8", 32, 4, 128, 2, (4, 4, 8)),
    ("v5litepod-1", "1x1", 1, 1, 1, 1, (1, 1)),
    ("v5litepod-4", "2x2", 1, 4, 4, 1, (2, 2)),
    ("v5litepod-8", "2x4", 1, 8, 8, 1, (2, 4)),
    ("v5litepod-16", "4x4", 4, 4, 16, 1, (4, 4)),
    ("v5litepod-256", "16x16", 64, 4, 256, 1, (16, 16)),
    ("v6e-1", "1x1", 1, 1, 1, 1, (1, 1)),
    ("v6e-4", "2x2", 1, 4, 4, 1, (2, 2)),
    ("v6e-8", "2x4", 1, 8, 8, 1, (2, 4)),
    ("v6e-16", "4x4", 4, 4, 16, 1, (4, 4)),
    ("v6e-32", "4x8", 8, 4, 32, 1, (4, 8)),
    ("v6e-256", "16x16", 64, 4, 256, 1, (16, 16)),
    ("tpu7x-8", "2x2x1", 1, 4, 4, 2, (2, 2, 1, 2)),
    ("tpu7x-16", "2x2x2", 2, 4, 8, 2, (2, 2, 2, 2)),
    ("tpu7x-128", "4x4x4", 16, 4, 64, 2, (4, 4, 4, 2)),
]


@pytest.mark.parametrize("atype,topo,hosts,per_host,chips,cores,mesh", REAL_SLICES)
def test_real_slice_shapes(atype, topo, hosts, per_host, chips, cores, mesh):
    s = parse_slice(atype)
    assert (s.topology, s.hosts, s.chips_per_host, s.chips, s.cores_per_chip, s.mesh_shape) == (
        topo,
        hosts,
        per_host,
        chips,
        cores,
        mesh,
    )
    assert s.accelerator_type == atype
    assert s.hosts * s.chips_per_host == s.chips
    assert math.prod(s.mesh_shape) == s.num_devices
    # Giving the topology explicitly is the same slice.
    assert parse_slice(atype, topo) == s
    # A bare generation plus topology (how GKE node selectors name a slice) is the same slice.
    assert parse_slice(s.generation, topo) == s


def test_cores_vs_chips_naming():
    # v4/v5p/v7x count TensorCores: v4-16 is 8 chips; v6e counts chips: v6e-16 is 16.
    assert parse_slice("v4-16").chips == 8
    assert parse_slice("v4-16").cores == 16
    assert parse_slice("v6e-16").chips == 16
    assert parse_slice("v6e-16").cores == 16
    assert parse_slice("tpu7x-16").chips == 8


def test_aliases_normalise():
    assert parse_slice("v5e-16") == parse_slice("v5litepod-16")
    assert parse_slice("V7X-16") == parse_slice("tpu7x-16")
    assert parse_slice("v5e-16").accelerator_type == "v5litepod-16"
    assert parse_slice("tpu7x-16").pod_type == "v7x-16"
    assert parse_slice("tpu7x-16").head_resource == "TPU-v7x-16-head"
    assert parse_slice("v6e-16").head_resource == "TPU-v6e-16-head"


def test_defaults_and_listing():
    assert default_topology("v6e-16") == "4x4"
    assert default_topology("v4-16") == "2x2x2"
    assert accelerator_types("v6e")[:4] == ["v6e-1", "v6e-4", "v6e-8", "v6e-16"]
    assert "4x4x8" in valid_topologies("v4")
    assert valid_topologies("v6e", 16) == ["4x4"]


@pytest.mark.parametrize("name", sorted(GENERATIONS))
def test_agrees_with_ray_tables(name):
    """Every shape we accept is one Ray 2.60 accepts, with Ray's chips per host and pod type."""
    tpu = pytest.importorskip("ray._private.accelerators.tpu")
    ray_valid = tpu.VALID_TPU_TOPOLOGY[name]
    for atype in accelerator_types(name):
        s = parse_slice(atype)
        if name == "v4" and s.chip_grid[1] > 12:
            continue  # beyond Ray's v4 table (see below)
        assert s.topology in ray_valid, (atype, s.topology)
        assert s.chips_per_host == tpu.get_chips_per_host(s.topology, name)
        assert s.chips == tpu.get_num_chips_from_topology(s.topology)
        assert s.cores_per_chip == tpu.get_tpu_cores_per_chip(name)
        assert s.pod_type == tpu.normalize_tpu_accelerator_type(s.accelerator_type)
        assert s.pod_type == tpu.infer_tpu_pod_type_from_topology(s.topology, name)
    # Every shape we accept is Ray-valid; Ray stops v4 at 12x12x16, the published v4 pod
    # reaches 16x16x16 (4096 chips), so only those larger v4 shapes are ours alone.
    for topo in valid_topologies(name):
        a, b, *c = (int(d) for d in topo.split("x"))
        if name == "v4" and b > 12:
            continue
        assert topo in ray_valid, topo


@pytest.mark.parametrize(
    "atype,topo,needle",
    [
        ("v9-8", None, "unknown TPU accelerator type 'v9-8'"),
        ("v6e-16", "2x4", "has 8 chips but 'v6e-16' has 16"),
        ("v6e-16", "4x4x1", "does not exist for 'v6e-16'"),
        ("v4-16", "4x4", "does not exist for 'v4-16'"),
        ("v4-15", None, "multiple of 2"),
        ("v6e-12", None, "no standard v6e topology"),
        ("v6e", None, "has no size"),
        ("v6e-16", "four-by-four", "is not a chip grid"),
        ("tpu7x-16", "4x4x4", "has 64 chips but 'tpu7x-16' has 8"),
        (None, None, "is not a string"),
    ],
)
def test_bad_input_is_one_clear_line(atype, topo, needle):
    with pytest.raises(TopologyError) as err:
        parse_slice(atype, topo)
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg
    assert isinstance(err.value, ValueError)


def test_chip_requests():
    s = parse_slice("v6e-16")
    for n in (1, 2, 4, 4.0):
        assert check_chip_request(n, s) == int(n)
    assert check_chip_request(8, parse_slice("v6e-8")) == 8
    for bad in (0, 0.5, 3, 16, -1, True, "4"):
        with pytest.raises(TopologyError, match="whole-chip"):
            check_chip_request(bad)
    with pytest.raises(TopologyError, match="exceeds the 4 chips"):
        check_chip_request(8, s)


def test_host_resources_and_env():
    s = parse_slice("v6e-16")
    r0 = host_resources(s, 0, "slice-a")
    r3 = host_resources(s, 3, "slice-a")
    assert r0 == {"TPU": 4.0, "slice-a": 1.0, "TPU-v6e-16-head": 1.0, "accelerator_type:TPU-V6E": 1.0}
    assert "TPU-v6e-16-head" not in r3 and r3["TPU"] == 4.0
    env = host_env(s, 2, "slice-a", ["h0", "h1", "h2", "h3"])
    assert env == {
        "TPU_ACCELERATOR_TYPE": "v6e-16",
        "TPU_NAME": "slice-a",
        "TPU_WORKER_ID": "2",
        "TPU_TOPOLOGY": "4x4",
        "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3",
    }
    assert parse_slice("tpu7x-16").torch_tpu_topology == "2,2,2,2"
    assert s.torch_tpu_topology == "4,4,1"
    with pytest.raises(TopologyError, match="worker id 4"):
        host_resources(s, 4, "slice-a")
    with pytest.raises(TopologyError, match="give exactly one per host"):
        host_env(s, 0, "slice-a", ["h0"])


def test_slice_command_shows_the_head_host_and_what_every_other_host_offers(capsys):
    """``rl-tpu slice v6e-16``: 4 hosts; it listed workers 0 and 1 only, as if the slice had two."""
    from ray_cluster.cli import main

    assert main(["slice", "v6e-16"]) == 0
    out = capsys.readouterr().out
    assert "4 host(s) x 4 chips = 16 chips" in out
    assert "worker 0 Ray resources:" in out and '"TPU-v6e-16-head": 1.0' in out
    assert "workers 1-3 (each) Ray resources:" in out
    assert main(["slice", "v4-16"]) == 0  # 8 chips on 2 hosts (v4 names TensorCores)
    assert "  worker 1 Ray resources:" in capsys.readouterr().out
