"""``verl train`` as a user types it: help, defaults, and one clear line for each kind of bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml


def verl(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    return subprocess.run(
        [sys.executable, "-m", "verl_backend.driver.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("verl: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_help_names_the_main_options():
    proc = verl("train", "--help")
    assert proc.returncode == 0
    for word in ("--backend", "--config", "--output-dir", "--num-threads", "tpu", "cpu", "cuda", "overrides"):
        assert word in proc.stdout


@pytest.mark.parametrize(
    "argv, overrides",
    [
        (
            ["--backend", "cpu", "--max-restarts", "0", "trainer.total_training_steps=2"],
            ["trainer.total_training_steps=2"],
        ),
        (["a=1", "--backend", "cpu", "b=2", "--max-restarts", "0", "c=3"], ["a=1", "b=2", "c=3"]),
        (["--backend", "cpu", "a=1", "--max-restarts=0", "a=2", "--print-config"], ["a=1", "a=2"]),
        (["--backend", "cpu", "--max-restarts", "0", "--", "x.y=1"], ["x.y=1"]),
    ],
)
def test_overrides_are_accepted_in_any_position_and_keep_their_order(argv, overrides):
    from verl_backend.driver.cli import parse_args

    args = parse_args(["train", *argv])
    assert args.overrides == overrides  # order kept: for Hydra the later setting of a key wins
    assert args.backend == "cpu" and args.max_restarts == 0


@pytest.mark.parametrize(
    "word, hint", [("--max-restartz", " (did you mean --max-restarts?)"), ("--no-such-flag=1", "")]
)
def test_unknown_option_is_one_line_with_the_closest_option(word, hint):
    from verl_backend.driver.cli import parse_args
    from verl_backend.errors import BadInputError

    with pytest.raises(BadInputError) as caught:
        parse_args(["train", "--backend", "cpu", "a=1", word, "0"])
    option = word.split("=")[0]
    assert str(caught.value).startswith(f"unknown option {option!r}{hint}: `verl train --help` lists the options")
    line = _one_error_line(verl("train", "--backend", "cpu", word, "0"))  # refused before anything runs
    assert line == f"verl: error: {caught.value}"


def test_unknown_backend():
    line = _one_error_line(verl("train", "--backend", "gpu9"))
    assert "'gpu9'" in line and "tpu, cpu, cuda" in line


def test_tpu_backend_without_a_chip_says_so_and_what_to_do():
    line = _one_error_line(verl("train", "--backend", "tpu"))
    assert "--backend tpu" in line and "--backend cpu" in line


def test_remax_is_refused_in_one_line_at_print_config():
    """VeRL 0.9.1's V1 trainer has no greedy baseline for ReMax: the job ended in a TypeError traceback in Ray."""
    line = _one_error_line(verl("train", "--backend", "cpu", "--print-config", "algorithm.adv_estimator=remax"))
    assert "algorithm.adv_estimator=remax" in line and "trainer.use_v1=false" in line and "use rloo or grpo" in line


