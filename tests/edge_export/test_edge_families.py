"""``litert export`` per model family: a tiny random model of each (SmolLM2's tokenizer and ChatML template,
prompts longer than the sliding window) goes to a float ``.litertlm`` verified through the LiteRT-LM runtime:
every greedy step of every chat equal to Hugging Face's. Llama is exported by the other edge_export tests.

Two families need something of ours: sliding-window models (Gemma3, Mistral) a litert-torch fix
(``edge_export/litert_patches.py``), and a mixture of experts transformers' static-shape experts forward (a note
in the report); both checked here, with the patch's own tests.
"""

import json
import subprocess
import sys

import pytest
from families import build_tiny_model

pytestmark = pytest.mark.slow

FAMILIES = ("qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_exports_and_matches_pytorch_in_the_runtime(family, smollm2_tokenizer, tmp_path):
    from edge_export.cli import main

    model = build_tiny_model(family, smollm2_tokenizer, tmp_path / family, weight_std=0.02)
    out = tmp_path / f"{family}.litertlm"
    assert main(["export", str(model), "-o", str(out), "--cache-length", "256", "--quiet"]) == 0
    report = json.loads((tmp_path / f"{family}.litertlm.report.json").read_text())
    check = report["verification"]
    assert report["model_type"] == json.loads((model / "config.json").read_text())["model_type"]
    assert check["passed"] and check["top1_agreement"] == 1.0 and check["compared_steps"] >= 200
    for chat in check["chats"]:  # the runtime prefilled exactly apply_chat_template's ids, longer than the window
        assert chat["runtime_prompt_tokens"] == chat["torch_prompt_tokens"] > 5
    moe_note = [n for n in report["notes"] if n.startswith("mixture of experts")]
    assert bool(moe_note) == (family == "qwen3_moe")


def test_cache_patch_is_still_needed_and_applies():
    """The litert-torch fix applies to the pinned version only while its cache lacks the method (a release that
    fixes it upstream makes this test fail, so the patch is then removed), and gives the longest layer's length."""
    code = (
        "from litert_torch.generative.export_hf.core import cache_base as c\n"
        "print(hasattr(c.LiteRTLMCacheMixin, 'get_max_length'))\n"
        "from edge_export import litert_patches\n"
        "print(litert_patches.patch_cache_get_max_length(), hasattr(c.LiteRTLMCacheMixin, 'get_max_length'))\n"
        "class Layer:\n"
        "    def __init__(self, n): self.n = n\n"
        "    def get_max_length(self): return self.n\n"
        "class Cache:\n"
        "    layers = [Layer(64), Layer(256)]\n"
        "print(c.LiteRTLMCacheMixin.get_max_length(Cache()))\n"
    )
    lines = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"},
    ).stdout.split("\n")
    assert lines[0] == "False"  # litert-torch 0.10.0 with transformers 5: missing, so sliding-window export fails
    assert lines[1] == "True True"
    assert lines[2] == "256"


_RMSNORM_CLASSES = (
    "import sys\n"
    "from edge_export import _tf_alias, litert_patches\n"
    "_tf_alias.install()\n"
    "if sys.argv[1] == 'patched':\n"
    "    print(litert_patches.keep_transformers_kernel_hook())\n"
    "from litert_torch.generative.export_hf import export\n"
    "from transformers.models.qwen3 import modeling_qwen3\n"
    "from transformers.models.mistral import modeling_mistral\n"
    "print(modeling_qwen3.Qwen3RMSNorm.__module__, modeling_mistral.MistralRMSNorm.__module__)\n"
)


@pytest.mark.parametrize("patched", [False, True])
def test_litert_export_leaves_transformers_modeling_classes_alone(patched):
    """Importing litert-torch's export swaps transformers' kernel hook for the process, so modeling classes imported
    after it are litert-torch's (their ``mark_tensor`` op breaks ``torch.compile`` of a training model in the same
    process); ``keep_transformers_kernel_hook`` puts the hook back before any of them is imported."""
    out = subprocess.run(
        [sys.executable, "-c", _RMSNORM_CLASSES, "patched" if patched else "plain"],
        capture_output=True,
        text=True,
        check=True,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"},
    ).stdout.split("\n")
    classes = out[-2].split()
    if patched:
        assert out[0] == "True"
        assert classes == ["transformers.models.qwen3.modeling_qwen3", "transformers.models.mistral.modeling_mistral"]
    else:  # still needed: litert-torch 0.10.0 replaces both
        assert all(c.startswith("litert_torch.") for c in classes), classes


def test_patch_refuses_other_versions(monkeypatch):
    from edge_export import litert_patches
    from rl_tpu.patches.record import UnsupportedVersionError

    monkeypatch.setattr(litert_patches, "_litert_torch_version", lambda: "0.11.0")
    with pytest.raises(UnsupportedVersionError):
        litert_patches.patch_cache_get_max_length()
    with pytest.raises(UnsupportedVersionError):
        litert_patches.keep_transformers_kernel_hook()
