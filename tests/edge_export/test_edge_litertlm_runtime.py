"""`.litertlm` bundles checked through the LiteRT-LM runtime (`litert_lm`) itself, against Hugging Face.

Two tiny random Llamas: SmolLM2's real ChatML tokenizer, and a Gemma-style template with a BOS the tokenizer
prepends. Each is exported once (fp32, verified through the runtime by default); the int8 bundle and the negative
controls are the same bundle rewritten by `edge_export.bundle.finish_bundle`.
"""

import json
import os
import re

import pytest
import torch

from edge_export.bundle import finish_bundle, read_chat_format
from edge_export.chat_template import ChatFormat, chat_format_for, hf_prompt_ids
from edge_export.runtime_chat import DEFAULT_CHATS, open_engine, runtime_turn
from edge_export_helpers import one_line_error, run_cli

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You are terse."}
PROMPT_CASES = {
    "system+user": [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    "user only": [{"role": "user", "content": "What is the capital of France?"}],
    "two turns": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "system + two turns": [
        SYSTEM,
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye."},
    ],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "Translate: "}, {"type": "text", "text": "cat"}]}],
    "system as parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
}


@pytest.fixture(scope="module")
def chatml_bundle(chatml_dir, tmp_path_factory):
    from edge_export.cli import main

    out = tmp_path_factory.mktemp("chatml_out") / "model.litertlm"
    assert (
        main(["export", chatml_dir, "-o", str(out), "--prefill-lengths", "32", "--cache-length", "256", "--quiet"]) == 0
    )
    return str(out)


@pytest.fixture(scope="module")
def gemma_style_bundle(gemma_style_dir, tmp_path_factory):
    from edge_export.cli import main

    out = tmp_path_factory.mktemp("gemma_out") / "model.litertlm"
    assert (
        main(["export", gemma_style_dir, "-o", str(out), "--prefill-lengths", "32", "--cache-length", "256", "--quiet"])
        == 0
    )
    return str(out)


def load(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(checkpoint),
    )


def assert_runtime_prefills_hf_prompts(bundle, tokenizer):
    engine = open_engine(bundle, cache_length=256)
    for name, chat in PROMPT_CASES.items():
        turn = runtime_turn(engine, chat, steps=2)
        assert "error" not in turn, (name, turn)
        reference = hf_prompt_ids(tokenizer, chat)
        assert turn["prefill_tokens"] == len(reference), name  # the runtime's own count
        assert turn["prompt_ids"] == reference, name  # its rendering, tokenizer and start token


def test_chatml_report_has_runtime_answers_beside_pytorch(chatml_bundle):
    report = json.loads(open(chatml_bundle + ".report.json").read())
    check = report["verification"]
    assert report["installed"] and check["runtime"] == "litert_lm" and check["passed"], check["failures"]
    assert len(check["chats"]) == len(DEFAULT_CHATS) >= 8
    for chat in check["chats"]:
        assert chat["runtime_prompt_tokens"] == chat["torch_prompt_tokens"]
        assert chat["agreed_steps"] == chat["steps"] == 32  # fp32: every greedy token, no stop token reached
        assert chat["runtime_answer"] == chat["torch_answer"] and chat["runtime_answer"]
    assert len({c["runtime_answer"] for c in check["chats"]}) > 4  # answers depend on the prompt
    assert check["top1_agreement"] == 1.0 and check["decode_tokens_per_s"] > 0
    # nothing else is left beside OUT: no temporary bundle, no runtime XNNPACK cache of it
    assert sorted(os.listdir(os.path.dirname(chatml_bundle))) == ["model.litertlm", "model.litertlm.report.json"]


def test_chatml_bundle_metadata(chatml_bundle, chatml_dir, tmp_path):
    stored = read_chat_format(chatml_bundle, str(tmp_path))
    _, tokenizer = load(chatml_dir)
    assert stored["start_token"] is None  # SmolLM2 declares <|im_start|> as BOS but never prepends it
    assert stored["stop_tokens"] == [[1], [2]]  # its EOS (<|im_start|> in the GGUF) and <|im_end|>
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert stored["template"].endswith(tokenizer.chat_template) and stored["max_num_tokens"] == 256


