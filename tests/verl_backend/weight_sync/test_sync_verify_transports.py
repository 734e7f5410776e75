"""Negative controls per transport, through the :class:`~verl_backend.weight_sync.base.Transport` interface (issue
#32): the trainer's proof (:func:`verl_backend.weight_sync.verify.trainer_proof`) is taken as the job takes it, the
weights go through the route's real ``send`` and its real receiver (the rollout server's ``begin_weight_update`` /
``update_weights_bucket`` / ``end_weight_update``, the in-worker load, the ``gloo`` engine's receiver), and the rollout
checks the sync where the job does (:meth:`NativeRolloutServer.verify_sync` for the server's routes,
:func:`~verl_backend.weight_sync.verify.check_sync` on the in-worker sampler).

Per transport: two faithful syncs verify (probe within the float32 bound, every fingerprint equal); then each fault,
after a default-learning-rate update of the trainer (every element +-1e-5, :func:`adam_like_step`), is reported a
success by the transport (a :class:`SyncReport`, the new version served: what a run would log without the check) and
stopped by the check in one line naming the replica, the version and the tensor:

* one tensor lost on the way (``model.norm.weight``, after the trainer fingerprinted it): its fingerprint (the probe
  alone passes: asserted);
* the stream delivered but the sampler's packed copies left stale: the probe, and the packed-copy check names the
  layer (routes that write from another process: the server forgot ``Sampler.weights_changed``; in-process loads:
  their invalidation (``weights_changed`` and the version counters) disabled, a fault injection);
* nothing delivered after the update: the probe and the first fingerprint;
* stale weights sent (every byte delivered, but the previous version's): the probe and every fingerprint.

On ``trainer_memory`` (the rollout computes on the trainer's own shared-memory parameters) an in-place optimizer step
*is* the sync: a tensor can only be lost, or nothing delivered, when the trainer's parameters left the shared file
(rebound, ``param.data = ...``), and the sync must copy them back; those are the faults modelled there.

The object store needs Ray (``ray.put``): a private local instance (``address="local"``, never another job's
cluster). The rollout server runs in this process behind :class:`ActorHandle` (``.remote`` calls, arguments pickled,
top-level ``ObjectRef`` s resolved, as Ray does), so its sampler can be inspected and faults injected. The pool
transports run VeRL's ``gloo`` checkpoint engine with the source and one rollout worker in two threads of this process
(a real gloo group over loopback), the receiver loading into an in-worker sampler (a rollout slice's second hop); the
proof crosses the group after the last bucket and the worker's verdict goes back to the source, as in a job.

Measured (this tiny 2-layer Llama, SmolLM2's 49152-token vocabulary, float32 both sides), the same on every route:
faithful syncs probe max |diff| 9.5e-7 (score 0.003 of the bound); the lost norm weight moves the probe by 5.7e-6
(score 0.018: passes, the fingerprint alone names it); nothing delivered 4.7e-4 (score 1.49), stale packed copies
4.0e-4 (score 1.26): a one-step update is just over the probe's bound here, which the packed-copy check relies on.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import shutil
import tempfile
import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")

from rl_tpu.sampler.packed import packed_linear_supported  # noqa: E402
from verl_backend.weight_sync import SyncReport  # noqa: E402
from verl_backend.weight_sync import verify as sv  # noqa: E402

torch.set_num_threads(1)

LR = 1e-5  # half the default job's learning rate (2e-5): an Adam step moves each element by about this much
VICTIM = "model.norm.weight"  # 64 elements: the tensor a lost bucket would take with it unnoticed by the probe
FIRST = "model.embed_tokens.weight"  # the first tensor the trainer sends
PACKED = "model.layers.0.self_attn.q_proj.weight (packed copy)"  # the first packed copy the check reaches
FAITHFUL_MAX_DIFF = 1e-5  # float32 both sides, the same numbers: measured 0 to a few 1e-6
ROUTES = ("in_worker", "trainer_memory", "shared_memory", "object_store", "pool_broadcast", "pool_shared_memory")
REPLICA = {name: i + 1 for i, name in enumerate(ROUTES)}  # a replica number per route: the message must name it
STALE_ROUTES = ("in_worker", "trainer_memory", "shared_memory", "object_store")  # the pool's 2nd hop is in_worker's

needs_packed = pytest.mark.skipif(not packed_linear_supported(), reason="packed weights need torch with oneDNN")


def adam_like_step(model: torch.nn.Module, seed: int, rebind: tuple[str, ...] = ()) -> None:
    """Every element moved by +-LR (Adam's step size at the start of training), in place; the parameters named in
    ``rebind`` (``"*"``: all) get new storage instead (``param.data = ...``: they leave a shared file)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            delta = LR * torch.sign(torch.randn(p.shape, generator=g))
            if "*" in rebind or name in rebind:
                p.data = p.data + delta
            else:
                p.add_(delta)


def dropped(stream, name: str):
    """The stream with ``name`` lost on the way (after the trainer fingerprinted it)."""
    return ((n, t) for n, t in stream if n != name)


def stale(snapshot: dict):
    """The stream consumed (fingerprinted as the new weights) and an older copy of every tensor delivered in its
    place: a sender that exported a cached state."""

    def fault(stream):
        for _ in stream:
            pass
        return iter(snapshot.items())

    return fault


def nothing(stream):
    """The stream consumed (the trainer fingerprinted all of it) and nothing delivered."""
    for _ in stream:
        pass
    return iter(())


class ActorHandle:
    """A Ray actor handle's surface over an object in this process: ``handle.method.remote(*args)`` returns an
    awaitable; the arguments travel pickled, top-level ``ray.ObjectRef`` s resolved to their values (as Ray does)."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name: str):
        method = getattr(self._obj, name)

        def remote(*args, **kwargs):
            def travel(x):
                if type(x).__name__ == "ObjectRef":
                    import ray

                    return ray.get(x)
                return pickle.loads(pickle.dumps(x))

            args, kwargs = [travel(a) for a in args], {k: travel(v) for k, v in kwargs.items()}

            async def call():
                out = method(*args, **kwargs)
                return await out if inspect.isawaitable(out) else out

            return call()

        return SimpleNamespace(remote=remote)


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def local_ray():
    """A private Ray instance for the object store (``ray.put``); one already started in this process is reused."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    temp = tempfile.mkdtemp(prefix="svt", dir="/tmp")  # short: Ray's socket paths live under it
    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 << 20,
        _temp_dir=temp,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _rollout_config():
    return SimpleNamespace(prompt_length=32, response_length=8, max_num_seqs=8, dtype="float32")


def _trainer(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()


class Route:
    """One transport from a trainer module to a rollout sampler. ``sync(version, fault)`` takes the trainer's proof of
    its module now, sends the (faulty) stream through the transport and returns ``(report, proof)``;
    ``verify(proof)`` is the rollout side's check (raises :class:`~verl_backend.weight_sync.verify.WeightSyncMismatch`);
    ``served`` the version the rollout says it serves."""

    name: str
    sampler = None
    rebind: tuple[str, ...] = ()  # what the trainer's update rebinds (trainer_memory's faults)

    def __init__(self, path) -> None:
        self.path, self.trainer, self.replica = path, _trainer(path), REPLICA[self.name]
        self._closers = []

    def proof(self, version: int):
        return sv.trainer_proof(self.trainer, self.trainer.state_dict().items(), version, "float32")

    def sync(self, version: int, fault=None) -> tuple[SyncReport, sv.SyncProof]:
        stream, proof = self.proof(version)
        report = self.send(fault(stream) if fault else stream, version)
        return report, proof

    def step(self, version: int, rebind: tuple[str, ...] = ()) -> None:
        adam_like_step(self.trainer, version, rebind)

    def verify(self, proof) -> dict:
        return sv.check_sync(self.sampler, pickle.loads(pickle.dumps(proof)), self.replica).as_metrics()

    def close(self) -> None:
        for close in reversed(self._closers):
            close()


class ServerRoute(Route):
    """The rollout server (its own sampler, shared-memory weights on the CPU) behind an :class:`ActorHandle`."""

    def __init__(self, path) -> None:
        from verl_backend.rollout.server import NativeRolloutServer

        super().__init__(path)
        self.server = NativeRolloutServer(
            rollout_config=_rollout_config(), model_path=str(path), batch_window_s=0.01, replica_rank=self.replica
        )
        self.handle = ActorHandle(self.server)
        self.sampler = self.server.sampler
        self._closers.append(lambda: self.server.shared is not None and self.server.shared.close())

    def send(self, stream, version):
        return asyncio.run(self.transport.send(stream, version))

    def verify(self, proof) -> dict:  # as the adapter does: server.verify_sync.remote(proof)
        return asyncio.run(self.handle.verify_sync.remote(proof))

    @property
    def served(self) -> int:
        return self.server.global_steps


class InWorkerRoute(Route):
    name = "in_worker"

    def __init__(self, path) -> None:
        from verl_backend.rollout.sampling import build_sampler
        from verl_backend.weight_sync.in_worker import InWorker

        super().__init__(path)
        self.sampler = build_sampler(str(path), _rollout_config(), "cpu")
        self.transport = InWorker(self.sampler, server=ActorHandle(self))  # the leader tells its server the version
        self.served = 0

    def set_global_steps(self, version):  # the rollout server's method, as the leader calls it
        self.served = version

    def send(self, stream, version):
        return asyncio.run(self.transport.send(stream, version))


class TrainerMemoryRoute(ServerRoute):
    name = "trainer_memory"

    def __init__(self, path) -> None:
        import ray

        from rl_tpu.shared_weights import SharedWeights
        from verl_backend.weight_sync.trainer_memory import TrainerMemory

        super().__init__(path)
        published = SharedWeights(self.trainer, name="test_sync_verify_transports")  # the engine's hand-over
        self._closers.append(published.close)
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        assert self.server.attach_trainer_weights(published.handle(node_id=node)) is None
        self.transport = TrainerMemory(self.handle, published)


class SharedMemoryRoute(ServerRoute):
    name = "shared_memory"

    def __init__(self, path) -> None:
        from rl_tpu.shared_weights import SharedWeightsWriter
        from verl_backend.weight_sync.shared_memory import SharedMemory

        super().__init__(path)
        assert self.server.shared is not None, "a CPU rollout server keeps its weights in shared memory"
        writer = SharedWeightsWriter(self.server.shared_weights_handle())
        self._closers.append(writer.close)
        self.transport = SharedMemory(self.handle, writer)


class ObjectStoreRoute(ServerRoute):
    name = "object_store"

    def __init__(self, path) -> None:
        from verl_backend.weight_sync.object_store import ObjectStore

        super().__init__(path)
        self.transport = ObjectStore(self.handle, bucket_bytes=1 << 20)  # several buckets; the embedding its own


class PoolRoute(Route):
    """VeRL's ``gloo`` checkpoint engine, the source (trainer rank 0) and one rollout worker as two threads; the
    worker's second hop loads into its in-worker sampler (:class:`InWorker`), where the check runs.

    As in a job: the trainer's module is registered in the source's process, the engine takes the proof itself
    (:func:`~verl_backend.weight_sync.verify.take_proof`, fingerprints at every candidate dtype: it does not know the
    rollout pool's), the fault strikes between its fingerprinting and the transport, the proof crosses the gloo group
    after the last bucket, the worker checks its live weights against it as the native adapter does and reports its
    verdict (:meth:`ReceivedWeights.report_verdict`), and the source's metrics carry it (``weight_sync/verified``)."""

    def __init__(self, path, shared: bool) -> None:
        from verl_backend.rollout.sampling import build_sampler
        from verl_backend.weight_sync.in_worker import InWorker

        super().__init__(path)
        self.shared = shared
        self.sampler = build_sampler(str(path), _rollout_config(), "cpu")
        self.second_hop = InWorker(self.sampler)
        self.served = 0
        self.metrics: dict = {}  # the source's metrics of the last sync
        self.result = None  # the worker's check of the last sync (VerifyResult)

    def sync(self, version: int, fault=None):
        sv.register_trainer_module(self.trainer)
        try:
            report, received = self.send(self.trainer.state_dict().items(), version, fault)
        finally:
            sv.register_trainer_module(None)
        return report, received.proof

    def send(self, stream, version, fault=None):
        from verl_backend.weight_sync.gloo_engine import GlooCheckpointEngine

        source = GlooCheckpointEngine(bucket_size=1 << 20, is_master=True, timeout_s=60)
        choose = source._transport

        def faulty(can_map):  # the fault strikes after the engine fingerprinted the stream, on the way out
            transport = choose(can_map)
            send = transport.send
            transport.send = lambda weights, v: send(fault(weights) if fault else weights, v)
            return transport

        source._transport = faulty
        worker = GlooCheckpointEngine(bucket_size=1 << 20, timeout_s=60)
        master = source.prepare()
        assert worker.prepare() == {}
        if not self.shared:  # as a worker on another host sees the source's file: the whole group broadcasts
            master = {**master, "shm": master["shm"] and {**master["shm"], "boot_id": "another-host"}}
        actor, rollout = GlooCheckpointEngine.build_topology(1, 1, [master, {}])
        out: dict = {}

        def run_source():
            try:
                source.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master"][0])
                out["metrics"] = asyncio.run(source.send_weights(stream, global_steps=version))
            except BaseException as exc:  # noqa: BLE001 -- re-raised in the test's thread
                out["error"] = exc

        thread = threading.Thread(target=run_source, daemon=True)
        thread.start()
        try:
            worker.init_process_group(rollout["rank"][0], rollout["world_size"][0], rollout["master"][0])
            received = worker.receive_weights(global_steps=version)
            received.promise_verdict()
            try:  # the adapter's update_weights: the one send of the second hop, the check, the stream closed
                asyncio.run(self.second_hop.send(received, version))
                self.served = version
                self.result = None
                if received.proof is not None:  # (rl_tpu.verify_weight_sync=false: none sent)
                    assert received.proof.version == version
                    self.result = sv.check_sync(self.sampler, received.proof, self.replica, raise_on_mismatch=False)
                    received.report_verdict(
                        "verified" if self.result.ok else "failed", self.result.max_abs_diff, self.result.seconds
                    )
            finally:
                received.close()
        finally:
            thread.join(timeout=60)
            source.finalize()
            worker.finalize()
        assert not thread.is_alive(), "the source is still sending"
        if "error" in out:
            raise out["error"]
        self.metrics = out["metrics"]
        assert self.metrics["weight_sync/pool_shared_memory"] == float(self.shared)
        if self.result is not None:  # the worker's verdict reached the source
            assert self.metrics["weight_sync/verified"] == float(self.result.ok)
            assert self.metrics["weight_sync/verify_max_abs_diff"] == pytest.approx(self.result.max_abs_diff)
        return source.last_report, received


class PoolBroadcastRoute(PoolRoute):
    name = "pool_broadcast"

    def __init__(self, path) -> None:
        super().__init__(path, shared=False)


class PoolSharedMemoryRoute(PoolRoute):
    name = "pool_shared_memory"

    def __init__(self, path) -> None:
        super().__init__(path, shared=True)


MAKERS = {
    cls.name: cls
    for cls in (
        InWorkerRoute,
        TrainerMemoryRoute,
        SharedMemoryRoute,
        ObjectStoreRoute,
        PoolBroadcastRoute,
        PoolSharedMemoryRoute,
    )
}


@pytest.fixture(params=ROUTES)
def route(request, tiny_model_dir, job_settings):
    if request.param == "object_store":
        request.getfixturevalue("local_ray")
    made = MAKERS[request.param](tiny_model_dir)
    try:
        yield made
    finally:
        made.close()


def _faithful_first(route: Route) -> None:
    """Version 1, faithful and verified (the packed copies exist afterwards: the probe ran through them)."""
    route.step(1)
    report, proof = route.sync(1)
    assert route.verify(proof)["weight_sync/verified"] == 1.0


def _refused(route: Route, proof, version: int) -> str:
    with pytest.raises(sv.WeightSyncMismatch) as err:
        route.verify(proof)
    line = str(err.value)
    assert "\n" not in line and f"rollout replica {route.replica}, weight version {version}: " in line, line
    return line


def _silent_success(route: Route, report, version: int, wrong: str | None = None) -> None:
    """What the run sees of a faulty sync without the check: the transport's report, the new version served; and
    the fault is real: the rollout's tensor ``wrong`` is not the trainer's."""
    assert isinstance(report, SyncReport) and report.transport == route.name and report.version == version
    assert not report.verified and route.served == version  # (pool: the worker's verdict, a failure, reached it)
    if wrong is not None:
        assert not torch.equal(route.sampler._tensors[wrong].detach(), route.trainer.state_dict()[wrong]), wrong


# ------------------------------------------------------------------------------------------------------- tests
def test_faithful_syncs_verify(route) -> None:
    for version in (1, 2):
        route.step(version)
        report, proof = route.sync(version)
        assert report.transport == route.name and report.version == version and route.served == version
        assert len(proof.fingerprints) == len(route.trainer.state_dict())
        metrics = route.verify(proof)
        assert metrics["weight_sync/verified"] == 1.0, metrics
        assert metrics["weight_sync/verify_max_abs_diff"] <= FAITHFUL_MAX_DIFF, metrics
        assert metrics["weight_sync/verify_probe_score"] < 0.1, metrics
        diff, score = metrics["weight_sync/verify_max_abs_diff"], metrics["weight_sync/verify_probe_score"]
        print(f"[{route.name}] v{version} faithful: verify_max_abs_diff {diff:.3g}, score {score:.3g}")
    if route.name == "trainer_memory":  # the optimizer step was the sync: nothing copied
        assert report.copied_bytes == 0 and report.bytes > 0
    if isinstance(route, PoolRoute):  # the proof crossed the group, the worker's verdict came back to the source
        assert report.verified and route.metrics["weight_sync/verified"] == 1.0, route.metrics
        assert route.metrics["weight_sync/verify_trainer_seconds"] > 0


def test_a_tensor_lost_on_the_way_is_named(route) -> None:
    _faithful_first(route)
    rebind = (VICTIM,) if route.name == "trainer_memory" else ()  # in place it would be there without a copy
    route.step(2, rebind)
    report, proof = route.sync(2, lambda s: dropped(s, VICTIM))
    _silent_success(route, report, 2, wrong=VICTIM)
    assert VICTIM in proof.fingerprints
    line = _refused(route, proof, 2)
    assert f"first differing tensor {VICTIM};" in line, line  # the only one
    # the probe alone does not see a 1e-5 step of one norm weight: the fingerprint is what catches it
    result = sv.check_sync(route.sampler, proof, route.replica, raise_on_mismatch=False)
    assert result.probe_ok and result.differing == [VICTIM], result
    print(
        f"[{route.name}] lost {VICTIM}: probe max diff {result.max_abs_diff:.3g} (score {result.score:.3g}, "
        f"passes), caught by its fingerprint: {line}"
    )
    report, proof = route.sync(3)  # the next faithful sync repairs it
    assert route.verify(proof)["weight_sync/verified"] == 1.0


def test_nothing_delivered_after_an_update_is_caught(route) -> None:
    _faithful_first(route)
    route.step(2, ("*",) if route.name == "trainer_memory" else ())  # in place it would be the sync itself
    report, proof = route.sync(2, nothing)
    _silent_success(route, report, 2, wrong=FIRST)
    assert report.bytes == 0  # and the run would log weight_sync/bytes 0, not stop
    line = _refused(route, proof, 2)
    assert f"first differing tensor {FIRST} (+" in line and "failed)" in line, line  # the probe fails too
    result = sv.check_sync(route.sampler, proof, route.replica, raise_on_mismatch=False)
    assert not result.probe_ok and result.differing[0] == FIRST
    print(
        f"[{route.name}] nothing delivered: probe max diff {result.max_abs_diff:.3g} (score {result.score:.3g}), "
        f"{len(result.differing)} tensors differ"
    )


def test_stale_weights_sent_are_caught(route) -> None:
    _faithful_first(route)
    old = {name: t.detach().clone() for name, t in route.trainer.state_dict().items()}  # version 1's weights
    route.step(2, ("*",) if route.name == "trainer_memory" else ())  # in place it would be the sync itself
    report, proof = route.sync(2, stale(old))
    _silent_success(route, report, 2, wrong=FIRST)
    assert report.bytes > 0  # every byte arrived: only its version is wrong
    line = _refused(route, proof, 2)
    assert f"first differing tensor {FIRST} (+" in line and "failed)" in line, line
    result = sv.check_sync(route.sampler, proof, route.replica, raise_on_mismatch=False)
    assert not result.probe_ok and len(result.differing) == len(old), result.differing[:3]
    print(
        f"[{route.name}] stale weights sent: probe max diff {result.max_abs_diff:.3g} (score {result.score:.3g}), "
        f"{len(result.differing)} tensors differ"
    )


@needs_packed
@pytest.mark.parametrize("route", STALE_ROUTES, indirect=True)
def test_packed_copies_left_stale_are_caught(route, monkeypatch) -> None:
    _faithful_first(route)
    packed = route.sampler.packed
    assert packed is not None and packed._packed is not None  # the probe ran through them
    monkeypatch.setattr(route.sampler, "weights_changed", lambda: None)  # the server forgot to drop them
    if route.name in ("in_worker", "object_store"):  # loaded in process: the version counters would see it
        key = packed._key
        monkeypatch.setattr(packed, "_weights_key", lambda: key)
    route.step(2)
    report, proof = route.sync(2)
    _silent_success(route, report, 2)
    for name, tensor in route.trainer.state_dict().items():  # the sources are the trainer's: only the copies are not
        assert torch.equal(route.sampler._tensors[name].detach(), tensor), name
    line = _refused(route, proof, 2)
    assert f"first differing tensor {PACKED}" in line and "failed)" in line, line
    result = sv.check_sync(route.sampler, proof, route.replica, raise_on_mismatch=False)
    assert not result.probe_ok and all("packed copy" in n for n in result.differing)
    print(
        f"[{route.name}] stale packed copies: probe max diff {result.max_abs_diff:.3g} (score {result.score:.3g}), "
        f"{len(result.differing)} copies named"
    )
    monkeypatch.undo()  # announced, the copies are rebuilt and the same sync verifies
    route.sampler.weights_changed()
    assert route.verify(proof)["weight_sync/verified"] == 1.0


@pytest.mark.parametrize("route", ["pool_shared_memory"], indirect=True)
def test_verification_off_takes_no_proof_and_reports_unverified(route, job_settings) -> None:
    """``rl_tpu.verify_weight_sync=false`` (the job's settings record, as a worker gets it): the engine takes no proof,
    none crosses the group, the worker's verdict is ``unverified`` and the metrics say so, with no verify figures."""
    job_settings(verify_weight_sync=False)
    route.step(1)
    report, proof = route.sync(1)
    assert proof is None and not report.verified
    assert route.metrics["weight_sync/verified"] == 0.0
    assert not any(k.startswith("weight_sync/verify_") for k in route.metrics), route.metrics
