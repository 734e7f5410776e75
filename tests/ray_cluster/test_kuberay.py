"""KubeRay manifests for TPU slices, validated offline against the KubeRay v1.7.0 CRDs."""

import copy
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from rl_tpu.topology import TopologyError
from ray_cluster.errors import ClusterError
from ray_cluster.kuberay import (
    crd_schema,
    load_manifests,
    ray_cluster_manifest,
    ray_job_manifest,
    unknown_fields,
    validate,
)


@pytest.mark.parametrize(
    "atype,hosts,chips,accel,topo",
    [
        ("v6e-16", 4, "4", "tpu-v6e-slice", "4x4"),
        ("v6e-8", 1, "8", "tpu-v6e-slice", "2x4"),
        ("v4-16", 2, "4", "tpu-v4-podslice", "2x2x2"),
        ("v5p-16", 2, "4", "tpu-v5p-slice", "2x2x2"),
        ("v5litepod-16", 4, "4", "tpu-v5-lite-podslice", "4x4"),
        ("tpu7x-16", 2, "4", "tpu7x", "2x2x2"),
    ],
)
def test_cluster_manifest_per_slice(atype, hosts, chips, accel, topo):
    m = ray_cluster_manifest("rl-tpu", [atype])
    validate(m)
    (g,) = m["spec"]["workerGroupSpecs"]
    assert g["numOfHosts"] == hosts
    pod = g["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["google.com/tpu"] == chips == res["requests"]["google.com/tpu"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": accel,
        "cloud.google.com/gke-tpu-topology": topo,
    }
    assert (
        "google.com/tpu" not in m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    )


def test_job_manifest_separate_slices_and_entrypoint():
    j = ray_job_manifest(
        "grpo-run", ["v6e-16", "v6e-8"], ["--config", "my run.yaml", "trainer.total_training_steps=10"]
    )
    validate(j)
    assert j["spec"]["entrypoint"] == "verl train --backend tpu --config 'my run.yaml' trainer.total_training_steps=10"
    groups = j["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [g["numOfHosts"] for g in groups] == [4, 1]
    assert len({g["groupName"] for g in groups}) == 2


def test_misspelled_field_the_schema_alone_allows_is_caught():
    m = ray_cluster_manifest("rl-tpu", ["v6e-16"])
    bad = copy.deepcopy(m)
    bad["spec"]["workerGroupSpecs"][0]["numOfHost"] = 4  # typo: KubeRay would drop it silently
    # The CRD schema by itself lets it through (no additionalProperties: false) ...
    jsonschema.Draft4Validator(crd_schema("RayCluster")).validate(bad)
    # ... our known-fields check does not.
    with pytest.raises(ClusterError, match=r"workerGroupSpecs\[0\]\.numOfHost \(did you mean 'numOfHosts'\?\)"):
        validate(bad)
    bad = copy.deepcopy(m)
    bad["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelectors"] = {}
    with pytest.raises(ClusterError, match="nodeSelectors.*did you mean 'nodeSelector'"):
        validate(bad)
    bad = copy.deepcopy(m)
    bad["metadata"]["lables"] = {"a": "b"}
    with pytest.raises(ClusterError, match="metadata.lables"):
        validate(bad)


def test_preserve_unknown_fields_objects_are_still_checked():
    schema = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {"replicas": {"type": "integer"}},
    }
    assert unknown_fields({"replicas": 1}, schema) == []
    assert unknown_fields({"replica": 1}, schema) == ["replica (did you mean 'replicas'?)"]


def test_schema_errors_and_bad_names():
    m = ray_cluster_manifest("rl-tpu", ["v4-16"])
    m["spec"]["workerGroupSpecs"][0]["numOfHosts"] = "2"
    with pytest.raises(ClusterError, match="numOfHosts: '2' is not of type 'integer'"):
        validate(m)
    with pytest.raises(ClusterError, match="not a Kubernetes name"):
        ray_cluster_manifest("RL_TPU", ["v4-16"])
    with pytest.raises(TopologyError, match="unknown TPU accelerator type 'v9-8'"):
        ray_cluster_manifest("rl-tpu", ["v9-8"])


def test_cli_writes_and_validates(tmp_path):
    rl_tpu = str(Path(sys.executable).parent / "rl-tpu")
    out = tmp_path / "job.yaml"
    config = "verl_backend/configs/grpo_cpu.yaml"  # the CPU default job
    r = subprocess.run(
        [rl_tpu, "kuberay", "job", "--slice", "v5p-16", "--name", "grpo", "-o", str(out), "--", "--config", config],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "RayJob" and doc["spec"]["entrypoint"].endswith(f"--config {config}")
    r = subprocess.run([rl_tpu, "kuberay", "validate", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "valid" in r.stdout
    out.write_text(out.read_text().replace("numOfHosts", "numHosts"))
    r = subprocess.run([rl_tpu, "kuberay", "validate", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "numHosts (did you mean 'numOfHosts'?)" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "text, expect",
    [
        ("a: [1, 2\n", "is not valid YAML at line 2, column 1: expected ',' or ']'"),
        ("- a\n- b\n", "is a YAML list at the top level, not a mapping"),
        ("42\n", "is a YAML int at the top level, not a mapping"),
        ("", "holds no YAML document"),
    ],
)
def test_cli_validate_bad_yaml_is_one_line(tmp_path, text, expect):
    rl_tpu = str(Path(sys.executable).parent / "rl-tpu")
    f = tmp_path / "m.yaml"
    f.write_text(text)
    r = subprocess.run([rl_tpu, "kuberay", "validate", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"rl-tpu: error: {f} ") and expect in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_load_manifests_names_the_document_and_the_unclosed_bracket(tmp_path):
    f = tmp_path / "two.yaml"
    f.write_text("apiVersion: ray.io/v1\nkind: RayJob\n---\n- x\n")
    with pytest.raises(ClusterError, match=r"document 2 of .*two\.yaml is a YAML list"):
        load_manifests(f)
    f.write_text("a: 1\nb: [1, 2\n")
    with pytest.raises(ClusterError, match=r"flow sequence started at line 2, column 4"):
        load_manifests(f)
    with pytest.raises(ClusterError, match="is a mapping .*not a list"):
        validate(["apiVersion", "ray.io/v1"])
