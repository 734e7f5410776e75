"""Fixtures for edge_export: tiny random causal LMs saved the way a `verl train` checkpoint is, and factories."""

import os

import pytest
import torch

from edge_export_helpers import save_like_verl_checkpoint, word_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.syspath_prepend(HERE)  # `edge_export_factories:<name>` is importable as a SOURCE


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    return save_like_verl_checkpoint(model, word_tokenizer(256), str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    return save_like_verl_checkpoint(
        model, word_tokenizer(256), str(tmp_path_factory.mktemp("qwen2")), leftover_gguf_config=True
    )


@pytest.fixture(scope="session")
def mlp_fp32(tmp_path_factory):
    """(model, sample input (4, 16) float32, path of its verified fp32 .tflite) exported once for the session."""
    from edge_export import export_module
    from edge_export_factories import mlp

    model = mlp().eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    result = export_module(model, (x,), str(tmp_path_factory.mktemp("mlp") / "mlp.tflite"), quiet=True)
    return model, x, result.output
