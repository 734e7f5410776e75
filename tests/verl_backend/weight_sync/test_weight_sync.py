"""The weight sync's one route choice among all six transports: the cheapest the facts allow, with its reason; the
plan ``--print-config`` shows; the same step metrics on every transport; the explicit hand-over of the trainer's
weights; the package has no import circle."""

import pytest

from verl_backend import weight_sync as ws


def facts(**over):
    base = dict(
        placement="server",
        shared_weights=True,
        trainer_memory=None,
        server_memory=None,
        src_rank=0,
        dst_replica=1,
        bucket_bytes=64 << 20,
    )
    base.update(over)
    return ws.SyncFacts(**base)


@pytest.mark.parametrize(
    "over, transport, reason",
    [
        ({"placement": "worker"}, "in_worker", "inside the trainer worker"),
        ({}, "trainer_memory", "optimizer step is the sync"),
        ({"trainer_memory": "the actor runs FSDP2 over 4 ranks"}, "shared_memory", "the actor runs FSDP2 over 4 ranks"),
        ({"trainer_memory": "t", "server_memory": "the server is on another host"}, "object_store", "another host"),
        ({"shared_weights": False}, "object_store", "rl_tpu.shared_weights=false"),
        ({"pool": True}, "pool_shared_memory", "pool of its own"),
        ({"pool": True, "placement": "worker"}, "pool_shared_memory", "trainer rank 0's host"),
        ({"pool": True, "pool_memory": "the rollout pool is on other hosts"}, "pool_broadcast", "other hosts"),
        ({"pool": True, "shared_weights": False}, "pool_broadcast", "rl_tpu.shared_weights=false"),
    ],
)
def test_route_is_the_cheapest_the_facts_allow(over, transport, reason):
    route = ws.choose_route(facts(**over))
    assert route.transport == transport and reason in route.reason
    assert (route.src_rank, route.dst_replica) == (0, 1)
    assert route.bucket_bytes == (
        64 << 20 if transport in ("object_store", "pool_broadcast", "pool_shared_memory") else 0
    )
    assert route.describe().startswith("trainer rank 0 -> rollout replica 1: ")


def test_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="placement 'remote'"):
        ws.choose_route(facts(placement="remote"))


def test_hand_over_is_explicit_and_can_be_withdrawn():
    marker = object()
    assert ws.handed_over("critic") is None
    ws.hand_over(marker, role="critic")
    assert ws.handed_over("critic") is marker
    ws.hand_over(None, role="critic")
    assert ws.handed_over("critic") is None


# the route numbers metrics.jsonl has carried since the six transports existed: stable, whatever the registry's order
ROUTE_NUMBERS = {
    "in_worker": 0,
    "trainer_memory": 1,
    "shared_memory": 2,
    "object_store": 3,
    "pool_broadcast": 4,
    "pool_shared_memory": 5,
}


@pytest.mark.parametrize("transport", ws.TRANSPORTS)
def test_every_transport_reports_the_same_metric_names(transport):
    report = ws.SyncReport(version=3, transport=transport, bytes=2e6, copied_bytes=2e6, seconds=0.5, buckets=2)
    assert report.as_metrics() == {
        "weight_sync/route": float(ROUTE_NUMBERS[transport]),
        "weight_sync/bytes": 2e6,
        "weight_sync/seconds": 0.5,
        "weight_sync/verified": 0.0,
    }
    assert report.as_dict()["version"] == 3 and report.as_dict()["transport"] == transport
    assert ws.route_number(transport) == ROUTE_NUMBERS[transport]


