"""Helpers shared by the edge_export tests (a plain module, so test files can import it by name)."""

import json
import os


PROMPT = "w5 w17 w33 w9 w100 w7 w64 w12"  # 8 tokens of the word-level test tokenizer
# A chat template for the word-level tokenizer: w4 opens a turn, w5 closes it, w6 asks for the answer.
WORD_CHAT_TEMPLATE = (
    "{% for m in messages %}w4 {{ m['content'] }} w5 {% endfor %}{% if add_generation_prompt %}w6 {% endif %}"
)
WORD_CHATS = [[{"role": "user", "content": PROMPT}], [{"role": "user", "content": "w9 w10 w11"}]]


def word_tokenizer(vocab_size: int):
    """A word-level fast tokenizer: '<pad>'=0, '<s>'=1, '</s>'=2, '<unk>'=3, then 'w4' .. 'w<vocab-1>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def save_like_verl_checkpoint(model, tokenizer, out_dir: str, leftover_gguf_config: bool = False) -> str:
    """Save as a GGUF-derived `verl train` checkpoint is saved: no quantizer, no quantization_config, float weights.

    With ``leftover_gguf_config`` the config.json keeps ``quantization_config: {quant_method: gguf}``, as a save
    that skipped the clean-up step (older transformers) writes it; the export must still work unaided.
    """
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if leftover_gguf_config:
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["quantization_config"] = {"quant_method": "gguf"}
        with open(path, "w") as f:
            json.dump(config, f)
    return out_dir


def run_cli(capsys, *argv):
    """Run `litert` in-process; (exit code, stdout, stderr)."""
    from edge_export.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(err: str) -> str:
    """The CLI's error line; asserts it is the only 'litert ...: error:' line and no traceback was printed."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("litert ")]
    assert len(lines) == 1, err
    return lines[0]