def test_chatml_runtime_prefills_apply_chat_template_ids(chatml_bundle, chatml_dir):
    assert_runtime_prefills_hf_prompts(chatml_bundle, load(chatml_dir)[1])


def test_gemma_style_runtime_prefills_apply_chat_template_ids(gemma_style_bundle, gemma_style_dir, tmp_path):
    model, tokenizer = load(gemma_style_dir)
    stored = read_chat_format(gemma_style_bundle, str(tmp_path))
    assert stored["start_token"] == "<bos>"  # the tokenizer prepends it, so the runtime must, once
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert [end_of_turn] in stored["stop_tokens"]
    assert_runtime_prefills_hf_prompts(gemma_style_bundle, tokenizer)
    report = json.loads(open(gemma_style_bundle + ".report.json").read())["verification"]
    assert report["passed"] and report["top1_agreement"] == 1.0


@pytest.fixture(scope="module")
def chatml_int8_bundle(chatml_bundle, chatml_dir, tmp_path_factory):
    """The fp32 bundle's model quantized with dynamic-int8, as `litert export --quantize dynamic-int8` does."""
    model, tokenizer = load(chatml_dir)
    out = tmp_path_factory.mktemp("chatml_int8")
    finish_bundle(
        chatml_bundle,
        str(out / "int8.litertlm"),
        chat_format_for(tokenizer, model.generation_config),
        str(out / "work"),
        "dynamic-int8",
    )
    return str(out / "int8.litertlm")


def test_int8_bundle_agreement_is_measured_and_bounded(chatml_int8_bundle, chatml_bundle, chatml_dir, capsys):
    """A random 64-wide model has near-ties everywhere: int8 keeps ~84% of its greedy steps (SmolLM2-135M keeps
    more, benchmarks/bench_litert_export.py --runtime-only). The default 90% bound must fail it, one line, exit 3;
    a bound below the measured agreement must pass it."""
    assert os.path.getsize(chatml_int8_bundle) < 0.5 * os.path.getsize(chatml_bundle)
    code, _, err = run_cli(capsys, "verify", chatml_int8_bundle, "--source", chatml_dir, "--quantize", "dynamic-int8")
    line = one_line_error(err)
    assert code == 3 and "top-1 agreement" in line and "is below 90% by" in line and "--min-agreement" in line
    share = float(line.split("top-1 agreement ")[1].split("%")[0]) / 100
    assert 0.6 < share < 0.9
    code, stdout, _ = run_cli(
        capsys,
        "verify",
        chatml_int8_bundle,
        "--source",
        chatml_dir,
        "--quantize",
        "dynamic-int8",
        "--min-agreement",
        str(share - 0.05),
    )
    assert code == 0 and f"top-1 agreement {share:.1%} of 256 greedy steps" in stdout


def rewritten(bundle, tmp_path, **changes):
    stored = read_chat_format(bundle, str(tmp_path / "read"))
    good = ChatFormat(
        template=stored["template"],
        start_token=stored["start_token"],
        stop_token_ids=tuple(t[0] for t in stored["stop_tokens"]),
    )
    out = str(tmp_path / "bad.litertlm")
    finish_bundle(bundle, out, ChatFormat(**{**good.__dict__, **changes}), str(tmp_path / "work"))
    return out


def test_doubled_start_token_fails(chatml_bundle, chatml_dir, tmp_path, capsys):
    """What litert-torch 0.10.0 writes for SmolLM2: <|im_start|> as start token in front of a ChatML render."""
    bad = rewritten(chatml_bundle, tmp_path, start_token="<|im_start|>")
    code, _, err = run_cli(capsys, "verify", bad, "--source", chatml_dir)
    line = one_line_error(err)
    assert code == 3
    assert "the runtime prefills 33 tokens, apply_chat_template gives 32; first difference at token 1" in line
    assert "chat template or start token" in line


def test_stock_template_fails_with_the_runtime_reason(chatml_bundle, chatml_dir, tmp_path, capsys):
    _, tokenizer = load(chatml_dir)
    bad = rewritten(chatml_bundle, tmp_path, template=tokenizer.chat_template)
    code, _, err = run_cli(capsys, "verify", bad, "--source", chatml_dir)
    line = one_line_error(err)
    assert code == 3
    assert "cannot render or answer it" in line and "unsupported types string and sequence" in line