def test_the_registry_names_each_transport_once_with_a_stable_number_and_its_class():
    # the gloo engine first, as the plugin imports it: a fresh import of a pool transport's module runs VeRL's
    # checkpoint-engine module, whose plugin hook imports the gloo engine, which imports that module half-made
    import verl_backend.weight_sync.gloo_engine  # noqa: F401

    assert {name: ws.REGISTRY[name].route for name in ws.REGISTRY} == ROUTE_NUMBERS
    assert len({r.route for r in ws.REGISTRY.values()}) == len(ws.REGISTRY)
    assert ws.TRANSPORTS == tuple(sorted(ROUTE_NUMBERS, key=ROUTE_NUMBERS.get))
    for name in ws.REGISTRY:
        cls = ws.transport_class(name)
        assert issubclass(cls, ws.Transport) and cls.name == name
    with pytest.raises(ValueError, match="weight sync transport 'carrier_pigeon'"):
        ws.route_number("carrier_pigeon")


@pytest.mark.parametrize(
    "transport, held, first_sync",
    [
        ("in_worker", {"sampler": "S", "server": "H"}, ("in process", "loaded on the trainer worker's device")),
        (
            "in_worker",
            {"sampler": "S", "colocated": False},
            ("in process", "loaded on the rollout worker's own device"),
        ),
        (
            "trainer_memory",
            {"server": "H", "attached": "A"},
            ("shared memory", "in place: the rollout computes on the trainer's parameters, 3 MB copied"),
        ),
        ("shared_memory", {"server": "H", "writer": "W"}, ("shared memory", "")),
        ("object_store", {"server": "H", "bucket_bytes": 64 << 20}, ("object store", "")),
        ("object_store", {"server": "H", "shared_weights": False}, ("object store", "rl_tpu.shared_weights=false")),
    ],
)
def test_a_replica_builds_its_transport_through_the_interface(transport, held, first_sync):
    """The rollout's adapter builds each transport from what it holds and reports its first sync in the transport's
    own words (the lines it printed before the registry)."""
    end = ws.ReplicaEnd(**held)
    sender = ws.transport_class(transport).for_replica(end)
    assert sender.name == transport
    for attribute in ("server", "sampler", "attached", "writer", "bucket_bytes"):
        if hasattr(sender, attribute) and attribute in held:
            assert getattr(sender, attribute) == held[attribute]
    report = ws.SyncReport(version=1, transport=transport, bytes=3e6, copied_bytes=3e6, seconds=0.1)
    assert sender.first_sync_words(report, end) == first_sync


@pytest.mark.parametrize("transport", ["pool_broadcast", "pool_shared_memory"])
def test_the_pool_transports_are_not_built_by_a_replica(transport):
    import verl_backend.weight_sync.gloo_engine  # noqa: F401  (see the registry's test)

    with pytest.raises(NotImplementedError, match="gloo|adapter"):
        ws.transport_class(transport).for_replica(ws.ReplicaEnd())


def test_the_rollout_names_no_transport():
    """No ``if``/``elif`` over transport names in ``rollout/``: no string of a transport's name is compared there."""
    import ast
    from pathlib import Path

    folder = Path(ws.__file__).parents[1] / "rollout"
    named = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if isinstance(side, ast.Constant) and side.value in ws.REGISTRY:
                        named.append(f"{path.name}:{node.lineno} {side.value}")
    assert named == []


def test_route_numbers_are_documented_in_the_package_docstring():
    import verl_backend.weight_sync as package

    for name in ws.TRANSPORTS:
        assert f" {ws.route_number(name)}  ``{name}``" in package.__doc__


def test_the_run_logs_planned_and_taken():
    took = ws.choose_route(facts(trainer_memory="cannot map"))
    line = ws.took_line("trainer_memory", took)
    assert line.startswith("[rl-tpu] weight sync route: planned trainer_memory, took shared_memory, because ")


