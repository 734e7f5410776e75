"""VeRL's resource pools reserved as a whole TPU slice (``verl_backend.workers.slice_pool``) on the fake slice cluster.

The probe runs VeRL 0.9.1's own ``ResourcePoolManager`` and ``RayWorkerGroup`` with the TPU platform, so
workers ask Ray for whole chips exactly as ``verl train --backend tpu`` does; only the chips are fake.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("slice_pool_probe.py")


def probe(fake_cluster, slice_env: str | None, hosts: int, chips: int) -> dict:
    from verl_backend import settings

    # the settings record verl train hands the job (verl_backend.settings): the slice and its reservation timeout
    record = settings.record(settings.RlTpuSettings(slice=slice_env or "", slice_timeout_s=60.0))
    env = dict(os.environ, RAY_ADDRESS=fake_cluster.address, VERL_PLATFORM="tpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env[settings.RECORD_ENV] = record
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(hosts), str(chips)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_verl_pool_is_one_slice_one_worker_per_chip(fake_cluster):
    out = probe(fake_cluster, "v4-16", hosts=2, chips=4)
    assert out["pool"] == "SliceResourcePool", out
    assert "error" not in out, out["error"]
    workers = sorted(out["workers"], key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == list(range(8))
    assert {w["world_size"] for w in workers} == {8}
    assert out["bundle_hosts"] == [0, 0, 0, 0, 1, 1, 1, 1]
    # rank r on host r // 4 of one slice, each with its own chip, which Ray made the only visible one
    assert [int(w["tpu_worker_id"]) for w in workers] == [r // 4 for r in range(8)]
    assert len({w["tpu_name"] for w in workers}) == 1 and workers[0]["tpu_name"].startswith("fake-v4-16")
    for host in (0, 1):
        on_host = [w for w in workers if int(w["tpu_worker_id"]) == host]
        assert len({w["node_id"] for w in on_host}) == 1
        assert sorted(c for w in on_host for c in w["chips"]) == ["0", "1", "2", "3"]
        assert all(w["visible_chips"] == w["chips"][0] for w in on_host)
    assert workers[0]["node_id"] != workers[4]["node_id"]
    assert len({w["master_addr"] for w in workers}) == 1


def test_pool_of_another_shape_stays_verls_own(fake_cluster):
    # 1 node x 2 chips is not the v4-16 slice's shape: VeRL's per-node placement group, untouched
    assert probe(fake_cluster, "v4-16", hosts=1, chips=2)["pool"] == "RayResourcePool"
    assert probe(fake_cluster, None, hosts=2, chips=4)["pool"] == "RayResourcePool"


def test_slice_the_cluster_lacks_is_one_clear_error(fake_cluster):
    out = probe(fake_cluster, "v5p-16", hosts=2, chips=4)
    assert out["pool"] == "SliceResourcePool"
    assert out["error"].startswith("ClusterError: slice v5p-16"), out
    assert "this cluster has 0" in out["error"] and "rl-tpu cluster up --fake-slice v5p-16" in out["error"]
