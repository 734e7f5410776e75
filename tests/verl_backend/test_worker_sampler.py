"""The rollout's interface for a worker's own sampler (``verl_backend.worker_sampler``, issue #46 item 1): the
checkpoint engines answer the rollout server's ``native_generate`` with what the rollout registered, and refuse in one
line when nothing was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verl_backend import worker_sampler


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(worker_sampler, "_SAMPLER", None)
    monkeypatch.setattr(worker_sampler, "_GENERATE", None)


def test_native_generate_refuses_without_a_sampler(fresh):
    with pytest.raises(RuntimeError, match="sampler_placement=worker"):
        worker_sampler.InWorkerGenerate().native_generate([[1, 2]], None)


def test_the_rollout_registers_its_sampler_and_the_engine_samples_with_it(fresh):
    """What the rollout's adapter registers (:func:`verl_backend.rollout.inworker.set_worker_sampler`) is what a
    checkpoint engine runs: the sampler's ``generate`` with the prompts, the key and the seeds, as (ids, log-probs)."""
    from verl_backend.rollout.inworker import NativeCheckpointEngine, set_worker_sampler

    calls = []

    def generate(prompts, params, seeds=None):
        calls.append((prompts, params, seeds))
        return [SimpleNamespace(token_ids=[7, 8], logprobs=None) for _ in prompts]

    set_worker_sampler(SimpleNamespace(device="cpu", generate=generate), threads=0)
    engine = NativeCheckpointEngine.__new__(NativeCheckpointEngine)  # its VeRL base is not needed to sample
    assert engine.native_generate([[1, 2], [3]], "key", [5, 6]) == [([7, 8], None), ([7, 8], None)]
    assert calls == [([[1, 2], [3]], "key", [5, 6])]
