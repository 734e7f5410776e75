"""Issue #44, item 6: a model whose decoder layers are not all attention (convolution, state-space, linear-attention
or recurrent layers) is refused in one line before Ray starts, naming the family, its layers, why and the fix.
Before, such a job ended in a ``RuntimeError`` traceback from a Ray worker (the rollout's weight-sync check).

Tiny configs from transformers' own config classes, nothing downloaded; the folders hold the config and a placeholder
weight file (the check reads the config only). The controls (Gemma3 with sliding layers, Qwen2) pass the same check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KEY = "actor_rollout_ref.model.path"
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}

# family -> (config class, keys, the layer type refused and its count in the message)
HYBRIDS = {
    "lfm2": ("Lfm2Config", {"num_hidden_layers": 3, "full_attn_idxs": [1]}, "2 of 3 short-convolution layers"),
    "jamba": (
        "JambaConfig",
        {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2},
        "3 of 4 Mamba state-space layers",
    ),
    "bamba": (
        "BambaConfig",
        {"num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 8},
        "2 of 3 Mamba state-space layers",
    ),
    "falcon_h1": (
        "FalconH1Config",
        {"num_hidden_layers": 2, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_ssm": 64},
        "2 of 2 layers with a Mamba state-space mixer beside their attention",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {"num_hidden_layers": 4, "full_attention_interval": 4},
        "3 of 4 linear-attention (recurrent-state) layers",
    ),
    "mamba": ("MambaConfig", {"num_hidden_layers": 2}, "2 of 2 Mamba state-space layers"),
    "recurrent_gemma": ("RecurrentGemmaConfig", {"num_hidden_layers": 3}, "recurrent (RG-LRU) layers"),
}
CONTROLS = {
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "head_dim": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
    "qwen2": ("Qwen2Config", {"num_hidden_layers": 2}),
}


def _config_folder(tmp_path: Path, name: str, cls_name: str, keys: dict) -> Path:
    import torch
    import transformers
    from safetensors.torch import save_file

    cls = getattr(transformers, cls_name)
    allowed = {**SMALL, **keys}
    config = cls(**allowed)
    folder = tmp_path / name
    config.save_pretrained(folder)
    save_file({"placeholder": torch.zeros(1)}, str(folder / "model.safetensors"))  # the check reads no weights
    return folder


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_a_family_with_layers_that_are_not_attention_is_refused_in_one_line(tmp_path, family, tiny_model_dir):
    from verl_backend.driver.preflight import check_model_folder
    from verl_backend.errors import BadInputError

    cls_name, keys, layers = HYBRIDS[family]
    folder = _config_folder(tmp_path, family, cls_name, keys)
    with pytest.raises(BadInputError) as exc:
        check_model_folder(KEY, folder, str(tiny_model_dir))
    line = str(exc.value)
    assert "\n" not in line
    assert line.startswith(f"{KEY}={folder}: its {family} model has ")
    assert layers in line
    assert "cannot run this family exactly; train a family whose layers are all attention" in line


@pytest.mark.parametrize("family", sorted(CONTROLS))
def test_all_attention_families_pass_the_same_check(tmp_path, family, tiny_model_dir):
    from verl_backend.driver.preflight import check_model_folder, non_attention_layers

    cls_name, keys = CONTROLS[family]
    folder = _config_folder(tmp_path, family, cls_name, keys)
    check_model_folder(KEY, folder, str(tiny_model_dir))  # no exception
    from transformers import AutoConfig

    assert non_attention_layers(AutoConfig.from_pretrained(folder)) == {}


def test_every_causal_lm_family_in_transformers_is_classified():
    """Each family transformers registers as a causal LM, in its default config, is either all attention or refused
    by name: the hybrids this check knows are among the refused, the families rl-tpu runs among the accepted."""
    import warnings

    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from verl_backend.driver.preflight import non_attention_layers

    refused, accepted = set(), set()
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if name not in CONFIG_MAPPING:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = CONFIG_MAPPING[name]()
            except Exception:  # a config that needs arguments: not classified here
                continue
        (refused if non_attention_layers(config) else accepted).add(name)
    assert {
        "jamba",
        "bamba",
        "falcon_h1",
        "mamba",
        "mamba2",
        "falcon_mamba",
        "qwen3_next",
        "zamba",
        "zamba2",
        "nemotron_h",
        "granitemoehybrid",
        "recurrent_gemma",
    } <= refused
    assert {"llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "mistral", "gemma2"} <= accepted


def test_the_cli_refuses_a_hybrid_before_ray_starts(tmp_path, tiny_model_dir):
    """``verl train`` with an LFM2 folder: exit 2, one ``verl: error:`` line, no traceback, no Ray."""
    import shutil

    folder = _config_folder(tmp_path, "lfm2", *HYBRIDS["lfm2"][:2])
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
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
            "--output-dir",
            str(tmp_path / "out"),
            f"{KEY}={folder}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("verl: error:")]
    assert len(errors) == 1 and "short-convolution layers" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "ray" not in proc.stdout.lower()
