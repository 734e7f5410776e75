"""A local Ray cluster whose nodes look like the hosts of real TPU slices (for dry runs).

One head node (CPUs only, dashboard and job server on 127.0.0.1) plus one Ray node per
slice host, each started with the environment GKE gives a TPU host (``TPU_ACCELERATOR_TYPE``,
``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_TOPOLOGY``, ``TPU_WORKER_HOSTNAMES``) and
``--resources '{"TPU": chips_per_host}'``. Ray 2.60 then adds by itself the slice-name
resource, ``TPU-<pod type>-head`` on worker 0, ``accelerator_type:TPU-<GEN>`` and the
``ray.io/tpu-*`` node labels, so ``ray.util.tpu.slice_placement_group`` and whole-chip actor
requests schedule exactly as on a real slice. No chip is touched: the ``TPU`` resource is only
a scheduling token here.

Every node is a ``ray start --block`` child of ours, in its own process session and tagged with
a unique ``RL_TPU_FAKE_CLUSTER`` environment marker that all Ray processes it spawns inherit.
The pids, their start times and the marker go to a JSON state file; :func:`stop` ends exactly
those processes (never ``ray stop``, which would end every Ray process on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rl_tpu.slice_hosts import host_env, host_resources
from rl_tpu.topology import SliceTopology, parse_slice

from .errors import ClusterError
from .ray_nodes import (
    MARKER_ENV,
    NodeLaunch,
    NodeRecord,
    alive,
    free_ports,
    node_command,
    start_nodes,
    stop_processes,
    tail,
)

STATE_ENV = "RL_TPU_CLUSTER_STATE"
DEFAULT_STATE_FILE = Path.home() / ".cache" / "rl-tpu" / "fake-cluster.json"
# Ray variables a user's shell may carry that would point our nodes at another cluster.
_SCRUB_ENV = (
    "RAY_ADDRESS",
    "RAY_NAMESPACE",
    "RAY_JOB_ID",
    "TPU_VISIBLE_CHIPS",
    "TPU_ACCELERATOR_TYPE",
    "TPU_NAME",
    "TPU_WORKER_ID",
    "TPU_TOPOLOGY",
    "TPU_WORKER_HOSTNAMES",
)


def default_state_file() -> Path:
    """``$RL_TPU_CLUSTER_STATE`` or ``~/.cache/rl-tpu/fake-cluster.json``."""
    return Path(os.environ.get(STATE_ENV) or DEFAULT_STATE_FILE)


@dataclass
class FakeCluster:
    """What ``cluster up`` started; saved as JSON in the state file."""

    address: str  # GCS address for ray.init, "127.0.0.1:<port>"
    dashboard_url: str  # for ray job submit / JobSubmissionClient
    temp_dir: str
    marker: str
    slices: list[dict]  # {"name", "accelerator_type", "topology", "hosts", "chips_per_host"}
    nodes: list[NodeRecord]
    started_at: float
    ready_s: float = 0.0

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "FakeCluster":
        try:
            raw = json.loads(Path(path).read_text())
            raw["nodes"] = [NodeRecord(**n) for n in raw["nodes"]]
            return cls(**raw)
        except FileNotFoundError:
            raise ClusterError(
                f"no fake cluster state at {path}: start one with "
                f"`rl-tpu cluster up --fake-slice v6e-16` (or pass the --state-file it used)"
            ) from None
        except (ValueError, TypeError, KeyError) as e:
            raise ClusterError(
                f"fake cluster state file {path} is unreadable ({e}); "
                f"delete it after checking no cluster of yours is running"
            ) from None

    @property
    def env(self) -> dict[str, str]:
        """Variables a client of this cluster should set (printed by ``cluster up``)."""
        return {"RAY_ADDRESS": self.dashboard_url, "RAY_AUTH_MODE": "disabled"}


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def list_alive_nodes(dashboard_url: str) -> list[dict]:
    """Alive Ray nodes as the state API reports them (node_id, resources_total, labels)."""
    from ray.util.state import list_nodes

    nodes = list_nodes(address=dashboard_url, detail=True, timeout=10, raise_on_missing_output=False)
    return [n if isinstance(n, dict) else asdict(n) for n in nodes if _get(n, "state") == "ALIVE"]


def _get(n, key):
    return n.get(key) if isinstance(n, dict) else getattr(n, key)


CPUS_PER_CHIP = 8  # default logical CPUs of a fake slice host, per chip


def start(
    fake_slices: Sequence[str | SliceTopology],
    *,
    cpus_per_host: int | None = None,
    head_cpus: int = 8,
    object_store_mb: int = 256,
    state_file: Path | None = None,
    timeout_s: float = 180.0,
    max_parallel: int = 2,
) -> FakeCluster:
    """Start a head node plus one Ray node per host of each fake slice, and wait until ready.

    Args:
        fake_slices: accelerator types (``"v6e-16"``, ``"v4-16"``; ``"v6e-16:4x4"`` to give a
            topology) or parsed slices. Two entries make two slices (e.g. rollout and trainer).
        cpus_per_host: logical CPUs each slice host offers to Ray (not a real limit); default 8 per chip, as
            real TPU VMs have (v4 240 vCPUs / 4 chips, v6e 180 / 8): CPU-only actors that Ray places on a slice
            host must leave the CPUs a slice reservation asks with each chip.
        head_cpus: logical CPUs of the head node (drivers and CPU-only actors go there).
        object_store_mb: object store size per node, MiB.
        state_file: where to record the pids (default :func:`default_state_file`).
        timeout_s: give up (and stop what was started) after this many seconds.
        max_parallel: slice hosts started at once (more is faster on an idle machine; Ray
            gives each node 30 s to register, which a loaded 2-core box can miss).

    Returns:
        The running cluster; ``ready_s`` is the seconds from the first ``ray start`` to every
        node alive with its TPU resources and the job server answering.

    Raises:
        TopologyError: a bad slice type or topology.
        ClusterError: a cluster already recorded in ``state_file`` is alive, or a node failed
            to start (the message carries the end of its log).
    """
    state_file = Path(state_file or default_state_file())
    _check_no_cluster_alive(state_file)
    specs = _parse_fake_slices(fake_slices)
    if (cpus_per_host is not None and cpus_per_host < 1) or head_cpus < 1 or object_store_mb < 80:
        raise ClusterError(
            f"--hosts-cpus {cpus_per_host}, --head-cpus {head_cpus} must be >= 1 and "
            f"--object-store-mb {object_store_mb} >= 80 (Ray's minimum is 75 MiB)"
        )

    marker = uuid.uuid4().hex[:12]
    temp_dir = tempfile.mkdtemp(prefix="rlt-")  # short: Ray's socket paths live under it
    names = [f"fake-{s.accelerator_type}-{i}-{marker[:4]}" for i, s in enumerate(specs)]
    gcs_port, dash_port = free_ports(2)
    gcs = f"127.0.0.1:{gcs_port}"
    base_env = _node_env(marker)
    cluster = FakeCluster(
        address=gcs,
        dashboard_url=f"http://127.0.0.1:{dash_port}",
        temp_dir=temp_dir,
        marker=marker,
        slices=_slice_records(names, specs),
        nodes=[],
        started_at=time.time(),
    )
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    store = object_store_mb * 1024 * 1024
    head = _head_launch(gcs, temp_dir, head_cpus, store, dash_port, base_env)
    workers = _slice_host_launches(names, specs, gcs, temp_dir, cpus_per_host, store, base_env)
    try:

        def save():
            cluster.save(state_file)

        start_nodes([head], cluster.nodes, save, deadline, parallel=1)
        start_nodes(workers, cluster.nodes, save, deadline, parallel=max_parallel)
        _wait_ready(cluster, deadline)
    except BaseException:
        stop(cluster=cluster, state_file=state_file, remove_temp=False)
        raise
    cluster.ready_s = time.monotonic() - t0
    cluster.save(state_file)
    return cluster


def _check_no_cluster_alive(state_file: Path) -> None:
    """Raise ClusterError if ``state_file`` records a fake cluster with a Ray process still alive.

    Raises:
        ClusterError: a recorded node is alive, or the state file is unreadable.
    """
    if state_file.exists():
        old = FakeCluster.load(state_file)
        if any(alive(n) for n in old.nodes):
            raise ClusterError(
                f"a fake cluster is already up at {old.dashboard_url} (state {state_file}); "
                f"run `rl-tpu cluster down` first or pass another --state-file"
            )


def _parse_fake_slices(fake_slices: Sequence[str | SliceTopology]) -> list[SliceTopology]:
    """The slices ``--fake-slice`` names (``"v6e-16"`` or ``"v6e-16:4x4"``; parsed ones pass through).

    Raises:
        TopologyError: a bad slice type or topology.
        ClusterError: no slice given.
    """
    specs = []
    for s in fake_slices:
        if isinstance(s, SliceTopology):
            specs.append(s)
        else:
            atype, _, topo = str(s).partition(":")
            specs.append(parse_slice(atype, topo or None))
    if not specs:
        raise ClusterError("no --fake-slice given: name at least one, e.g. --fake-slice v6e-16")
    return specs


def _slice_records(names: list[str], specs: list[SliceTopology]) -> list[dict]:
    """The state file's ``slices``: per slice its Ray slice name, accelerator type, topology, hosts, chips/host."""
    return [
        {
            "name": n,
            "accelerator_type": s.accelerator_type,
            "topology": s.topology,
            "hosts": s.hosts,
            "chips_per_host": s.chips_per_host,
        }
        for n, s in zip(names, specs)
    ]