def test_every_registered_estimator_is_run_or_refused_with_a_reason():
    """Each estimator VeRL 0.9.1 registers passes the check (bench_estimators.py runs them) or is refused naming
    why and what to use; a name VeRL does not register is refused once the user's reward file is imported."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    from verl_backend.driver.preflight import V1_UNFED_ESTIMATORS, check_adv_estimator
    from verl_backend.errors import BadInputError

    assert set(V1_UNFED_ESTIMATORS) < set(ADV_ESTIMATOR_REGISTRY)
    for name in ADV_ESTIMATOR_REGISTRY:
        config = OmegaConf.create({"algorithm": {"adv_estimator": name}})
        if name == "gae":  # the critic's micro batch: VeRL refused it with a hydra traceback
            check_adv_estimator(config)  # --print-config still shows such a config
            with pytest.raises(BadInputError, match="critic.ppo_micro_batch_size_per_gpu"):
                check_adv_estimator(config, before_run=True)
            config.critic = {"ppo_micro_batch_size_per_gpu": 4}
        if name in V1_UNFED_ESTIMATORS:
            with pytest.raises(BadInputError, match=rf"algorithm.adv_estimator={name}: .*; (with one reward, )?use "):
                check_adv_estimator(config)
        else:
            check_adv_estimator(config, before_run=True)
    unknown = OmegaConf.create({"algorithm": {"adv_estimator": "grpoo"}})
    check_adv_estimator(unknown)  # before the user's file is imported: may still be registered there
    with pytest.raises(BadInputError, match="registers no such estimator; give one of .*grpo"):
        check_adv_estimator(unknown, before_run=True)


def test_default_config_composes_with_backend_defaults(tmp_path):
    proc = verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "--print-config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "native"
    assert cfg["trainer"]["device"] == "cpu"
    assert cfg["algorithm"]["adv_estimator"] == "grpo"
    # the default recipe (docs/recipe.md): 4 prompts x 8 samples at temperature 0.7
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 8 and cfg["data"]["train_batch_size"] == 4
    assert cfg["actor_rollout_ref"]["rollout"]["temperature"] == 0.7
    # DAPO's dynamic sampling, bounded (docs/recipe.md, the sixth screen)
    assert cfg["algorithm"]["filter_groups"]["enable"] is True
    assert cfg["algorithm"]["filter_groups"]["max_num_gen_batches"] == 16
    assert cfg["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] == "sdpa"
    assert (tmp_path / "data" / "basic_arithmetic_train.parquet").is_file()


@pytest.mark.parametrize("example", ["chain_sum_cpu", "gsm8k_cpu", "ppo_cpu"])
def test_an_example_that_needs_no_model_folder_composes_and_fits_this_host(example, tmp_path):
    """A ``--config`` file replaces the embedded default job: an example must be a whole job (a partial one ran
    VeRL's own defaults, 256 prompts a step, and was refused by the host-memory plan at 370 GiB)."""
    proc = verl(
        "train",
        "--backend",
        "cpu",
        "--config",
        f"examples/{example}.yaml",
        "--output-dir",
        str(tmp_path),
        "--print-config",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    fits = [line for line in proc.stdout.splitlines() if line.startswith("#   this host:")]
    assert len(fits) == 1 and fits[0].endswith(": fits"), fits
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
    assert cfg["data"]["train_batch_size"] <= 16, cfg["data"]["train_batch_size"]
    if example == "chain_sum_cpu":
        assert (tmp_path / "data" / "chain_sum_train.parquet").is_file()


def test_command_line_beats_config_file_beats_backend_defaults(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "data": {"train_batch_size": 2, "max_response_length": 32},
                "actor_rollout_ref": {"rollout": {"max_num_seqs": 8}, "actor": {"ppo_mini_batch_size": 2}},
            }
        )
    )
    proc = verl(
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(tmp_path / "o"),
        "--config",
        str(cfg),
        "--print-config",
        "data.train_batch_size=3",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
    assert out["data"]["train_batch_size"] == 3
    assert out["data"]["max_response_length"] == 32
    assert out["actor_rollout_ref"]["rollout"]["max_num_seqs"] == 8


def test_unknown_verl_key_is_one_line(tmp_path):
    line = _one_error_line(verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "trainer.no_such_key=1"))
    assert "no_such_key" in line


def test_checkpoint_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path / "o"),
            f"actor_rollout_ref.model.path={tmp_path / 'empty'}",
        )
    )
    assert "is not a model folder" in line


def test_missing_config_file(tmp_path):
    line = _one_error_line(verl("train", "--backend", "cpu", "--config", str(tmp_path / "nope.yaml")))
    assert "nope.yaml" in line and "no such file" in line


def test_overlong_prompts_are_refused_when_filtering_is_off(tmp_path, tiny_model_dir):
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"critic.model.path={tiny_model_dir}",
            "data.max_prompt_length=16",
            "data.filter_overlong_prompts=false",
        )
    )
    assert "longer than data.max_prompt_length=16" in line


def test_compiled_trainer_on_packed_micro_batches_is_refused(tmp_path, tiny_model_dir):
    """The CPU default packs micro batches (a new length every step: a compile per step), so
    rl_tpu.compile_trainer is refused there with the key that fixes it."""
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"critic.model.path={tiny_model_dir}",
            "rl_tpu.compile_trainer=true",
        )
    )
    assert "rl_tpu.compile_trainer needs padded micro batches" in line
    assert "actor_rollout_ref.model.use_remove_padding=false" in line


