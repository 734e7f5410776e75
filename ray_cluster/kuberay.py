"""KubeRay manifests for TPU slices on GKE, and their offline validation against the CRDs.

:func:`ray_cluster_manifest` writes a ``ray.io/v1`` RayCluster with a CPU head and one worker
group per slice: ``numOfHosts`` = the slice's hosts, ``google.com/tpu`` = chips per host in
both limits and requests, and the GKE node selectors ``cloud.google.com/gke-tpu-accelerator``
and ``cloud.google.com/gke-tpu-topology``. :func:`ray_job_manifest` wraps the same cluster spec
in a RayJob whose entrypoint is ``verl train --backend tpu ...``.

On GKE, KubeRay's TPU webhook (part of the GKE Ray operator add-on) sets ``TPU_WORKER_ID``,
``TPU_NAME`` and ``TPU_WORKER_HOSTNAMES`` on each pod of a multi-host group and GKE sets
``TPU_ACCELERATOR_TYPE`` / ``TPU_TOPOLOGY``; Ray then offers the same per-host resources as
``rl_tpu.slice_hosts.host_resources`` (and the local fake slice) do.

:func:`validate` checks a manifest offline with ``jsonschema`` against the KubeRay v1.7.0 CRD
(``openAPIV3Schema`` of the ``v1`` version) and then walks it against the schema's declared
properties: a misspelled field that the schema alone would let through (an object schema
without ``additionalProperties: false``, or one marked ``x-kubernetes-preserve-unknown-fields``)
is reported with the closest known name.
"""

from __future__ import annotations

import difflib
import functools
import os
import shlex
from pathlib import Path
from typing import Any, Sequence

import yaml

from rl_tpu.topology import SliceTopology, parse_slice

from .errors import ClusterError

# GKE node label values for cloud.google.com/gke-tpu-accelerator (GKE "Plan TPUs" page).
GKE_TPU_ACCELERATOR = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
    "v7x": "tpu7x",
}
DEFAULT_IMAGE = "rayproject/ray:2.60.0-py311"
CRD_DIR_ENV = "RL_TPU_KUBERAY_CRDS"
_CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
# Kubernetes ObjectMeta fields a user writes (the CRD leaves metadata as a bare object).
_OBJECT_META = {
    "name",
    "namespace",
    "labels",
    "annotations",
    "generateName",
    "finalizers",
    "ownerReferences",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
}


def _container(name: str, image: str, resources: dict, env: dict[str, str] | None = None) -> dict:
    c = {"name": name, "image": image, "resources": {"limits": dict(resources), "requests": dict(resources)}}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return c


def worker_group(
    spec: SliceTopology,
    *,
    name: str,
    image: str = DEFAULT_IMAGE,
    replicas: int = 1,
    cpu: str = "8",
    memory: str = "32Gi",
    env: dict[str, str] | None = None,
) -> dict:
    """One RayCluster worker group = ``replicas`` slices of ``spec`` (``numOfHosts`` pods each)."""
    return {
        "groupName": name,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "numOfHosts": spec.hosts,
        "rayStartParams": {},
        "template": {
            "spec": {
                "containers": [
                    _container(
                        "ray-worker",
                        image,
                        {"cpu": cpu, "memory": memory, "google.com/tpu": str(spec.chips_per_host)},
                        env,
                    )
                ],
                "nodeSelector": {
                    "cloud.google.com/gke-tpu-accelerator": GKE_TPU_ACCELERATOR[spec.generation],
                    "cloud.google.com/gke-tpu-topology": spec.topology,
                },
            }
        },
    }