def _node_env(marker: str) -> dict[str, str]:
    """The environment of every ``ray start`` child: ours without ``_SCRUB_ENV``, plus the cluster marker.

    Ray auth and usage stats are switched off, and this interpreter's bin folder leads ``PATH``.
    """
    base_env = {k: v for k, v in os.environ.items() if k not in _SCRUB_ENV}
    base_env.update({MARKER_ENV: marker, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    # Job drivers run through a shell with the raylet's PATH: put this environment first so
    # `verl`, `python` in an entrypoint are ours even when the venv was not activated.
    bindir = str(Path(sys.executable).parent)
    base_env["PATH"] = bindir + os.pathsep + base_env.get("PATH", "")
    return base_env


def _head_launch(
    gcs: str, temp_dir: str, head_cpus: int, store: int, dash_port: int, env: dict[str, str]
) -> NodeLaunch:
    """How to start the Ray head node: GCS at ``gcs``, dashboard and job server on ``dash_port``, no TPU.

    ``store`` is the object store size in bytes; the head's log goes to ``<temp_dir>/head.<attempt>.log``.
    """

    def head_cmd(ports, attempt):
        return node_command(
            ports,
            head=True,
            gcs=gcs,
            temp_dir=temp_dir,
            num_cpus=head_cpus,
            resources={},
            object_store_bytes=store,
            dashboard_port=dash_port,
        )

    return NodeLaunch("head", head_cmd, env, Path(temp_dir) / "head", {})


def _slice_host_launches(
    names: list[str],
    specs: list[SliceTopology],
    gcs: str,
    temp_dir: str,
    cpus_per_host: int | None,
    store: int,
    base_env: dict[str, str],
) -> list[NodeLaunch]:
    """How to start one Ray worker node per host of each slice, in slice then worker-id order.

    Each gets ``{"TPU": chips_per_host}``, the TPU host environment GKE gives (``host_env``) and its own Ray temp
    dir per attempt; ``store`` is the object store size in bytes, ``cpus_per_host`` None means 8 per chip.
    """
    launches = []
    for name, spec in zip(names, specs):
        for w in range(spec.hosts):

            def cmd(ports, attempt, n=len(launches) + 1, spec=spec):
                return node_command(
                    ports,
                    head=False,
                    gcs=gcs,
                    temp_dir=f"{temp_dir}/n{n}-{attempt}",
                    num_cpus=cpus_per_host or CPUS_PER_CHIP * spec.chips_per_host,
                    resources={"TPU": spec.chips_per_host},
                    object_store_bytes=store,
                )

            env = dict(base_env, **host_env(spec, w, name, ["127.0.0.1"] * spec.hosts))
            launches.append(
                NodeLaunch(f"{name}/{w}", cmd, env, Path(temp_dir) / f"{name}-w{w}", host_resources(spec, w, name))
            )
    return launches


def _wait_ready(cluster: FakeCluster, deadline: float) -> None:
    """Until every node is alive with the TPU resources of its host and the job API answers."""
    want = len(cluster.nodes)
    last = "no answer from the dashboard yet"
    while time.monotonic() < deadline:
        for rec in cluster.nodes:
            if alive(rec) is None:
                raise ClusterError(f"Ray node {rec.role} exited while starting; log {rec.log}: {tail(rec.log)}")
        if _http_ok(cluster.dashboard_url + "/api/version"):
            try:
                nodes = list_alive_nodes(cluster.dashboard_url)
            except Exception as e:  # the state API answers only once the GCS has all agents
                last = f"state API: {e.__class__.__name__}"
                nodes = []
            have = {k for n in nodes for k in (_get(n, "resources_total") or {})}
            missing = [k for rec in cluster.nodes for k in rec.resources if k not in have]
            if len(nodes) >= want and not missing and _http_ok(cluster.dashboard_url + "/api/jobs/"):
                return
            last = f"{len(nodes)}/{want} nodes alive, missing resources {missing[:3]}"
        time.sleep(0.5)
    raise ClusterError(f"fake cluster not ready in time ({last}); node logs are in {cluster.temp_dir}")


def stop(
    state_file: Path | None = None, cluster: FakeCluster | None = None, grace_s: float = 10.0, remove_temp: bool = True
) -> list[int]:
    """Stop exactly the processes a fake cluster started, then delete its state file.

    The recorded ``ray start`` pids (checked against their start times), their descendants and
    any process carrying this cluster's ``RL_TPU_FAKE_CLUSTER`` marker get SIGTERM, then SIGKILL
    after ``grace_s``. Nothing else is signalled. The cluster's temp dir (logs, sockets) is
    removed unless ``remove_temp`` is False.

    Returns:
        The pids that were signalled.

    Raises:
        ClusterError: no state file (and no ``cluster`` given).
    """
    state_file = Path(state_file or default_state_file())
    if cluster is None:
        cluster = FakeCluster.load(state_file)
    pids = stop_processes(cluster.nodes, cluster.marker, grace_s)
    try:
        state_file.unlink()
    except FileNotFoundError:
        pass
    if remove_temp and Path(cluster.temp_dir).name.startswith("rlt-"):
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    return pids


def status(state_file: Path | None = None) -> dict:
    """The recorded cluster, which of its processes are alive, and Ray's view of its nodes.

    Returns:
        ``{"address", "dashboard_url", "slices", "processes": [{"role", "pid", "alive"}],
        "nodes": [{"node_id", "tpu", "slice", "worker_id", "resources"}] or None when the
        dashboard does not answer}``.

    Raises:
        ClusterError: no state file.
    """
    cluster = FakeCluster.load(Path(state_file or default_state_file()))
    procs = [{"role": r.role, "pid": r.pid, "alive": alive(r) is not None} for r in cluster.nodes]
    nodes = None
    if _http_ok(cluster.dashboard_url + "/api/version"):
        try:
            nodes = [
                {
                    "node_id": _get(n, "node_id"),
                    "tpu": (_get(n, "resources_total") or {}).get("TPU", 0),
                    "slice": (_get(n, "labels") or {}).get("ray.io/tpu-slice-name", ""),
                    "worker_id": (_get(n, "labels") or {}).get("ray.io/tpu-worker-id", ""),
                    "resources": _get(n, "resources_total"),
                }
                for n in list_alive_nodes(cluster.dashboard_url)
            ]
        except Exception:
            nodes = None
    return {
        "address": cluster.address,
        "dashboard_url": cluster.dashboard_url,
        "slices": cluster.slices,
        "temp_dir": cluster.temp_dir,
        "ready_s": cluster.ready_s,
        "processes": procs,
        "nodes": nodes,
    }