def test_lengths_past_a_longrope_switch_are_refused(tmp_path, default_model_dir):
    """Phi-3-style longrope switches RoPE factors at original_max_position_embeddings: the rollout's KV cache and
    the trainer's forward would disagree for sequences that cross it, so such lengths are refused up front."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    cfg = AutoConfig.for_model(
        "phi3",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 128,
        },
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "phi3"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path / "o"),
            f"actor_rollout_ref.model.path={model_dir}",
            f"critic.model.path={model_dir}",
        )
    )
    assert "= 192 tokens" in line and "is past 128" in line and "longrope" in line, line
    # the rollout's own length keys, set past the switch while data.* fit, are what it samples with
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path / "o"),
            f"actor_rollout_ref.model.path={model_dir}",
            f"critic.model.path={model_dir}",
            "data.max_prompt_length=96",
            "data.max_response_length=32",
            "actor_rollout_ref.rollout.response_length=96",
        )
    )
    assert "prompt_length + response_length = 192 tokens" in line and "is past 128" in line, line


def test_a_rollout_split_across_chips_is_refused_in_one_line(tmp_path, tiny_model_dir):
    """The native sampler holds one unsharded model per replica: a tensor-parallel rollout would be silently ignored
    (every chip of the replica holding a whole copy, one of them sampling)."""
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"critic.model.path={tiny_model_dir}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        )
    )
    assert (
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2: the native rollout runs each replica on one chip"
        in line
    ), line


def test_worker_sampler_placement_without_an_engine_serving_it_is_one_line(tmp_path, tiny_model_dir):
    """Without an engine that serves the worker's sampler (native, or gloo with a rollout slice) every generate failed
    with an AttributeError deep in Ray."""
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"critic.model.path={tiny_model_dir}",
            "+actor_rollout_ref.rollout.engine_kwargs.native={sampler_placement:worker}",
        )
    )
    assert (
        "sampler_placement=worker needs actor_rollout_ref.rollout.checkpoint_engine.backend native or gloo "
        "(it is 'naive')"
    ) in line, line
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"critic.model.path={tiny_model_dir}",
            "+actor_rollout_ref.rollout.engine_kwargs.native=worker",
        )
    )
    assert "engine_kwargs.native='worker': give a mapping" in line, line
    # a misspelt key of the native rollout is refused, not dropped (it would leave the placement at its default)
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"critic.model.path={tiny_model_dir}",
            "+actor_rollout_ref.rollout.engine_kwargs.native={sampler_placment:worker}",
        )
    )
    assert (
        "engine_kwargs.native.sampler_placment: not a key of the native rollout; its keys are lean_decode, "
        "packed_prefill, packed_weights, sampler_placement" in line
    ), line
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"critic.model.path={tiny_model_dir}",
            "actor_rollout_ref.rollout.checkpoint_engine=null",
        )
    )
    assert "checkpoint_engine=None: the native rollout's weight sync needs one" in line, line


def test_length_that_is_not_a_number_is_one_line(tmp_path, tiny_model_dir):
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "data.max_response_length=abc",
        )
    )
    assert "data.max_response_length='abc': give a whole number of 1 or more" in line, line


@pytest.mark.parametrize(
    "override",
    [
        "data.train_batch_size=0",
        "actor_rollout_ref.rollout.n=0",
        "trainer.total_training_steps=abc",
        "data.max_prompt_length=2.5",
    ],
)
def test_counts_that_are_not_whole_numbers_are_one_line(tmp_path, override):
    """Before: a division by zero, a ValueError traceback, or (n=0) a whole job started only to fail in VeRL."""
    key, value = override.split("=")
    line = _one_error_line(verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "--print-config", override))
    shown = {"0": "0", "abc": "'abc'", "2.5": "2.5"}[value]  # as Hydra parsed it: int, str, float
    assert f"{key}={shown}: give a whole number of 1 or more" in line, line


def test_whole_number_check_passes_verls_own_defaults(tiny_model_dir):
    from verl_backend.driver.preflight import check_whole_numbers

    config = _compose_ppo(tiny_model_dir)
    check_whole_numbers(config)  # nulls (VeRL's defaults for the micro batch keys) and ints are accepted
    config.trainer.total_epochs = True
    with pytest.raises(Exception, match="trainer.total_epochs=True: give a whole number of 1 or more"):
        check_whole_numbers(config)


def test_output_dir_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = _one_error_line(verl("train", "--backend", "cpu", "--output-dir", str(tmp_path / "afile"), "--print-config"))
    assert f"--output-dir {tmp_path / 'afile'} is a file, not a folder" in line, line
    line = _one_error_line(
        verl("train", "--backend", "cpu", "--output-dir", str(tmp_path / "afile" / "run"), "--print-config")
    )
    assert f"--output-dir {tmp_path / 'afile' / 'run'}: cannot create it" in line, line


def test_model_folder_checks_name_the_key_and_the_fix(tmp_path, tiny_model_dir):
    """A folder without a tokenizer, and a config VeRL's FSDP engine cannot patch (no num_key_value_heads):
    both failed inside a Ray worker before."""
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel

    from verl_backend.errors import BadInputError
    from verl_backend.driver.preflight import check_model_folder

    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name in ("config.json", "model.safetensors"):
            shutil.copy(f, no_tok / f.name)
    with pytest.raises(
        BadInputError,
        match=r"critic.model.path=.*no_tok: transformers cannot load a tokenizer .*"
        r"or set critic.model.tokenizer_path",
    ):
        check_model_folder("critic.model.path", no_tok, None)
    check_model_folder("critic.model.path", no_tok, str(tiny_model_dir))  # tokenizer_path given: fine

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=64, n_positions=32)).save_pretrained(gpt2)
    with pytest.raises(BadInputError, match=r"its gpt2 config has no num_key_value_heads"):
        check_model_folder("actor_rollout_ref.model.path", gpt2, str(tiny_model_dir))
    check_model_folder("actor_rollout_ref.model.path", tiny_model_dir, None)


def test_family_without_sdpa_is_refused_in_one_line(tmp_path, tiny_model_dir):
    """GPT-OSS (no sdpa in transformers 5.x) ended in ~100 lines from a Ray worker; now one line before Ray. The
    Llama-like folder (sdpa) passes the same check: the control."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from verl_backend.driver.preflight import check_model_folder
    from verl_backend.errors import BadInputError

    gpt_oss = tmp_path / "gpt_oss"
    cfg = GptOssConfig(
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        vocab_size=64,
        max_position_embeddings=64,
        layer_types=["full_attention"],
    )
    GptOssForCausalLM(cfg).save_pretrained(gpt_oss)
    with pytest.raises(
        BadInputError,
        match=r"actor_rollout_ref.model.path=.*gpt_oss: GptOssForCausalLM \(gpt_oss\) "
        r"has no scaled_dot_product_attention .*train a family that has one",
    ) as exc:
        check_model_folder("actor_rollout_ref.model.path", gpt_oss, str(tiny_model_dir))
    assert "\n" not in str(exc.value)
    check_model_folder("actor_rollout_ref.model.path", tiny_model_dir, None)


