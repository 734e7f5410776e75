"""``rl-tpu``: TPU slices on Ray — a local fake slice, job submission, slice facts, KubeRay manifests.

rl-tpu cluster up --fake-slice v6e-16          # local Ray cluster shaped like a v6e-16 slice
rl-tpu cluster status | down                   # down stops only the processes `up` started
rl-tpu job submit -- verl train --backend cpu  # to $RAY_ADDRESS or the local fake cluster
rl-tpu job status|logs|stop JOB_ID
rl-tpu slice v4-16                             # hosts, chips, mesh, Ray resources, env
rl-tpu kuberay job --slice v6e-16 --name grpo -o job.yaml -- --config my.yaml
rl-tpu kuberay validate job.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_tpu.slice_hosts import host_env, host_resources
from rl_tpu.topology import TopologyError, parse_slice

from .errors import ClusterError


def _cluster_up(a) -> int:
    from . import fake_slice

    c = fake_slice.start(
        a.fake_slice,
        cpus_per_host=a.hosts_cpus,
        head_cpus=a.head_cpus,
        object_store_mb=a.object_store_mb,
        state_file=a.state_file,
        timeout_s=a.timeout,
    )
    hosts = sum(s["hosts"] for s in c.slices)
    print(f"fake cluster ready in {c.ready_s:.1f} s: head + {hosts} TPU host node(s)")
    for s in c.slices:
        print(
            f"  slice {s['name']}: {s['accelerator_type']} {s['topology']}, {s['hosts']} hosts x "
            f"{s['chips_per_host']} chips"
        )
    print(f"  ray.init address : {c.address}")
    print(f"  dashboard / jobs : {c.dashboard_url}")
    print(f"  state file       : {a.state_file or fake_slice.default_state_file()}")
    print("use it from a shell with:")
    print(f"  export RAY_ADDRESS={c.dashboard_url} RAY_AUTH_MODE=disabled")
    return 0


def _cluster_status(a) -> int:
    from . import fake_slice

    st = fake_slice.status(a.state_file)
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    alive = sum(p["alive"] for p in st["processes"])
    print(
        f"fake cluster at {st['dashboard_url']} (ray.init address {st['address']}): "
        f"{alive}/{len(st['processes'])} node processes alive"
    )
    if st["nodes"] is None:
        print("  dashboard does not answer: run `rl-tpu cluster down` and `up` again")
        return 1
    for n in sorted(st["nodes"], key=lambda n: (n["slice"], n["worker_id"])):
        what = f"{n['slice']} worker {n['worker_id']}" if n["slice"] else "head"
        print(f"  node {n['node_id'][:8]}  {what:<34} TPU {n['tpu']:g}  CPU {n['resources'].get('CPU', 0):g}")
    return 0 if alive == len(st["processes"]) else 1


def _cluster_down(a) -> int:
    from . import fake_slice

    pids = fake_slice.stop(a.state_file)
    print(f"stopped {len(pids)} process(es) of the fake cluster")
    return 0


def _job_client(a):
    from .jobs import Jobs

    return Jobs(a.address, auth_mode=a.auth_mode, state_file=a.state_file)


def _job_submit(a) -> int:
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    env = {}
    for item in a.env:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ClusterError(f"--env {item!r} is not KEY=VALUE")
        env[k] = v
    jobs = _job_client(a)
    job_id = jobs.submit(
        cmd,
        working_dir=a.working_dir,
        env_vars=env,
        submission_id=a.submission_id,
        entrypoint_num_cpus=a.entrypoint_num_cpus,
    )
    print(f"submitted {job_id} to {jobs.address}", flush=True)
    if a.no_wait:
        return 0
    r = jobs.wait(job_id, timeout_s=a.timeout, on_log=lambda s: print(s, end="", flush=True))
    print(f"\njob {job_id}: {r.status}" + (f" — {r.message.splitlines()[0]}" if r.message and not r.ok else ""))
    return 0 if r.ok else 1


def _job_status(a) -> int:
    r = _job_client(a).status(a.job_id)
    print(f"{r.job_id}: {r.status}")
    if r.message:
        print(r.message)
    return 0 if r.status in ("SUCCEEDED", "RUNNING", "PENDING") else 1


def _job_logs(a) -> int:
    jobs = _job_client(a)
    if a.follow:
        r = jobs.wait(a.job_id, timeout_s=a.timeout, on_log=lambda s: print(s, end="", flush=True))
        return 0 if r.ok else 1
    print(jobs.status(a.job_id).logs, end="")
    return 0


def _job_stop(a) -> int:
    ok = _job_client(a).stop(a.job_id)
    print(f"{a.job_id}: {'stop requested' if ok else 'already finished'}")
    return 0


def _slice(a) -> int:
    s = parse_slice(a.accelerator_type, a.topology)
    print(
        f"{s.accelerator_type} ({s.generation}), topology {s.topology}: {s.hosts} host(s) x "
        f"{s.chips_per_host} chips = {s.chips} chips, {s.cores} TensorCores, mesh {s.mesh_shape}"
    )
    print(f"  worker 0 Ray resources: {json.dumps(host_resources(s, 0, 'SLICE'))}")
    if s.hosts > 1:  # every other host offers the same, without the head resource
        others = "worker 1" if s.hosts == 2 else f"workers 1-{s.hosts - 1} (each)"
        print(f"  {others} Ray resources: {json.dumps(host_resources(s, 1, 'SLICE'))}")
    print(f"  worker 0 env: {json.dumps(host_env(s, 0, 'SLICE'))}")
    return 0


def _kuberay(a) -> int:
    from . import kuberay

    if a.what == "validate":
        docs = kuberay.load_manifests(a.file)
        for i, d in enumerate(docs):
            try:
                kuberay.validate(d)
            except ClusterError as e:
                which = f"document {i + 1} of {a.file}" if len(docs) > 1 else a.file
                raise ClusterError(f"{which}: {e}") from None
        print(f"{a.file}: {len(docs)} manifest(s) valid against the KubeRay CRDs")
        return 0
    kw = dict(image=a.image, namespace=a.namespace)
    if a.what == "cluster":
        m = kuberay.ray_cluster_manifest(a.name, a.slice, **kw)
    else:
        args = list(a.train_args)
        if args and args[0] == "--":
            args = args[1:]
        m = kuberay.ray_job_manifest(a.name, a.slice, args, **kw)
    kuberay.validate(m)
    text = kuberay.dump([m])
    if a.output:
        Path(a.output).write_text(text)
        print(f"wrote {a.output} ({m['kind']}, validated against the KubeRay v1 CRD)")
    else:
        print(text, end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``rl-tpu`` parser: one subcommand group each for ``cluster``, ``job``, ``slice`` and ``kuberay``."""
    p = argparse.ArgumentParser(
        prog="rl-tpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    sub = p.add_subparsers(dest="group", required=True)
    _add_cluster_commands(sub)
    _add_job_commands(sub)
    _add_slice_command(sub)
    _add_kuberay_commands(sub)
    return p


def _add_cluster_commands(sub) -> None:
    """Add ``cluster up|status|down`` (the local fake TPU-slice Ray cluster) to the subparsers ``sub``."""
    c = sub.add_parser("cluster", help="local fake TPU-slice Ray cluster").add_subparsers(dest="cmd", required=True)
    up = c.add_parser("up", help="start a head node plus one Ray node per slice host")
    up.add_argument(
        "--fake-slice",
        action="append",
        required=True,
        metavar="TYPE[:TOPOLOGY]",
        help="slice to fake, e.g. v6e-16, v4-16, v5litepod-8, v6e-16:4x4; repeat for more slices",
    )
    up.add_argument(
        "--hosts-cpus",
        type=int,
        default=None,
        help="logical CPUs per slice host (default 8 per chip, as real TPU VMs; Ray scheduling slots, not real cores)",
    )
    up.add_argument(
        "--head-cpus",
        type=int,
        default=8,
        help="logical CPUs of the head node (default 8: a verl train job's TaskRunner, "
        "TransferQueue's 8 storage actors and reward/agent workers each take one)",
    )
    up.add_argument("--object-store-mb", type=int, default=512, help="object store per node, MiB (default 512)")
    up.add_argument("--timeout", type=float, default=180, help="seconds to wait for readiness (default 180)")
    for sp in (
        up,
        c.add_parser("status", help="processes and Ray nodes of the fake cluster"),
        c.add_parser("down", help="stop exactly the processes `up` started"),
    ):
        sp.add_argument(
            "--state-file",
            type=Path,
            default=None,
            help="pid/address record (default $RL_TPU_CLUSTER_STATE or ~/.cache/rl-tpu/fake-cluster.json)",
        )
    c.choices["status"].add_argument("--json", action="store_true", help="print machine-readable status")


def _add_job_options(sp):
    """Add the Ray job server's address, auth mode and state-file options to ``sp``; returns ``sp``."""
    sp.add_argument(
        "--address",
        default=None,
        help="dashboard URL, e.g. http://127.0.0.1:8265 (default $RAY_ADDRESS, else the fake cluster)",
    )
    sp.add_argument(
        "--auth-mode",
        choices=["disabled", "token"],
        default=None,
        help="Ray auth mode, set explicitly (default $RAY_AUTH_MODE or disabled)",
    )
    sp.add_argument("--state-file", type=Path, default=None, help="fake cluster state file to take the address from")
    return sp


def _add_job_commands(sub) -> None:
    """Add ``job submit|status|logs|stop`` (Ray jobs through the dashboard's job server) to ``sub``."""
    j = sub.add_parser("job", help="submit and follow Ray jobs").add_subparsers(dest="cmd", required=True)
    s = _add_job_options(j.add_parser("submit", help="submit a job; follow its logs until it ends"))
    s.add_argument("--working-dir", default=None, help="folder uploaded as the job's working dir (.venv/.git excluded)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment variable for the job")
    s.add_argument("--submission-id", default=None, help="job id to use (default: Ray picks one)")
    s.add_argument("--entrypoint-num-cpus", type=float, default=None, help="CPUs reserved for the driver")
    s.add_argument("--no-wait", action="store_true", help="return after submitting")
    s.add_argument("--timeout", type=float, default=24 * 3600, help="stop following after this many seconds")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- the driver command, e.g. -- verl train --backend cpu")
    for name, helptext in (
        ("status", "status and the driver's error, if any"),
        ("logs", "driver logs"),
        ("stop", "stop a job"),
    ):
        sp = _add_job_options(j.add_parser(name, help=helptext))
        sp.add_argument("job_id")
        if name == "logs":
            sp.add_argument("--follow", action="store_true", help="keep printing until the job ends")
            sp.add_argument("--timeout", type=float, default=24 * 3600)


def _add_slice_command(sub) -> None:
    """Add ``slice TYPE`` (a TPU slice's hosts, chips, mesh, Ray resources and env) to ``sub``."""
    sl = sub.add_parser("slice", help="print a slice's hosts, chips, mesh, Ray resources and env")
    sl.add_argument("accelerator_type", help="e.g. v6e-16, v4-16, v5p-16, v5litepod-8, tpu7x-16")
    sl.add_argument("--topology", default=None, help="chip grid, e.g. 4x4 (default: the type's standard one)")


def _add_kuberay_commands(sub) -> None:
    """Add ``kuberay cluster|job|validate`` (RayCluster / RayJob manifests for GKE TPU slices) to ``sub``."""
    k = sub.add_parser("kuberay", help="KubeRay RayCluster / RayJob manifests for TPU slices on GKE")
    ks = k.add_subparsers(dest="what", required=True)
    for name, helptext in (
        ("cluster", "write a RayCluster manifest"),
        ("job", "write a RayJob manifest running verl train --backend tpu"),
    ):
        sp = ks.add_parser(name, help=helptext)
        sp.add_argument(
            "--slice",
            action="append",
            required=True,
            metavar="TYPE[:TOPOLOGY]",
            help="TPU slice worker group, e.g. v6e-16; repeat for separate rollout/trainer slices",
        )
        sp.add_argument("--name", default="rl-tpu", help="metadata.name (default rl-tpu)")
        sp.add_argument("--namespace", default=None)
        sp.add_argument(
            "--image", default="rayproject/ray:2.60.0-py311", help="container image with rl-tpu[tpu] installed"
        )
        sp.add_argument("-o", "--output", default=None, help="write here instead of stdout")
        if name == "job":
            sp.add_argument(
                "train_args", nargs=argparse.REMAINDER, help="-- arguments after `verl train --backend tpu`"
            )
    v = ks.add_parser("validate", help="check manifests offline against the KubeRay CRDs")
    v.add_argument("file", help="YAML file (one or more documents)")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.group == "kuberay":
            return _kuberay(a)
        if a.group == "slice":
            return _slice(a)
        handler = {
            ("cluster", "up"): _cluster_up,
            ("cluster", "status"): _cluster_status,
            ("cluster", "down"): _cluster_down,
            ("job", "submit"): _job_submit,
            ("job", "status"): _job_status,
            ("job", "logs"): _job_logs,
            ("job", "stop"): _job_stop,
        }[(a.group, a.cmd)]
        return handler(a)
    except (ClusterError, TopologyError) as e:
        print(f"rl-tpu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rl-tpu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