def _config(**over):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "v1": {"trainer_mode": "sync"}},
            "actor_rollout_ref": {
                "model": {"lora_rank": 0},
                "rollout": {
                    "tensor_model_parallel_size": 1,
                    "data_parallel_size": 1,
                    "pipeline_model_parallel_size": 1,
                    "nnodes": 1,
                    "n_gpus_per_node": 1,
                    "engine_kwargs": {"native": {}},
                    "checkpoint_engine": {"backend": "naive", "update_weights_bucket_megabytes": 64},
                },
            },
        }
    )
    for key, value in over.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize(
    "over, cpu, shared, rollout_slice, transports",
    [
        ({}, True, True, None, ["trainer_memory"]),
        ({"actor_rollout_ref.model.lora_rank": 16}, True, True, None, ["object_store"]),  # adapter only, merged there
        ({"trainer.n_gpus_per_node": 2}, True, True, None, ["shared_memory", "shared_memory"]),
        ({}, True, False, None, ["object_store"]),
        (
            {
                "actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement": "worker",
                "actor_rollout_ref.rollout.checkpoint_engine.backend": "native",
            },
            False,
            True,
            None,
            ["in_worker"],
        ),
        (
            {
                "trainer.v1.trainer_mode": "separate_async",
                "actor_rollout_ref.rollout.checkpoint_engine.backend": "gloo",
            },
            True,
            True,
            None,
            ["pool_shared_memory"],
        ),
        (
            {
                "trainer.v1.trainer_mode": "separate_async",
                "actor_rollout_ref.rollout.checkpoint_engine.backend": "gloo",
                "actor_rollout_ref.rollout.n_gpus_per_node": 4,
                "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
                "actor_rollout_ref.rollout.engine_kwargs.native.sampler_placement": "worker",
            },
            False,
            True,
            "v6e-8",
            ["pool_broadcast", "pool_broadcast"],
        ),
    ],
)
def test_plan_from_the_config_covers_every_transport(over, cpu, shared, rollout_slice, transports):
    from verl_backend.rollout.native_kwargs import native_engine_kwargs
    from verl_backend.weight_sync.route import config_facts

    placement = native_engine_kwargs(_config(**over).actor_rollout_ref.rollout).sampler_placement  # as the driver
    facts, _ = config_facts(
        _config(**over), cpu=cpu, shared_weights=shared, rollout_slice=rollout_slice, placement=placement
    )
    assert [ws.choose_route(f).transport for f in facts] == transports
    text = ws.plan_routes(
        _config(**over), cpu=cpu, shared_weights=shared, rollout_slice=rollout_slice, placement=placement
    )
    assert all(line.startswith("# ") for line in text.splitlines())
    assert f"rollout replica {len(transports) - 1}: " in text


def test_package_modules_import_no_circle():
    """Each module of the package imports only modules listed before it (arrows one way)."""
    import ast
    from pathlib import Path

    order = [
        "base",
        "lora",
        "verify",
        "route",
        "apply",
        "in_worker",
        "trainer_memory",
        "shared_memory",
        "object_store",
        "pool_stream",
        "pool_broadcast",
        "pool_shared_memory",
        "gloo_engine",
    ]
    folder = Path(ws.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") == sorted(order)
    for i, name in enumerate(order):
        tree = ast.parse((folder / f"{name}.py").read_text())
        used = {
            n.module.rsplit(".", 1)[-1]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("verl_backend.weight_sync.")
        }
        assert used <= set(order[:i]), (name, used - set(order[:i]))


def test_print_config_shows_the_planned_route(tmp_path):
    import os
    import subprocess
    import sys

    def verl(*args):
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
        env.pop("VERL_PLATFORM", None)
        return subprocess.run(
            [sys.executable, "-m", "verl_backend.driver.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    proc = verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "--print-config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "# weight sync (planned" in proc.stdout
    assert "#   trainer rank 0 -> rollout replica 0: shared memory, in place (" in proc.stdout
    proc = verl(
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(tmp_path),
        "--print-config",
        "actor_rollout_ref.model.lora_rank=16",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rollout replica 0: Ray object store" in proc.stdout and "LoRA (lora_rank=16)" in proc.stdout