def test_unwritable_model_cache_is_one_line(tmp_path):
    from verl_backend.errors import BadInputError
    from verl_backend.models import ensure_default_model

    (tmp_path / "afile").write_text("x")
    with pytest.raises(
        BadInputError,
        match=r"rl_tpu.model_cache: .*afile/cache on host .+: cannot write the "
        r"converted default model there .*set rl_tpu.model_cache to a folder",
    ):
        ensure_default_model(cache=str(tmp_path / "afile" / "cache"))


def test_model_path_with_a_trailing_slash_or_tilde_is_normalised(tmp_path, tiny_model_dir, monkeypatch):
    """VeRL 0.9.1's HFModelConfig asserts on a trailing '/' (a traceback inside Hydra) and does not expand '~'."""
    from verl_backend.driver.plan import normalized_path

    assert (
        normalized_path(f"actor_rollout_ref.model.path={tiny_model_dir}/")
        == f"actor_rollout_ref.model.path={tiny_model_dir}"
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    assert normalized_path("+critic.model.path='~/m/'") == f"+critic.model.path={tmp_path}/m"
    assert normalized_path("data.train_files=/x/") == "data.train_files=/x/"  # a data file keeps its slash
    assert normalized_path("data.val_files=~/v.parquet") == f"data.val_files={tmp_path}/v.parquet"
    assert normalized_path("data.val_files=[~/v.parquet]") == "data.val_files=[~/v.parquet]"  # a list: Hydra's
    proc = verl(
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(tmp_path / "o"),
        "--print-config",
        f"actor_rollout_ref.model.path={tiny_model_dir}/",
        f"critic.model.path={tiny_model_dir}/",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
    assert cfg["actor_rollout_ref"]["model"]["path"] == str(tiny_model_dir)


def test_train_files_without_val_files_names_verls_default(tmp_path, tiny_model_dir):
    import pandas as pd

    good = tmp_path / "train.parquet"
    pd.DataFrame(
        [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": "1+1?"}],
                "ability": "math",
                "reward_model": {"ground_truth": "2"},
                "extra_info": {"index": 0},
            }
        ]
    ).to_parquet(good)
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path / "o"),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={good}",
            "data.val_files=[]",
        )
    )
    assert "data.val_files is empty: give one or more parquet files" in line, line
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path / "o"),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={good}",
        )
    )
    assert "data.val_files is VeRL's default" in line and "set data.val_files too" in line, line


def test_reward_file_is_loaded_before_ray_starts(tmp_path, tiny_model_dir):
    """A syntax error in the user's reward file failed every sample inside Ray, ~90 s in."""
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def compute_score(a, b\n")
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path / "o"),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "rl_tpu.train_size=8",
            "rl_tpu.val_size=4",
            f"reward.custom_reward_function.path={broken}",
        )
    )
    assert "broken_reward.py (name=compute_score) cannot be loaded: SyntaxError" in line, line


