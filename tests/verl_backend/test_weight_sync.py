"""The weight sync's one route choice: the cheapest transport the facts allow, with its reason; the explicit
hand-over of the trainer's weights."""

import pytest

from verl_backend import weight_sync as ws


def facts(**over):
    base = dict(placement="server", shared_weights=True, trainer_memory=None, server_memory=None, src_rank=0,
                dst_replica=1, bucket_bytes=64 << 20)
    base.update(over)
    return ws.SyncFacts(**base)


@pytest.mark.parametrize("over, transport, reason", [
    ({"placement": "worker"}, "in_worker", "inside the trainer worker"),
    ({}, "trainer_memory", "optimizer step is the sync"),
    ({"trainer_memory": "the actor runs FSDP2 over 4 ranks"}, "shared_memory", "the actor runs FSDP2 over 4 ranks"),
    ({"trainer_memory": "t", "server_memory": "the server is on another host"}, "object_store", "another host"),
    ({"shared_weights": False}, "object_store", "rl_tpu.shared_weights=false"),
])
def test_route_is_the_cheapest_the_facts_allow(over, transport, reason):
    route = ws.choose_route(facts(**over))
    assert route.transport == transport and reason in route.reason
    assert (route.src_rank, route.dst_replica) == (0, 1)
    assert route.bucket_bytes == (64 << 20 if transport == "object_store" else 0)
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


def test_report_as_metrics():
    report = ws.SyncReport(version=3, transport="object_store", bytes=2e6, copied_bytes=2e6, seconds=0.5, buckets=2)
    metrics = report.as_metrics()
    assert metrics["version"] == 3 and metrics["buckets"] == 2.0 and metrics["transport"] == "object_store"
