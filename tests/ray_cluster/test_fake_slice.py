"""`rl-tpu cluster up/status/down`: a second real fake cluster, stopped by pid, nothing else touched."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ray_cluster import fake_slice, ray_nodes
from ray_cluster.errors import ClusterError

RL_TPU = str(Path(sys.executable).parent / "rl-tpu")


def _run(*args, timeout=300):
    return subprocess.run(
        [RL_TPU, *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ, RAY_AUTH_MODE="disabled")
    )


def test_cli_up_status_down_stops_exactly_its_processes(fake_cluster, tmp_path):
    state = tmp_path / "cli-state.json"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    other_before = [r.pid for r in fake_cluster.nodes if ray_nodes.alive(r)]
    try:
        up = _run(
            "cluster",
            "up",
            "--fake-slice",
            "v6e-4",
            "--hosts-cpus",
            "1",
            "--head-cpus",
            "1",
            "--object-store-mb",
            "100",
            "--state-file",
            str(state),
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert "fake cluster ready" in up.stdout and "export RAY_ADDRESS=http://127.0.0.1:" in up.stdout
        rec = json.loads(state.read_text())
        ours = [n["pid"] for n in rec["nodes"]]
        assert len(ours) == 2 and all(psutil.pid_exists(p) for p in ours)

        st = _run("cluster", "status", "--state-file", str(state), "--json")
        assert st.returncode == 0, st.stderr
        info = json.loads(st.stdout)
        assert all(p["alive"] for p in info["processes"])
        assert sorted(n["tpu"] for n in info["nodes"]) == [0, 4]
        assert {n["slice"] for n in info["nodes"] if n["tpu"]} == {rec["slices"][0]["name"]}

        again = _run("cluster", "up", "--fake-slice", "v6e-4", "--state-file", str(state))
        assert again.returncode == 2 and "already up" in again.stderr

        tagged = {p.pid for p in ray_nodes.tagged_processes(rec["marker"])}
        assert set(ours) <= tagged and len(tagged) > len(ours)  # raylets, agents, GCS ... all tagged

        down = _run("cluster", "down", "--state-file", str(state))
        assert down.returncode == 0, down.stderr
        assert not [p for p in tagged if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not state.exists() and not Path(rec["temp_dir"]).exists()
        # Nothing else was touched: our bystander and the session's other fake cluster live on.
        assert bystander.poll() is None
        assert all(psutil.pid_exists(p) for p in other_before)
        assert fake_slice.status(fake_cluster.state_file)["nodes"] is not None
    finally:
        bystander.kill()
        if state.exists():
            fake_slice.stop(state)


def test_status_and_down_without_a_cluster(tmp_path):
    missing = tmp_path / "none.json"
    for cmd in ("status", "down"):
        r = _run("cluster", cmd, "--state-file", str(missing), timeout=60)
        assert r.returncode == 2
        assert "no fake cluster state" in r.stderr and "rl-tpu cluster up" in r.stderr
        assert "Traceback" not in r.stderr


def test_bad_fake_slice_is_one_line(tmp_path):
    r = _run("cluster", "up", "--fake-slice", "v6e-12", "--state-file", str(tmp_path / "s.json"), timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "'v6e-12' (12 chips) has no standard v6e topology" in r.stderr
    assert not (tmp_path / "s.json").exists()


def test_state_file_garbage_is_clear(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ClusterError, match="unreadable"):
        fake_slice.FakeCluster.load(bad)