def test_bad_data_file_names_the_row(tmp_path, tiny_model_dir):
    import pandas as pd

    bad = tmp_path / "bad.parquet"
    pd.DataFrame(
        [
            {
                "data_source": "openai/gsm8k",
                "prompt": [],
                "ability": "math",
                "reward_model": {"ground_truth": "1"},
                "extra_info": {"index": 0},
            }
        ]
    ).to_parquet(bad)
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path / "o"),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={bad}",
            f"data.val_files={bad}",
        )
    )
    assert "bad.parquet: row 0" in line


def test_tpu_slice_sets_one_node_per_host_and_one_worker_per_chip(tmp_path):
    proc = verl("train", "--backend", "tpu", "--slice", "v5p-16", "--output-dir", str(tmp_path), "--print-config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
    # v5p-16 counts TensorCores: 8 chips on 2 hosts of 4
    assert cfg["trainer"]["nnodes"] == 2 and cfg["trainer"]["n_gpus_per_node"] == 4
    assert cfg["trainer"]["device"] == "tpu"
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "native"


def test_default_job_on_a_fake_slice_fits_its_micro_batches_to_the_workers(tmp_path):
    """The README's dry run (``--slice v6e-16``: 16 workers, 1 sequence each) was refused over the embedded default's
    micro batch of 8; a micro batch size given on the command line is still the user's to fix."""
    proc = verl(
        "train",
        "--backend",
        "cpu",
        "--slice",
        "v6e-16",
        "--output-dir",
        str(tmp_path),
        "--print-config",
        "actor_rollout_ref.rollout.n=4",
    )  # 16 sequences a step (the old default's), 1 a worker
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "log_prob_micro_batch_size_per_gpu lowered from 8 (the embedded default) to 1" in proc.stdout
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("actor_rollout_ref:") :])
    assert cfg["trainer"]["nnodes"] * cfg["trainer"]["n_gpus_per_node"] == 16
    assert cfg["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"] == 1
    assert cfg["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == 1
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--slice",
            "v6e-4",
            "--output-dir",
            str(tmp_path),
            "--print-config",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.n=4",
        )
    )
    assert "log_prob_micro_batch_size_per_gpu=8 does not divide the 4 sequences" in line, line


def test_bad_slice_is_one_line():
    line = _one_error_line(verl("train", "--backend", "tpu", "--slice", "v6e-16:2x2", "--print-config"))
    assert "v6e-16" in line


def _compose_ppo(model_dir, *overrides: str):
    """examples/ppo_cpu.yaml (PPO, critic, rollout.n=1) on 2 nodes x 4 workers, composed without Ray."""
    from verl_backend.driver.profiles import PROFILES
    from verl_backend.driver.plan import compose_config, flatten_yaml_overrides, merge_overrides

    file_overrides, _ = flatten_yaml_overrides("examples/ppo_cpu.yaml")
    return compose_config(
        merge_overrides(
            PROFILES["cpu"].overrides,
            file_overrides,
            [
                f"actor_rollout_ref.model.path={model_dir}",
                f"critic.model.path={model_dir}",
                "trainer.nnodes=2",
                "trainer.n_gpus_per_node=4",
                *overrides,
            ],
        )
    )


def _verl_validate(config) -> Exception | None:
    import warnings

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        except (AssertionError, ValueError) as exc:
            return exc
    return None