def test_verify_command_passes_a_good_bundle(chatml_bundle, chatml_dir, capsys):
    code, stdout, _ = run_cli(capsys, "verify", chatml_bundle, "--source", chatml_dir, "--verify-steps", "8")
    assert code == 0 and "top-1 agreement 100.0% of 64 greedy steps" in stdout


def test_bundle_needs_a_chat_template(llama_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "export", llama_dir, "-o", tmp_path / "m.litertlm")
    line = one_line_error(err)
    assert code == 1 and "has no chat_template" in line and "export to .tflite" in line
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def eval_items(chatml_dir, tmp_path_factory):
    """Four chats whose expected answer is PyTorch's own 8-token greedy answer (so PyTorch scores 100%)."""
    from edge_export.runtime_chat import torch_greedy

    model, tokenizer = load(chatml_dir)
    path = tmp_path_factory.mktemp("eval") / "items.jsonl"
    with open(path, "w") as f:
        for chat in DEFAULT_CHATS[:4]:
            answer = tokenizer.decode(torch_greedy(model, hf_prompt_ids(tokenizer, chat), 8, (1, 2)))
            f.write(json.dumps({"prompt": chat, "answer": answer}) + "\n")
    return str(path)


def test_eval_scores_runtime_beside_pytorch(chatml_bundle, chatml_dir, eval_items, capsys):
    code, stdout, _ = run_cli(
        capsys,
        "verify",
        chatml_bundle,
        "--source",
        chatml_dir,
        "--verify-steps",
        "4",
        "--eval",
        eval_items,
        "--scorer",
        "edge_export.evaluate:score_exact",
        "--eval-max-tokens",
        "8",
    )
    assert code == 0
    assert "task accuracy through LiteRT-LM 100.0%, PyTorch 100.0% on 4 items" in stdout


def test_eval_fails_when_int8_loses_accuracy(chatml_int8_bundle, chatml_dir, eval_items, capsys):
    code, _, err = run_cli(
        capsys,
        "verify",
        chatml_int8_bundle,
        "--source",
        chatml_dir,
        "--verify-steps",
        "4",
        "--min-agreement",
        "0",
        "--eval",
        eval_items,
        "--scorer",
        "exact",
        "--eval-max-tokens",
        "8",
        "--max-drop",
        "0",
    )
    line = one_line_error(err)
    assert code == 3 and "PyTorch 100.0% on 4 items" in line and "points lost, 0 allowed" in line


def test_eval_file_errors_before_conversion(chatml_dir, tmp_path, capsys):
    bad = tmp_path / "items.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    code, _, err = run_cli(capsys, "export", chatml_dir, "-o", tmp_path / "m.litertlm", "--eval", bad)
    assert code == 1 and "items.jsonl:1 needs keys 'prompt' and 'answer'" in one_line_error(err)
    code, _, err = run_cli(capsys, "export", chatml_dir, "-o", tmp_path / "m.tflite", "--eval", bad)
    assert code == 1 and "give a .litertlm output" in one_line_error(err)


def test_bench_litertlm_through_the_runtime_benchmark_api(chatml_bundle, chatml_dir, capsys):
    code, stdout, _ = run_cli(capsys, "bench", chatml_bundle, "--source", chatml_dir, "--steps", "16")
    assert code == 0 and "this CPU, XNNPACK: not a phone" in stdout
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in stdout.splitlines()[1:])
    for label in (
        "LiteRT-LM prefill tokens/s",
        "LiteRT-LM decode tokens/s",
        "PyTorch decode tokens/s",
        "LiteRT-LM peak RSS GiB",
    ):
        assert float(rows[label].strip()) > 0, label


def test_a_bundle_the_runtime_cannot_load_fails_verification(tmp_path, capsys):
    junk = tmp_path / "junk.litertlm"
    junk.write_bytes(b"not a bundle" * 100)
    from edge_export.runtime_chat import verify_bundle

    result = verify_bundle(str(junk), None, None, quantization="none", stop_ids=(1,))
    assert not result["passed"] and "the LiteRT-LM runtime cannot load" in result["failures"][0]
    assert "Invalid magic number" in result["failures"][0]  # the runtime's own reason
    code, _, err = run_cli(capsys, "verify", junk, "--source", tmp_path)
    assert code == 1 and "--source" in one_line_error(err)