def ray_cluster_spec(
    slices: Sequence[str | SliceTopology],
    *,
    image: str = DEFAULT_IMAGE,
    head_cpu: str = "4",
    head_memory: str = "16Gi",
    worker_cpu: str = "8",
    worker_memory: str = "32Gi",
    env: dict[str, str] | None = None,
) -> dict:
    """The ``spec`` of a RayCluster: a CPU head plus one worker group per entry of ``slices``
    (``"v6e-16"`` or ``"v6e-16:4x4"``; two entries = separate rollout and trainer slices).

    Raises:
        TopologyError: a bad slice.
    """
    specs = [s if isinstance(s, SliceTopology) else parse_slice(*_split(s)) for s in slices]
    if not specs:
        raise ClusterError("no slice given: name at least one, e.g. --slice v6e-16")
    # No RAY_AUTH_MODE here: on KubeRay, token auth is the operator's (spec.authOptions).
    groups = [
        worker_group(
            s, name=f"tpu-{s.accelerator_type}-{i}", image=image, cpu=worker_cpu, memory=worker_memory, env=env
        )
        for i, s in enumerate(specs)
    ]
    return {
        "rayVersion": "2.60.0",
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
            "template": {
                "spec": {
                    "containers": [
                        _container("ray-head", image, {"cpu": head_cpu, "memory": head_memory}, env)
                        | {
                            "ports": [
                                {"containerPort": 6379, "name": "gcs"},
                                {"containerPort": 8265, "name": "dashboard"},
                                {"containerPort": 10001, "name": "client"},
                            ]
                        }
                    ]
                }
            },
        },
        "workerGroupSpecs": groups,
    }


def _split(text: str) -> tuple[str, str | None]:
    a, _, t = text.partition(":")
    return a, (t or None)


def _k8s_name(name: str) -> str:
    ok = (
        name
        and len(name) <= 63
        and name.replace("-", "a").isalnum()
        and name == name.lower()
        and name[0].isalnum()
        and name[-1].isalnum()
    )
    if not ok:
        raise ClusterError(
            f"name {name!r} is not a Kubernetes name: use lowercase letters, digits and "
            f"'-', start and end with a letter or digit, at most 63 characters"
        )
    return name


def ray_cluster_manifest(
    name: str, slices: Sequence[str | SliceTopology], *, namespace: str | None = None, **kwargs: Any
) -> dict:
    """A complete ``ray.io/v1`` RayCluster manifest (see :func:`ray_cluster_spec` for kwargs)."""
    meta = {"name": _k8s_name(name)} | ({"namespace": namespace} if namespace else {})
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": meta,
        "spec": ray_cluster_spec(slices, **kwargs),
    }


def ray_job_manifest(
    name: str,
    slices: Sequence[str | SliceTopology],
    train_args: Sequence[str] = (),
    *,
    namespace: str | None = None,
    ttl_s: int = 600,
    **kwargs: Any,
) -> dict:
    """A ``ray.io/v1`` RayJob running ``verl train --backend tpu <train_args>`` on a new cluster
    of ``slices`` that is deleted ``ttl_s`` seconds after the job ends."""
    meta = {"name": _k8s_name(name)} | ({"namespace": namespace} if namespace else {})
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": meta,
        "spec": {
            "entrypoint": shlex.join(["verl", "train", "--backend", "tpu", *train_args]),
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": ttl_s,
            "rayClusterSpec": ray_cluster_spec(slices, **kwargs),
        },
    }


def crd_dir() -> Path:
    """``$RL_TPU_KUBERAY_CRDS``, else the KubeRay v1.7.0 CRDs shipped in ``ray_cluster/crds``."""
    if os.environ.get(CRD_DIR_ENV):
        return Path(os.environ[CRD_DIR_ENV])
    here = Path(__file__).resolve().parent
    for cand in (here / "crds", here.parent.parent / "shared" / "kuberay"):
        if cand.is_dir():
            return cand
    raise ClusterError(
        f"KubeRay CRD schemas not found; set {CRD_DIR_ENV} to the folder holding {', '.join(_CRD_FILES.values())}"
    )