@pytest.mark.parametrize(
    "overrides, ours, verls",
    [
        # VeRL's validate_config: train_batch_size x rollout.n a multiple of the 8 workers
        (
            ["data.train_batch_size=4"],
            "data.train_batch_size=4 × actor_rollout_ref.rollout.n=1 = 4 sequences per step "
            "do not split evenly over the 8 workers (trainer.n_gpus_per_node=4 × trainer.nnodes=2): set "
            "data.train_batch_size=8",
            "must be divisible by minimal possible batch size (8)",
        ),
        (
            [
                "data.train_batch_size=6",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "critic.ppo_mini_batch_size=4",
            ],
            "= 12 sequences per step do not split evenly over the 8 workers "
            "(trainer.n_gpus_per_node=4 × trainer.nnodes=2): set data.train_batch_size=8 (a multiple of 4)",
            "real_train_batch_size (12) must be divisible by minimal possible batch size (8)",
        ),
        # VeRL's ActorConfig.validate / CriticConfig.validate
        (
            ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
            "data.train_batch_size=8 is below actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "must be >=",
        ),
        (
            ["data.train_batch_size=8", "critic.ppo_mini_batch_size=16"],
            "data.train_batch_size=8 is below critic.ppo_mini_batch_size=16",
            "critic.ppo_mini_batch_size (16)",
        ),
        # VeRL's engine worker (after Ray starts): ppo_mini_batch_size x n a multiple of the data-parallel size
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=4"],
            "actor_rollout_ref.actor.ppo_mini_batch_size=4 × "
            "actor_rollout_ref.rollout.n=1 = 4 sequences per PPO update do not split over the 8 data-parallel ranks",
            None,
        ),
        (["critic.ppo_mini_batch_size=4"], "set critic.ppo_mini_batch_size=8 (a multiple of 8)", None),
        # VeRL's engine (after Ray starts): micro batches divide each rank's share
        (
            [
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "critic.ppo_mini_batch_size=4",
            ],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 does not divide the 1 "
            "sequences each data-parallel rank gets per PPO update",
            None,
        ),
        (
            [
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "critic.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "critic.ppo_micro_batch_size_per_gpu=1",
            ],
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 does "
            "not divide the 2 sequences each worker scores per step",
            None,
        ),
        (
            [
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "critic.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "critic.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            ],
            None,
            None,
        ),  # 8 per update, 16 per step: fine
        (["data.train_batch_size=4", "actor_rollout_ref.actor.use_dynamic_bsz=true"], None, None),  # VeRL skips it too
    ],
)
def test_batch_sizes_that_do_not_split_over_the_workers_are_one_line_before_ray(
    monkeypatch, tiny_model_dir, overrides, ours, verls
):
    from verl_backend.errors import BadInputError
    from verl_backend.driver.preflight import check_batch_sizes

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    config = _compose_ppo(tiny_model_dir, *overrides)
    verl_error = _verl_validate(config)
    assert (verl_error is None) == (verls is None), verl_error  # the same rule as VeRL's own check
    if verls:
        assert verls in str(verl_error)
    if ours is None:
        check_batch_sizes(config)
        return
    with pytest.raises(BadInputError) as caught:
        check_batch_sizes(config)
    assert ours in str(caught.value) and "\n" not in str(caught.value)


def test_batch_check_runs_where_the_config_is_composed_and_names_the_slice(tmp_path):
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--slice",
            "v4-16",
            "--config",
            "examples/ppo_cpu.yaml",
            "--output-dir",
            str(tmp_path),
            "--print-config",
            "data.train_batch_size=4",
        )
    )
    assert line.startswith(
        "verl: error: data.train_batch_size=4 × actor_rollout_ref.rollout.n=1 = 4 sequences per "
        "step do not split evenly over the 8 workers (trainer.n_gpus_per_node=4 × "
        "trainer.nnodes=2, from --slice v4-16): set data.train_batch_size=8"
    )


def test_micro_batches_that_do_not_divide_a_workers_share_are_one_line(tmp_path):
    """GRPO default with rollout.n=1: 4 sequences a step, log-prob micro batches of 8 (VeRL asserts inside a
    worker: 'data size must be divisible by ... micro_batch_size_per_gpu')."""
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            "--print-config",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        )
    )
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 does not divide the 4 sequences" in line
    assert "set it to a divisor of 4" in line
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            "--print-config",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        )
    )
    # 4 prompts x the default's 8 samples
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3 does not divide the 32 sequences" in line


def test_task_runner_in_driver_is_verls_own_class():
    from verl.trainer.main_ppo import TaskRunnerV1

    from verl_backend.driver.runner import _TaskRunnerInDriver, task_runner_class

    runner = task_runner_class("driver")
    assert isinstance(runner, _TaskRunnerInDriver)
    # the undecorated class VeRL wrote, with its own run(): nothing of the trainer is re-implemented here
    assert (runner._cls.__module__, runner._cls.__qualname__) == ("verl.trainer.main_ppo", "TaskRunnerV1")
    assert runner._cls.run.__code__.co_filename.endswith("verl/trainer/main_ppo.py")
    assert runner.options(runtime_env={}) is runner
    assert task_runner_class("actor") is TaskRunnerV1


def test_one_cause_chain_walk_finds_a_dead_actor_and_a_user_error_through_ray():
    """:func:`verl_backend.errors.in_cause_chain` behind both the driver's restart after a dead actor and ``verl``'s
    one-line user errors: it follows ``__cause__`` and Ray's ``cause``, skips Ray's copy of a user error for the
    error itself, and stops at a cycle."""
    from ray.exceptions import RayActorError, RayTaskError

    from verl_backend.driver.cli import _user_error
    from verl_backend.driver.runner import _actor_failure
    from verl_backend.errors import BadInputError

    dead, step = RayActorError(), RuntimeError("the step failed")
    step.__cause__ = dead
    outer = RuntimeError("no materializable trajectories")
    outer.__cause__ = step
    assert _actor_failure(outer) is dead and _user_error(outer) is None
    bad = BadInputError("data.train_files: no such file")
    top = RuntimeError("the job failed")
    top.__cause__ = RayTaskError("fit", "Traceback ...", bad).as_instanceof_cause()
    assert isinstance(top.__cause__, BadInputError)  # Ray's copy is one too: the walk must pass it for its cause
    assert _user_error(top) is bad and _actor_failure(top) is None
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert _actor_failure(a) is None and _user_error(a) is None


