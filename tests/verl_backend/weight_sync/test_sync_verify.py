"""Weight-sync verification (verl_backend.weight_sync.verify) on a tiny random Llama: a correct sync passes, and the
negative controls are each caught at the first sync after the weights changed, with the one line naming the tensor:

* one tensor dropped (the smallest, a norm weight, moved by a default-learning-rate step ~1e-5): the fingerprints
  (the probe cannot: below the float32 parity bound, asserted);
* stale weights (the previous version) and a sync that delivers nothing: the probe and the fingerprints;
* packed copies not rebuilt (sources written where the version counters do not see it, no ``weights_changed``): the
  probe; the sources' fingerprints match, the packed-copy check names the layer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import tiny_config
from transformers import LlamaForCausalLM

from rl_tpu.sampler import Sampler
from rl_tpu.sampler.packed import packed_linear_supported
from verl_backend.weight_sync import verify as sv

torch.set_num_threads(1)

VOCAB, PAD, EOS = 97, 0, 1
LR = 1e-5  # half the default job's learning rate (2e-5): an Adam step moves each element by about this much


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(
        "llama",
        vocab_size=VOCAB,
        attn_implementation="sdpa",
        max_position_embeddings=256,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def adam_like_step(model: torch.nn.Module, seed: int) -> None:
    """Every element moved by +-LR (Adam's step size at the start of training)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(LR * torch.sign(torch.randn(p.shape, generator=g)))


class Job:
    """A trainer module, a rollout sampler on its own copy (the CPU fast paths on), and the job's probe."""

    def __init__(self, rollout_dtype: torch.dtype = torch.float32) -> None:
        self.trainer = tiny_llama()
        self.sampler = Sampler(
            copy.deepcopy(self.trainer).to(rollout_dtype),
            pad_token_id=PAD,
            eos_token_ids=[EOS],
            prompt_buckets=(16, 32),
            gen_buckets=(16, 32),
        )
        self.dtype = rollout_dtype
        self.probe = sv.make_probe(VOCAB, seed=7, avoid=self.sampler.eos_token_ids)
        self.version = 0

    def step(self) -> None:
        self.version += 1
        adam_like_step(self.trainer, self.version)

    def send(self, named=None) -> dict[str, float]:
        """Sync ``named`` (default: the trainer's whole state dict) into the sampler; the trainer's fingerprints of
        what it meant to send."""
        fps: dict[str, float] = {}
        full = list(sv.fingerprint_stream(self.trainer.state_dict().items(), fps, self.dtype))
        self.sampler.load_state_dict(full if named is None else named)
        return fps

    def verify(self, fps, **kw) -> sv.VerifyResult:
        return sv.verify_sync(
            self.sampler,
            self.probe,
            sv.trainer_probe(self.trainer, self.probe),
            fps,
            replica=3,
            version=self.version,
            **kw,
        )


def test_probe_shape_and_the_sampler_path_equals_the_model() -> None:
    job = Job()
    got = sv.rollout_probe(job.sampler, job.probe)
    assert tuple(got.shape) == job.probe.shape == (2, 4, 65)
    assert job.sampler.packed is None or job.sampler.packed.nbytes > 0  # the probe ran on the packed weights
    assert float((got - sv.trainer_probe(job.trainer, job.probe)).abs().max()) < 1e-5


def test_a_correct_sync_passes_at_every_version() -> None:
    job = Job()
    for _ in range(3):
        job.step()
        result = job.verify(job.send())
        assert result.ok and result.max_abs_diff <= 1e-5 and result.first_tensor is None and result.score < 0.1
        assert result.as_metrics()["weight_sync/verified"] == 1.0


def test_a_dropped_tensor_is_named_by_its_fingerprint() -> None:
    job = Job()
    job.verify(job.send())
    job.step()
    names = list(job.trainer.state_dict())
    smallest = min(names, key=lambda n: job.trainer.state_dict()[n].numel())  # a norm weight, 64 elements
    assert "norm" in smallest
    fps = job.send([(n, t) for n, t in job.trainer.state_dict().items() if n != smallest])
    result = job.verify(fps, raise_on_mismatch=False)
    assert not result.ok and result.differing == [smallest]
    # the probe alone does not see a 1e-5 step of one norm weight: the fingerprint is what catches it
    assert result.probe_ok and result.score <= 1.0
    with pytest.raises(sv.WeightSyncMismatch) as err:
        job.verify(fps)
    line = str(err.value)
    assert "\n" not in line and "replica 3" in line and "version 1" in line and smallest in line


def test_stale_weights_are_caught() -> None:
    job = Job()
    job.step()
    old = {n: t.clone() for n, t in job.trainer.state_dict().items()}
    job.verify(job.send())
    job.step()
    fps = {}
    list(sv.fingerprint_stream(job.trainer.state_dict().items(), fps))  # what the trainer meant to send
    job.sampler.load_state_dict(old.items())  # ... but the previous version arrived
    result = job.verify(fps, raise_on_mismatch=False)
    assert not result.ok and not result.probe_ok  # the probe catches it
    assert result.first_tensor == "model.embed_tokens.weight" and len(result.differing) == len(old)
    assert "weight version 2" in result.message and "model.embed_tokens.weight" in result.message


def test_a_sync_that_delivers_nothing_is_caught() -> None:
    job = Job()
    job.verify(job.send())
    job.step()
    fps = {}
    list(sv.fingerprint_stream(job.trainer.state_dict().items(), fps))
    job.sampler.load_state_dict([])  # reported success, moved nothing
    result = job.verify(fps, raise_on_mismatch=False)
    assert not result.ok and not result.probe_ok
    assert result.first_tensor == "model.embed_tokens.weight"
    assert result.as_metrics()["weight_sync/verified"] == 0.0


@pytest.mark.skipif(not packed_linear_supported(), reason="packed weights need torch with oneDNN")
def test_packed_copies_not_rebuilt_are_caught_and_named() -> None:
    job = Job()
    assert job.sampler.packed is not None
    job.verify(job.send())  # packs the copies
    job.step()
    fps = {}
    list(sv.fingerprint_stream(job.trainer.state_dict().items(), fps))
    own = job.sampler._tensors
    for name, t in job.trainer.state_dict().items():  # written as another process would: no version bump
        own[name].detach().numpy()[...] = t.numpy()
    # ... and the server forgot Sampler.weights_changed()
    result = job.verify(fps, raise_on_mismatch=False)
    assert not result.ok and not result.probe_ok  # the probe catches it
    assert result.first_tensor == "model.layers.0.self_attn.q_proj.weight (packed copy)", result.differing
    # the same write announced: the copies are rebuilt and the sync verifies
    job.sampler.weights_changed()
    assert job.verify(fps).ok


@pytest.mark.skipif(not packed_linear_supported(), reason="packed weights need torch with oneDNN")
def test_the_packing_is_timed_apart_and_the_next_batch_reuses_it() -> None:
    """The check's own cost excludes packing the new weights: the check packs them first (timed as
    ``pack_seconds``), and the batch after it finds the copies current instead of packing again."""
    job = Job()
    job.step()
    result = job.verify(job.send())
    assert result.ok and result.pack_seconds > 0 and result.seconds > 0
    assert result.as_metrics()["weight_sync/verify_pack_seconds"] == result.pack_seconds
    packed = job.sampler.packed
    assert not packed.stale() and not packed.prepare()  # the next generate packs nothing
    job.step()
    job.send()  # load_state_dict: weights_changed() drops the copies
    assert packed.stale() and packed.prepare() and not packed.stale()


def test_bfloat16_rollout_against_a_float32_trainer() -> None:
    job = Job(torch.bfloat16)
    job.step()
    result = job.verify(job.send())
    assert result.ok and sv.probe_bound(torch.float32, torch.bfloat16)[0] == "mean"
    for _ in range(200):  # enough steps that the bfloat16 copy moves
        job.step()
    fps = {}
    list(sv.fingerprint_stream(job.trainer.state_dict().items(), fps, torch.bfloat16))
    result = job.verify(fps, raise_on_mismatch=False)  # nothing delivered
    assert not result.ok and result.first_tensor is not None


def test_the_proof_travels_and_verifies_the_sync_it_came_with() -> None:
    """The trainer's proof (probe, log-probs, fingerprints) pickled as Ray would carry it; the stream it wraps is what
    is sent. A correct sync verifies; the next version's proof against the old weights does not."""
    import pickle

    job = Job()
    job.step()
    stream, proof = sv.trainer_proof(job.trainer, job.trainer.state_dict().items(), job.version, "float32")
    job.sampler.load_state_dict(stream)
    proof = pickle.loads(pickle.dumps(proof))
    assert proof.dtype == "float32" and len(proof.fingerprints) == len(job.trainer.state_dict())
    assert sv.check_sync(job.sampler, proof, replica=0).ok
    job.step()
    stream, proof = sv.trainer_proof(job.trainer, job.trainer.state_dict().items(), job.version, "float32")
    list(stream)  # sent, and lost on the way
    with pytest.raises(sv.WeightSyncMismatch, match="rollout replica 0, weight version 2: first differing tensor"):
        sv.check_sync(job.sampler, proof, replica=0)


@pytest.mark.skipif(not packed_linear_supported(), reason="packed weights need torch with oneDNN")
def test_compiled_steps_with_packed_copies_left_stale_are_caught() -> None:
    """The compiled sampler (its packed copies outside the graphs, rl_tpu.sampler.compiled_packed): the probe runs
    through the graphs; copies left stale by an unannounced write are caught."""
    job = Job()
    job.sampler = Sampler(
        copy.deepcopy(job.trainer),
        pad_token_id=PAD,
        eos_token_ids=[EOS],
        prompt_buckets=(16,),
        gen_buckets=(16,),
        compile=True,
        compile_backend="aot_eager",
    )
    assert job.sampler.compiled.packs is not None
    assert job.verify(job.send()).ok
    job.step()
    fps = {}
    list(sv.fingerprint_stream(job.trainer.state_dict().items(), fps))
    own = job.sampler._tensors
    for name, t in job.trainer.state_dict().items():  # no version bump, no weights_changed()
        own[name].detach().numpy()[...] = t.numpy()
    result = job.verify(fps, raise_on_mismatch=False)
    assert not result.ok and not result.probe_ok
    assert "compiled steps' packed copies" in result.message or "(compiled packed copy)" in result.message
    job.sampler.weights_changed()
    assert job.verify(fps).ok


def test_engine_registers_its_module_and_the_adapter_takes_a_proof() -> None:
    """The engine registers its module; the adapter scores the probe on it at each sync and fingerprints what it
    sends: verified. Withdrawn (no trainer module in this process): no proof, the sync goes unverified."""
    job = Job()
    sv.register_trainer_module(job.trainer)
    try:
        job.step()
        stream, proof = sv.take_proof(job.trainer.state_dict().items(), job.version, "float32")
        job.sampler.load_state_dict(stream)
        assert proof.version == 1 and sv.check_sync(job.sampler, proof, replica=0).ok
    finally:
        sv.register_trainer_module(None)
    weights = job.trainer.state_dict().items()
    assert sv.take_proof(weights, 2, "float32") == (weights, None)


def test_the_server_verifies_the_in_place_route_and_stops_on_stale_packed_copies(tiny_model_dir, job_settings):
    """The default CPU job's route (the server computes on the trainer's shared-memory parameters): the server's
    ``verify_sync`` passes a sync whose packed copies were dropped (``end_weight_update``), and stops, in one line
    naming the replica, the version and the layer, one whose copies were left stale."""
    pytest.importorskip("verl")
    import asyncio
    from types import SimpleNamespace

    import ray
    from transformers import AutoModelForCausalLM

    from rl_tpu.shared_weights import SharedWeights
    from verl_backend.rollout.server import NativeRolloutServer

    cfg = SimpleNamespace(prompt_length=32, response_length=8, max_num_seqs=8, dtype="float32")
    server = NativeRolloutServer(
        rollout_config=cfg, model_path=str(tiny_model_dir), batch_window_s=0.01, replica_rank=2
    )
    trainer = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    published = SharedWeights(trainer, name="test_sync_verify_trainer")
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    assert server.attach_trainer_weights(published.handle(node_id=node)) is None

    async def sync(version: int, announce: bool) -> dict:
        await server.generate(f"warm{version}", [1, 5, 9, 13], {"temperature": 0.0, "max_tokens": 4})  # packs
        adam_like_step(trainer, version)  # the optimizer, in the trainer's process: no version bump here
        stream, proof = sv.trainer_proof(trainer, trainer.state_dict().items(), version, "float32")
        await server.begin_weight_update()
        published.publish(stream)
        if announce:
            await server.end_weight_update([], global_steps=version)
        else:  # a server that forgot Sampler.weights_changed()
            server.set_global_steps(version)
            server._updating = False
        return await server.verify_sync(proof)

    async def scenario():  # one event loop: the server's batch loop lives on it
        assert (await sync(1, announce=True))["weight_sync/verified"] == 1.0
        with pytest.raises(sv.WeightSyncMismatch) as caught:
            await sync(2, announce=False)
        return caught

    try:
        err = asyncio.run(scenario())
        line = str(err.value)
        assert "\n" not in line and "rollout replica 2, weight version 2" in line and "(packed copy)" in line
    finally:
        published.close()


def test_a_mismatch_raised_in_a_ray_worker_is_one_line_for_the_driver() -> None:
    """``verl`` prints a :class:`WeightSyncMismatch` found anywhere in the Ray error chain as its one line (exit 1),
    not Ray's wrapped traceback; another error is not taken for it (negative control)."""
    from ray.exceptions import RayTaskError

    from verl_backend.driver.cli import _user_error
    from verl_backend.weight_sync.verify import WeightSyncMismatch

    line = "weight sync not verified: rollout replica 0, weight version 2: first differing tensor model.norm.weight"
    wrapped = RayTaskError("update_weights", "Traceback ...", WeightSyncMismatch(line)).as_instanceof_cause()
    outer = RuntimeError("the trainer's step failed")
    outer.__cause__ = wrapped
    found = _user_error(outer, (WeightSyncMismatch,))
    assert type(found) is WeightSyncMismatch and str(found) == line
    other = RuntimeError("the trainer's step failed")
    other.__cause__ = RayTaskError("update_weights", "Traceback ...", ValueError("x")).as_instanceof_cause()
    assert _user_error(other, (WeightSyncMismatch,)) is None
