"""The native rollout server's weight sync: buckets loaded as they arrive, generation held until the last one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")


@pytest.fixture()
def server(tiny_model_dir, job_settings):
    from verl_backend.rollout.server import NativeRolloutServer

    cfg = SimpleNamespace(prompt_length=32, response_length=8, max_num_seqs=8, dtype="float32")
    return NativeRolloutServer(rollout_config=cfg, model_path=str(tiny_model_dir), batch_window_s=0.01)


def _buckets(state: dict[str, torch.Tensor], n: int):
    from rl_tpu.collectives import pack_bucket

    names = sorted(state)
    for i in range(n):
        part = [(k, state[k]) for k in names[i::n]]
        flat, meta = pack_bucket(part)
        yield flat.numpy(), meta


async def held_in_queue(server, pending, request_id: str, passes: int = 20) -> bool:
    """Whether generation is held: request ``request_id`` reaches the server's queue (polled to a 60 s deadline) and
    is still there, no batch started and ``pending`` not done, after ``passes`` of the batch loop's window. A batch
    loop that does not hold takes a queued request within one window, on any machine: its window and this wait
    are timers of the same event loop, which fire in deadline order however loaded the host is (it is not the
    sampler's speed that is timed, as a fixed sleep before ``not pending.done()`` would)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60

    def queued() -> bool:
        return any(r.request_id == request_id for r in server._queue)

    while not queued():
        assert not pending.done(), f"request {request_id!r} was answered without waiting in the queue"
        assert loop.time() < deadline, f"request {request_id!r} never reached the server's queue"
        await asyncio.sleep(0.001)
    batches = server.stats["batches"]
    for _ in range(passes):
        await asyncio.sleep(server.batch_window_s)
        if not queued() or server._batch_running or server.stats["batches"] != batches or pending.done():
            return False
    return True


def test_buckets_load_in_any_order_and_generation_waits_for_the_last(server):
    model = server.sampler.model
    # one entry per parameter (tied embeddings / LM head counted once), as the trainer sends them
    target = {k: torch.randn_like(v) * 0.02 for k, v in model.named_parameters()}
    buckets = list(_buckets(target, 3))
    prompt = [1, 5, 9, 13]
    greedy = {"temperature": 0.0, "max_tokens": 4, "logprobs": True}

    async def scenario():
        before = await server.generate("a", prompt, greedy)
        # first two buckets (out of order): a sync is in progress, a new request must wait for the last bucket
        await server.update_weights_bucket(*buckets[2], last=False, global_steps=7, total=3)
        await server.update_weights_bucket(*buckets[0], last=False, global_steps=7, total=3)
        pending = asyncio.ensure_future(server.generate("b", prompt, greedy))
        held = await held_in_queue(server, pending, "b")
        await server.update_weights_bucket(*buckets[1], last=True, global_steps=7, total=3)
        after = await asyncio.wait_for(pending, timeout=60)
        return before, held, after

    before, held, after = asyncio.run(scenario())
    assert held, "generation ran while a weight sync was half done"
    assert server.global_steps == 7 and after.extra_fields["global_steps"] == 7
    params = dict(model.named_parameters())
    for name, want in target.items():
        torch.testing.assert_close(params[name].detach(), want)
    # the new weights are what generated "b": its log-probs are the new model's
    ids = torch.tensor([prompt + after.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    got = logp.gather(-1, torch.tensor(after.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(got, torch.tensor(after.log_probs), rtol=1e-4, atol=1e-4)
    assert before.extra_fields["global_steps"] == 0


# ------------------------------------------------------------------ shared-memory weight sync (same host, CPU)
def _shared_file_bytes(server) -> int:
    import os

    return os.fstat(server.shared.fd).st_blocks * 512  # pages the OS holds for the weights' file


def test_shared_memory_sync_writes_weights_in_place_and_holds_generation(server):
    from rl_tpu.shared_weights import SharedWeightsWriter

    model = server.sampler.model
    assert server.shared is not None, "a CPU rollout server keeps its weights in shared memory"
    assert _shared_file_bytes(server) >= server.shared.nbytes - 4096
    writer = SharedWeightsWriter(server.shared_weights_handle())  # this process stands in for the trainer
    target = {k: torch.randn_like(v) * 0.02 for k, v in model.named_parameters()}
    prompt = [1, 5, 9, 13]
    greedy = {"temperature": 0.0, "max_tokens": 4, "logprobs": True}

    async def scenario():
        before = await server.generate("a", prompt, greedy)
        await server.begin_weight_update()
        pending = asyncio.ensure_future(server.generate("b", prompt, greedy))
        held = await held_in_queue(server, pending, "b")
        written, nbytes = writer.write(target.items())
        await server.end_weight_update(written, global_steps=3)
        return before, held, await asyncio.wait_for(pending, timeout=60), nbytes

    before, held, after, nbytes = asyncio.run(scenario())
    assert held, "generation ran during a shared-memory weight sync"
    assert nbytes == sum(s.nbytes for s in server.shared.slots)  # each distinct tensor once (tied: once)
    params = dict(model.named_parameters())
    for name, want in target.items():
        torch.testing.assert_close(params[name].detach(), want)  # the server's own parameters, nothing copied
    assert after.extra_fields["global_steps"] == 3 and before.extra_fields["global_steps"] == 0
    ids = torch.tensor([prompt + after.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    got = logp.gather(-1, torch.tensor(after.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(got, torch.tensor(after.log_probs), rtol=1e-4, atol=1e-4)
    writer.close()


def test_sleep_releases_shared_weights_and_a_partial_sync_is_refused(server):
    from rl_tpu.shared_weights import SharedWeightsError, SharedWeightsWriter

    model = server.sampler.model
    writer = SharedWeightsWriter(server.shared_weights_handle())
    server.shared_weights_attached()
    target = {k: torch.randn_like(v) * 0.02 for k, v in model.named_parameters()}
    prompt, greedy = [1, 5, 9, 13], {"temperature": 0.0, "max_tokens": 4, "logprobs": True}

    async def scenario():
        await server.generate("warm", prompt, greedy)
        packed = server.sampler.packed.nbytes  # the sampler's oneDNN-packed weight copies, built for that batch
        await server.sleep()
        assert packed > 0 and server.sampler.packed.nbytes == 0, "sleep() must drop the packed weight copies"
        released = _shared_file_bytes(server)
        with pytest.raises(RuntimeError, match="asleep: sleep\\(\\) released its weights"):
            await server.generate("a", prompt, greedy)
        await server.begin_weight_update()
        half = list(target.items())[: len(target) // 2]
        written, _ = writer.write(half)
        with pytest.raises(SharedWeightsError, match=r"wrote \d+ of \d+ tensors.*send every tensor"):
            await server.end_weight_update(written, global_steps=1)
        await server.begin_weight_update()
        written, _ = writer.write(target.items())
        await server.end_weight_update(written, global_steps=2)
        return released, await server.generate("b", prompt, greedy)

    released, out = asyncio.run(scenario())
    assert released == 0, "sleep() must give the weights' pages back to the OS"
    assert _shared_file_bytes(server) >= server.shared.nbytes - 4096
    assert out.extra_fields["global_steps"] == 2 and len(out.token_ids) >= 1
    for name, want in target.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), want)
    writer.close()


def test_writer_refuses_unknown_names_and_shapes(server):
    from rl_tpu.shared_weights import SharedWeightsError, SharedWeightsWriter

    writer = SharedWeightsWriter(server.shared_weights_handle())
    name, p = next(iter(server.sampler.model.named_parameters()))
    with pytest.raises(SharedWeightsError, match="no tensor named 'nope'"):
        writer.write([("nope", p.detach())])
    with pytest.raises(SharedWeightsError, match=f"{name!r} has shape"):
        writer.write([(name, torch.zeros(3))])
    writer.close()


def _this_node() -> str | None:
    """This process's Ray node id, as the trainer puts it in its handle (``None`` when Ray is not initialised here:
    an earlier test in the same session may have started it)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def test_server_computes_on_the_trainers_weights_with_no_copy(server, tiny_model_dir):
    """The default CPU job: the trainer's parameters live in shared memory and the server computes on them; what the
    optimizer writes in place is what the next batch samples from."""
    from transformers import AutoModelForCausalLM

    from rl_tpu.shared_weights import SharedWeights

    trainer = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    published = SharedWeights(trainer, name="test_trainer")
    own_file = server.shared
    assert server.attach_trainer_weights(published.handle(node_id=_this_node())) is None
    assert server.shared is None and own_file.fd == -1, "the server's own weight file is closed once attached"
    prompt, greedy = [1, 5, 9, 13], {"temperature": 0.0, "max_tokens": 4, "logprobs": True}

    async def scenario():
        await server.generate("warm", prompt, greedy)  # the sampler's packed weight copies now exist
        assert server.sampler.packed.nbytes > 0
        with torch.no_grad():  # "an optimizer step" in the trainer process: the server's tensors see no version bump
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        await server.begin_weight_update()
        kept, copied = published.publish(trainer.state_dict().items())
        await server.end_weight_update([], global_steps=5)
        await server.sleep()  # nothing is given back: the pages are the trainer's
        return kept, copied, await server.generate("a", prompt, greedy)

    kept, copied, out = asyncio.run(scenario())
    assert copied == 0 and kept == sum(s.nbytes for s in published.slots)
    assert out.extra_fields["global_steps"] == 5
    ids = torch.tensor([prompt + out.token_ids])  # the log-probs are the trainer model's, as it is now
    with torch.no_grad():
        logp = torch.log_softmax(trainer(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    got = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(got, torch.tensor(out.log_probs), rtol=1e-5, atol=1e-5)
    for (name, mine), theirs in zip(server.sampler.model.state_dict().items(), trainer.state_dict().values()):
        assert mine.data_ptr() != theirs.data_ptr() and torch.equal(mine, theirs), name  # same pages, two mappings
    flat, meta = next(_buckets(dict(trainer.named_parameters()), 1))
    with pytest.raises(RuntimeError, match="computes on the trainer's weights"):  # read-only: never written
        asyncio.run(server.update_weights_bucket(flat, meta, last=True))


def test_attach_refuses_a_different_model_and_keeps_its_own_weights(server):
    from families import tiny_config
    from transformers import LlamaForCausalLM

    from rl_tpu.shared_weights import SharedWeights

    other = LlamaForCausalLM(
        tiny_config(
            "llama",
            vocab_size=96,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=False,
        )
    )
    published = SharedWeights(other, name="test_other")
    reason = server.attach_trainer_weights(published.handle(node_id=_this_node()))
    assert reason is not None and ("has shape" in reason or "no tensor named" in reason), reason
    assert server.shared is not None and server.trainer_weights is None
    out = asyncio.run(server.generate("a", [1, 2, 3], {"temperature": 0.0, "max_tokens": 2}))
    assert len(out.token_ids) >= 1


# ------------------------------------------------------------------ sampling requests: honoured or refused
def test_sampling_request_keys_are_honoured(server):
    """VeRL's request with repetition_penalty, min_tokens and stop tokens: the server's tokens are HF generate's
    with the same logits processors; log-probs come back only when the request asks for them."""
    model = server.sampler.model
    prompt, stops = [1, 5, 9, 13, 5, 9], list(range(0, 20000))  # ~40% of the vocabulary ends a completion
    request = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.5,
        "min_tokens": 5,
        "stop_token_ids": stops,
        "max_tokens": 8,
        "logprobs": True,
    }

    async def scenario():
        return (
            await server.generate("a", prompt, request),
            await server.generate("b", prompt, {**request, "logprobs": False}),
            await server.generate("c", prompt, {"temperature": 0.0, "stop_token_ids": stops, "max_tokens": 8}),
        )

    out, no_logp, plain = asyncio.run(scenario())
    eos = [server.sampler.eos_token_ids[0], *stops]
    hf = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=8,
        do_sample=False,
        repetition_penalty=1.5,
        min_new_tokens=5,
        eos_token_id=eos,
        pad_token_id=server.sampler.pad_token_id,
    )
    assert out.token_ids == hf[0, len(prompt) :].tolist() and len(out.token_ids) >= 5
    assert len(plain.token_ids) < 5, "without min_tokens a stop token ends it early: the test would prove nothing"
    assert len(out.log_probs) == len(out.token_ids) and no_logp.log_probs is None and plain.log_probs is None
    assert no_logp.token_ids == out.token_ids


@pytest.mark.parametrize(
    "request_,named",
    [
        ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
        ({"n": 2}, "n=2"),
        ({"ignore_eos": True}, "ignore_eos=True"),
        ({"mirostat_tau": 5.0}, "mirostat_tau=5.0"),
    ],
)
def test_sampling_request_a_key_it_cannot_honour_is_one_clear_error(server, request_, named):
    with pytest.raises(ValueError) as err:
        asyncio.run(server.generate("a", [1, 2, 3], {"temperature": 1.0, "max_tokens": 2, **request_}))
    msg = str(err.value)
    assert named in msg and "supported keys: temperature" in msg and "\n" not in msg
    assert server.stats["requests"] == 0, "a refused request must not reach the batch queue"


def test_rollout_config_sampling_defaults_apply_as_in_vllms_adapter(tiny_model_dir):
    """rollout.repetition_penalty fills a request that names none (VeRL's vLLM adapter: setdefault); rollout.ignore_eos
    is refused; full_determinism seeds the request."""
    from verl_backend.rollout.sampling import sampling_params_from_request

    cfg = SimpleNamespace(repetition_penalty=1.3, ignore_eos=False, full_determinism=True, seed=40)
    params = sampling_params_from_request({"temperature": 1.0}, cfg, response_length=16, replica_rank=2)
    assert (params.repetition_penalty, params.seed, params.max_new_tokens) == (1.3, 42, 16)
    assert sampling_params_from_request({"repetition_penalty": 1.0}, cfg, 16).repetition_penalty == 1.0
    with pytest.raises(ValueError, match="ignore_eos=True"):
        sampling_params_from_request({}, SimpleNamespace(ignore_eos=True), 16)


def test_a_sample_is_the_same_alone_or_batched_and_follows_seed_version_and_request_id(tiny_model_dir, job_settings):
    """VeRL's det-<priority> request ids (rollout.full_determinism): a request sampled alone, or in one batch with
    others that arrive before and after it, gets the same tokens; the job seed (data.seed), the rollout seed, the
    weight version and the request id each give it another stream, and so does a repeat of one id and prompt."""
    from verl_backend.rollout.server import NativeRolloutServer

    job_settings(job_seed=3)
    prompts = {f"det-{i}": [1 + i, 5, 9, 13 + i] for i in range(6)}
    request = {"temperature": 1.0, "max_tokens": 8, "logprobs": True}

    def run(ids, version=0, rollout_seed=42):
        """A fresh server (its batch loop lives on one event loop) serving ``ids`` at once -> (tokens, batches)."""
        cfg = SimpleNamespace(
            prompt_length=32,
            response_length=8,
            max_num_seqs=8,
            dtype="float32",
            full_determinism=True,
            seed=rollout_seed,
        )
        server = NativeRolloutServer(rollout_config=cfg, model_path=str(tiny_model_dir), batch_window_s=0.05)
        server.global_steps = version

        async def scenario():
            return await asyncio.gather(*(server.generate(rid, prompts[rid], request) for rid in ids))

        outs = asyncio.run(scenario())
        return {rid: out.token_ids for rid, out in zip(ids, outs)}, server.stats["batches"]

    alone, _ = run(["det-2"])
    together, batches = run(["det-5", "det-0", "det-2", "det-4"])
    assert batches == 1, "the four requests did not share one batch"
    assert together["det-2"] == alone["det-2"]
    assert run(["det-4", "det-2"])[0]["det-2"] == alone["det-2"]
    assert run(["det-2"], version=1)[0]["det-2"] != alone["det-2"]
    assert run(["det-2"], rollout_seed=7)[0]["det-2"] != alone["det-2"]
    job_settings(job_seed=4)
    assert run(["det-2"])[0]["det-2"] != alone["det-2"]
    # the same prompt under two request ids (two samples of one GRPO group) draws two streams
    job_settings(job_seed=3)
    prompts["det-9"] = prompts["det-2"]
    pair, _ = run(["det-2", "det-9"])
    assert pair["det-2"] == alone["det-2"] and pair["det-9"] != alone["det-2"]
    # VeRL 0.9.1's V1 trainer names every request det-0: a prompt's samples still draw one stream each
    prompts["det-0"] = prompts["det-2"]

    async def same_id_four_times(server):
        return await asyncio.gather(*(server.generate("det-0", prompts["det-0"], request) for _ in range(4)))

    cfg = SimpleNamespace(
        prompt_length=32, response_length=8, max_num_seqs=8, dtype="float32", full_determinism=True, seed=42
    )
    outs = asyncio.run(
        same_id_four_times(NativeRolloutServer(rollout_config=cfg, model_path=str(tiny_model_dir), batch_window_s=0.05))
    )
    assert len({tuple(o.token_ids) for o in outs}) == 4
    # without full_determinism VeRL's ids are fresh uuids: they do not enter the seed, the first sample of a prompt
    # at a version is the same in every run
    cfg.full_determinism = False
    firsts = [
        asyncio.run(
            NativeRolloutServer(rollout_config=cfg, model_path=str(tiny_model_dir)).generate(
                uuid, prompts["det-0"], request
            )
        ).token_ids
        for uuid in ("5f0c2a", "91be7d")
    ]
    assert firsts[0] == firsts[1]
