"""Native sampler for Hugging Face causal LMs: batched, KV-cached, with static-shape buckets."""

from rl_tpu.sampler.engine import Sampler
from rl_tpu.sampler.params import SampleOutput, SamplerError, SamplingParams
from rl_tpu.sampler.processing import choose_tokens

__all__ = ["SampleOutput", "Sampler", "SamplerError", "SamplingParams", "choose_tokens"]