def _epochs_config(tmp_path, rows: int, batch: int, steps, epochs: int = 1, files: int = 1, filter_overlong=False):
    """A VeRL-shaped config over ``files`` small train parquet files of ``rows`` rows in all (no Ray, no model)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    paths = []
    for i in range(files):
        n = rows // files + (i < rows % files)
        paths.append(str(tmp_path / f"train{i}.parquet"))
        pq.write_table(pa.table({"x": list(range(n))}), paths[-1])
    return OmegaConf.create(
        {
            "data": {
                "train_files": paths[0] if files == 1 else paths,
                "train_batch_size": batch,
                "filter_overlong_prompts": filter_overlong,
                "train_max_samples": -1,
            },
            "trainer": {"total_training_steps": steps, "total_epochs": epochs},
        }
    )


@pytest.mark.parametrize("rows, batch, steps, epochs", [(16, 4, 4, 1), (16, 4, None, 1), (18, 4, 8, 2), (16, 4, 3, 1)])
def test_steps_within_the_epochs_leave_total_epochs_alone(tmp_path, capsys, rows, batch, steps, epochs):
    from verl_backend.driver.preflight import fit_epochs_to_steps

    config = _epochs_config(tmp_path, rows, batch, steps, epochs)
    fit_epochs_to_steps(config)
    assert config.trainer.total_epochs == epochs
    assert capsys.readouterr().out == ""


def test_steps_beyond_the_epochs_raise_total_epochs_with_one_line(tmp_path, capsys):
    """VeRL 0.9.1 stops after total_epochs epochs: 6 steps of a 16-row set in batches of 4 ran 4 steps."""
    from verl_backend.driver.preflight import fit_epochs_to_steps

    config = _epochs_config(tmp_path, 16, 4, 6)
    fit_epochs_to_steps(config)
    assert config.trainer.total_epochs == 2
    assert capsys.readouterr().out.splitlines() == [
        "[rl-tpu] trainer.total_training_steps=6 needs 2 epochs of 4 batches (16 rows / data.train_batch_size 4); "
        "trainer.total_epochs raised from 1 to 2"
    ]
    # rows summed over a list of files; the last partial batch is dropped (17 rows = 4 batches of 4); filtering
    # overlong prompts makes the row count an upper bound
    config = _epochs_config(tmp_path, 17, 4, 9, files=2, filter_overlong=True)
    fit_epochs_to_steps(config)
    assert config.trainer.total_epochs == 3
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        "[rl-tpu] trainer.total_training_steps=9 needs 3 epochs of 4 batches (17 rows / "
        "data.train_batch_size 4); trainer.total_epochs raised from 1 to 3"
    )
    assert "upper bound" in line and "data.filter_overlong_prompts" in line
    # data.train_max_samples caps the rows VeRL uses
    config = _epochs_config(tmp_path, 16, 4, 6)
    config.data.train_max_samples = 8
    fit_epochs_to_steps(config)
    assert config.trainer.total_epochs == 3


def test_batch_larger_than_the_train_rows_is_refused(tmp_path):
    from verl_backend.errors import BadInputError
    from verl_backend.driver.preflight import fit_epochs_to_steps

    config = _epochs_config(tmp_path, 3, 4, 6)
    with pytest.raises(BadInputError) as err:
        fit_epochs_to_steps(config)
    msg = str(err.value)
    assert "data.train_files" in msg and "train0.parquet" in msg and "has 3 rows" in msg
    assert "data.train_batch_size=4" in msg and "set data.train_batch_size=3 or less" in msg
    assert "\n" not in msg


def test_batch_larger_than_the_built_in_train_set_is_one_line_before_ray(tmp_path, tiny_model_dir):
    line = _one_error_line(
        verl(
            "train",
            "--backend",
            "cpu",
            "--output-dir",
            str(tmp_path),
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "rl_tpu.train_size=2",
            "rl_tpu.val_size=2",
            "data.train_batch_size=4",
        )
    )
    assert "basic_arithmetic_train.parquet) has 2 rows, fewer than data.train_batch_size=4" in line
    assert "set data.train_batch_size=2 or less, or give more rows (rl_tpu.train_size" in line


def test_run_folder_resumes_refuses_or_moves_an_earlier_run_aside(tmp_path, capsys):
    """VeRL's resume_mode=auto: the same command twice trained 0 steps and reprinted the first run's accuracy; a run
    with nothing to resume appended its metrics to the earlier run's."""
    from omegaconf import OmegaConf

    from verl_backend.errors import BadInputError
    from verl_backend.driver.run_folder import prepare_run_folder

    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    config = OmegaConf.create(
        {"trainer": {"resume_mode": "auto", "default_local_dir": str(ckpts), "total_training_steps": 12}}
    )
    prepare_run_folder(config, out)  # a new folder: silent, nothing moved
    assert capsys.readouterr().out == "" and not (out / "earlier").exists()

    (ckpts / "global_step_6").mkdir()
    (ckpts / "latest_checkpointed_iteration.txt").write_text("6")
    (out / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n{"step": 2, "da')  # cut by a kill
    prepare_run_folder(config, out)
    assert f"resuming from the checkpoint of step 6 in {ckpts}" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text().endswith('"da\n')  # the resumed run's rows start on a new line

    (ckpts / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(
        BadInputError,
        match=r"already holds the checkpoint of step 12, the last of "
        r"trainer.total_training_steps=12: nothing to train",
    ):
        prepare_run_folder(config, out)

    config.trainer.resume_mode = "disable"  # start over: the earlier run is moved aside, not mixed in
    prepare_run_folder(config, out)
    assert "held an earlier run with nothing to resume (metrics.jsonl, checkpoints)" in capsys.readouterr().out
    moved = next((out / "earlier").iterdir())
    assert (moved / "metrics.jsonl").is_file() and (moved / "checkpoints" / "global_step_6").is_dir()
    assert not (out / "metrics.jsonl").exists() and not ckpts.exists()

    (ckpts / "global_step_3").mkdir(parents=True)
    config.trainer.resume_mode = "resume_path"  # the user names the checkpoint: nothing is moved
    prepare_run_folder(config, out)
    assert (ckpts / "global_step_3").is_dir() and capsys.readouterr().out == ""
    config.trainer.resume_mode = "disable"

    elsewhere = tmp_path / "shared_ckpts"
    (elsewhere / "global_step_2").mkdir(parents=True)
    config.trainer.default_local_dir = str(elsewhere)
    with pytest.raises(
        BadInputError,
        match=r"trainer.default_local_dir=.*shared_ckpts holds checkpoints of an "
        r"earlier run",
    ):
        prepare_run_folder(config, out)


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path):
    """Two runs into one --output-dir both ran to the end with their metrics interleaved."""
    import textwrap

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import pathlib, sys, time
        from verl_backend.driver.run_folder import lock_run_folder
        lock_run_folder(pathlib.Path({str(tmp_path)!r}))
        print("locked", flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = _one_error_line(
            verl("train", "--backend", "cpu", "--output-dir", str(tmp_path), "trainer.total_training_steps=1")
        )
        assert f"{tmp_path} is in use by another verl train (pid {holder.pid})" in line, line
    finally:
        holder.kill()
        holder.wait()


def test_reward_kwargs_from_a_yaml_are_added_and_a_plain_key_then_replaces_them(tmp_path):
    """VeRL reads ``reward.custom_reward_function.reward_kwargs`` without declaring it: the default job's
    ``bare_answer_credit`` is added (``+``), and a user's plain ``key=value`` replaces it instead of failing Hydra's
    "Could not override" (control: a key no source added stays plain)."""
    from verl_backend.driver.plan import compose_config, flatten_yaml_overrides, merge_overrides

    job = tmp_path / "job.yaml"
    job.write_text("reward:\n  custom_reward_function:\n    reward_kwargs:\n      bare_answer_credit: 0.5\n")
    file_overrides, _ = flatten_yaml_overrides(job)
    assert file_overrides == ["+reward.custom_reward_function.reward_kwargs.bare_answer_credit=0.5"]
    key = "reward.custom_reward_function.reward_kwargs.bare_answer_credit"
    merged = merge_overrides({}, file_overrides, [f"{key}=1.0", "data.train_batch_size=2"])
    assert merged == [f"+{key}=1.0", "data.train_batch_size=2"]
    config = compose_config(merged)
    assert config.reward.custom_reward_function.reward_kwargs.bare_answer_credit == 1.0
    assert compose_config(merge_overrides({}, file_overrides, [])).reward.custom_reward_function.reward_kwargs == {
        "bare_answer_credit": 0.5
    }
