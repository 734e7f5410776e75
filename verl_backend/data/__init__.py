"""Data for VeRL: converters to its parquet format and reward functions with its ``compute_score`` signature."""

from verl_backend.data.converters import (
    PROMPT_SUFFIX,
    few_shot_examples,
    gsm8k_jsonl_to_parquet,
    prompt_messages,
    reasoning_gym_to_parquet,
    validate_rl_parquet,
)
from verl_backend.data.rewards import compute_score, extract_final_answer

__all__ = [
    "PROMPT_SUFFIX",
    "compute_score",
    "extract_final_answer",
    "few_shot_examples",
    "gsm8k_jsonl_to_parquet",
    "prompt_messages",
    "reasoning_gym_to_parquet",
    "validate_rl_parquet",
]