@functools.lru_cache(maxsize=4)
def crd_schema(kind: str, directory: str | None = None, version: str = "v1") -> dict:
    """The ``openAPIV3Schema`` of ``kind`` (RayCluster / RayJob) from the KubeRay CRD file."""
    if kind not in _CRD_FILES:
        raise ClusterError(f"kind {kind!r} has no KubeRay CRD here; use one of {sorted(_CRD_FILES)}")
    path = Path(directory or crd_dir()) / _CRD_FILES[kind]
    try:
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as e:
        raise ClusterError(f"cannot read the {kind} CRD at {path} ({e.strerror}); set {CRD_DIR_ENV}") from None
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise ClusterError(f"{path} has no {version} version of {kind}")


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Paths of keys in ``obj`` that ``schema`` does not declare, each with a suggestion.

    Descends through ``properties``, ``additionalProperties`` and ``items`` (and the branches of
    ``allOf``/``anyOf``/``oneOf``); keys under ``x-kubernetes-preserve-unknown-fields`` objects
    are still checked against the properties those objects declare.
    """
    out: list[str] = []
    if isinstance(obj, dict):
        props = dict(schema.get("properties", {}))
        for sub in schema.get("allOf", []) + schema.get("anyOf", []) + schema.get("oneOf", []):
            props.update(sub.get("properties", {}))
        addl = schema.get("additionalProperties")
        if path.endswith("metadata") and not props and schema.get("type") == "object":
            props = {k: {} for k in _OBJECT_META}  # ObjectMeta: the CRD leaves it open
        for key, val in obj.items():
            where = f"{path}.{key}" if path else key
            if key in props:
                out += unknown_fields(val, props[key], where)
            elif isinstance(addl, dict):
                out += unknown_fields(val, addl, where)
            elif props and addl is not True:
                near = difflib.get_close_matches(key, list(props), n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(sorted(props)[:12])})"
                out.append(f"{where}{hint}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


def load_manifests(path: str | Path) -> list[dict]:
    """The YAML documents of ``path`` (empty ones skipped), each a mapping.

    Raises:
        ClusterError: the file cannot be read, is not valid YAML (with line and column), holds no
            document, or a document's top level is not a mapping (a list or a scalar).
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ClusterError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ClusterError(
            f"{path} is not a text file: pass a YAML manifest, e.g. one from rl-tpu kuberay job -o FILE"
        ) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        ctx, ctx_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if ctx and ctx_mark and ctx_mark is not mark:  # e.g. the unclosed "[" that the error is about
            problem += f" ({ctx} started at line {ctx_mark.line + 1}, column {ctx_mark.column + 1})"
        raise ClusterError(
            f"{path} is not valid YAML{where}: {problem}; fix the YAML there (brackets, quotes, indentation)"
        ) from None
    if not docs:
        raise ClusterError(
            f"{path} holds no YAML document: pass a RayCluster or RayJob manifest, e.g. one "
            "from rl-tpu kuberay job -o FILE"
        )
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            which = f"document {i + 1} of {path}" if len(docs) > 1 else path
            raise ClusterError(
                f"{which} is a YAML {type(d).__name__} at the top level, not a mapping: a "
                "manifest starts with apiVersion: ray.io/v1 and kind: RayCluster or RayJob"
            )
    return docs


def validate(manifest: dict, crd_directory: str | Path | None = None) -> None:
    """Validate a RayCluster / RayJob manifest offline.

    Raises:
        ClusterError: the schema rejects it (first error, with its path) or it has fields the
            schema does not declare (all of them, with the closest known names).
    """
    import jsonschema

    if not isinstance(manifest, dict):
        raise ClusterError(
            f"a manifest is a mapping (apiVersion, kind, metadata, spec), not a {type(manifest).__name__}"
        )
    kind = manifest.get("kind")
    if manifest.get("apiVersion") != "ray.io/v1":
        raise ClusterError(
            f"apiVersion {manifest.get('apiVersion')!r} is not ray.io/v1; generate it with rl-tpu kuberay"
        )
    schema = crd_schema(str(kind), str(crd_directory) if crd_directory else None)
    validator = jsonschema.Draft4Validator(schema)
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ClusterError(
            f"{kind} manifest invalid at {where}: {e.message[:300]} "
            f"({len(errors)} schema error{'s' if len(errors) > 1 else ''})"
        )
    unknown = unknown_fields(manifest, schema)
    if unknown:
        raise ClusterError(f"{kind} manifest has fields the KubeRay CRD does not know: {'; '.join(unknown)}")


def dump(manifests: Sequence[dict]) -> str:
    """YAML documents separated by ``---``, ready for ``kubectl apply -f -``."""
    return "---\n".join(yaml.safe_dump(m, sort_keys=False) for m in manifests)
