"""The TPU-profile dry run on CPU: ``verl train --backend cpu --tpu-dry-run`` (``rl_tpu.tpu_dry_run``).

The job runs with the tpu row of ``verl_backend/driver/profiles.py`` with only the device keys swapped: padded micro
batches, a bf16 rollout, VeRL's default bf16 FSDP mixed precision, the bucketed sampler inside the trainer worker
with the CPU fast paths off (from the job's config, not the device), the ``native`` checkpoint engine, in-worker
weight sync, no bypass, no Prefix Grouper, no fork server; four gloo ranks on a fake v6e-4 slice. Where torch-tpu is
installed (``.venv-aot``, as in CI) the TPU profile's compile flags are on with ``rl_tpu.compile_backend=tpu-on-cpu``:
the actor's and reference policy's blocks (forward, backward) and the sampler's prefill and decode run as TorchTPU's
StableHLO on XLA:CPU (:mod:`verl_backend.tpu_on_cpu`), so the bound below holds for the chip's own programs; the run
counts them against the bucket plan and estimates the step on the slice's chip.

The bf16 rollout against the trainer's log-probs is held to mean |Δ| <= 0.05 and max <= 1.0 nats per token
(:func:`within_bound`). VeRL's ``training/rollout_probs_diff_*`` are in probability space, and |Δp| <= |Δ log p|
bounds nothing from above (on a near-uniform model both are tiny in p and not in log p). The e2e run therefore asks
VeRL's own token-level rejection-sampling diagnostics (``algorithm.rollout_correction.rollout_rs=token_k1,token_k2``
with thresholds that reject nothing, checked) for the log ratio r = log pi_trainer - log pi_rollout per token:
max |r| = max(|k1 max|, |k1 min|) exactly, and the root mean square sqrt(E[r^2]) = sqrt(2 E[k2]) >= mean |r|
(Cauchy-Schwarz). The mean itself is checked exactly at unit level (one bf16 side against an fp32 forward); end to
end both sides round in bf16 and only the root mean square is seen, so it is held to ``RMS_BOUND`` (twice the mean
bound), and VeRL's ``log_ppl_abs_diff`` (mean over sequences of |mean r|, a lower bound on the mean) to the mean bound.
The negative control (a decoder layer of the sampler's copy re-initialised: mean |Δ| ~1.2, max ~4.5 nats) is at unit
level, with the same bound check.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from verl_backend.errors import BadInputError

MEAN_BOUND, MAX_BOUND = 0.05, 1.0  # nats per token (issue 17)
RMS_BOUND = 2 * MEAN_BOUND  # end to end, where only E[r^2] is seen and both sides round in bf16 (module docstring)
FAST_PATHS_OFF = {"packed_prefill": False, "lean_decode": False, "packed_weights": False}


def within_bound(mean_abs: float, max_abs: float) -> bool:
    """Whether a rollout/trainer log-prob mismatch (mean and max of |Δ log p| per token, nats) is within the bf16
    bound (mean <= 0.05, max <= 1.0); a NaN is never within it."""
    return bool(mean_abs <= MEAN_BOUND and max_abs <= MAX_BOUND)


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer, 64-wide random Llama whose matrices are drawn with std 0.2 (``tests/families.py``): its next-token
    distributions are peaked, so a bf16 mismatch shows in the log-probs (a near-uniform model hides it)."""
    from families import build_tiny_model

    return build_tiny_model("llama", default_model_dir, tmp_path_factory.mktemp("peaked_llama"), weight_std=0.2)


# --- the profile and the setting -------------------------------------------------------------------------------------


def test_the_dry_run_is_the_tpu_row_with_the_device_keys_swapped():
    from verl_backend.driver.profiles import PROFILES, tpu_dry_run

    dry, tpu = tpu_dry_run(PROFILES["cpu"]), PROFILES["tpu"]
    assert {k: v for k, v in dry.overrides.items() if k != "trainer.device"} == {
        k: v for k, v in tpu.overrides.items() if k != "trainer.device"
    }
    assert dry.overrides["trainer.device"] == "cpu" and dry.platform == "cpu"
    o = dry.overrides
    assert o["actor_rollout_ref.model.use_remove_padding"] == "false"
    assert o["actor_rollout_ref.rollout.dtype"] == "bfloat16"
    assert not [k for k in o if "mixed_precision" in k]  # VeRL's default bf16 FSDP mixed precision
    assert (
        o["+actor_rollout_ref.rollout.engine_kwargs.native"]
        == "{sampler_placement:worker,packed_prefill:false,lean_decode:false,packed_weights:false}"
    )
    assert o["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "native"
    assert o["algorithm.rollout_correction.bypass_mode"] == "false"
    assert o["actor_rollout_ref.actor.use_prefix_grouper"] == "false"
    assert not dry.host_memory and not dry.tpu_runtime and dry.default_slice == "v6e-4"
    assert dry.default_config == PROFILES["cpu"].default_config  # the job (a TPU row has none), not a choice


def test_the_setting_and_its_flag_resolve_and_are_recorded():
    from verl_backend import settings

    assert settings.resolve({}, {}, environ={}).tpu_dry_run is False
    assert settings.resolve({}, {}, environ={}, flags={"--tpu-dry-run": True}).tpu_dry_run is True
    assert settings.resolve({}, {"tpu_dry_run": True}, environ={}).tpu_dry_run is True
    assert settings.as_dict(settings.resolve({"tpu_dry_run": "true"}, {}, environ={}))["tpu_dry_run"] is True
    assert settings.BY_NAME["tpu_dry_run"].reader == "driver"
    assert "rl_tpu.tpu_dry_run=false" in settings.help_table()


@pytest.mark.parametrize(
    "backend, values, env, needle",
    [
        ("tpu", {}, {"RAY_ADDRESS": "127.0.0.1:1"}, "use it with --backend cpu, not --backend tpu"),
        ("cuda", {}, {"RAY_ADDRESS": "127.0.0.1:1"}, "use it with --backend cpu, not --backend cuda"),
        ("cpu", {"compact_malloc": True}, {"RAY_ADDRESS": "127.0.0.1:1"}, "rl_tpu.compact_malloc=true"),
        ("cpu", {"slice": "v6e-1"}, {"RAY_ADDRESS": "127.0.0.1:1"}, "v6e-1 (1 chip)"),
        ("cpu", {}, {}, "rl-tpu cluster up --fake-slice v6e-4"),
    ],
)
def test_what_the_dry_run_cannot_be_is_one_line_naming_the_key(monkeypatch, backend, values, env, needle):
    from verl_backend import settings
    from verl_backend.driver.profiles import PROFILES
    from verl_backend.driver.train import _tpu_dry_run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(BadInputError) as err:
        _tpu_dry_run(
            PROFILES[backend], settings.RlTpuSettings(tpu_dry_run=True, **values), SimpleNamespace(print_config=False)
        )
    line = str(err.value)
    assert "\n" not in line and "tpu_dry_run" in line and needle in line, line


def test_the_default_fake_slice_and_an_explicit_one(monkeypatch):
    from verl_backend import settings
    from verl_backend.driver.profiles import PROFILES
    from verl_backend.driver.train import _tpu_dry_run

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    args = SimpleNamespace(print_config=False)
    backend, resolved = _tpu_dry_run(PROFILES["cpu"], settings.RlTpuSettings(tpu_dry_run=True), args)
    assert resolved.slice == "v6e-4" and backend.overrides["trainer.device"] == "cpu"
    _, resolved = _tpu_dry_run(PROFILES["cpu"], settings.RlTpuSettings(tpu_dry_run=True, slice="v6e-8"), args)
    assert resolved.slice == "v6e-8"
    off = settings.RlTpuSettings()
    assert _tpu_dry_run(PROFILES["cpu"], off, args) == (PROFILES["cpu"], off)


def test_a_fast_path_key_that_is_not_a_bool_is_refused():
    from omegaconf import OmegaConf

    from verl_backend.rollout.sampling import sampler_fast_paths

    assert sampler_fast_paths(OmegaConf.create({"engine_kwargs": {"native": {"sampler_placement": "worker"}}})) == {}
    assert sampler_fast_paths(OmegaConf.create({"engine_kwargs": {"native": FAST_PATHS_OFF}})) == FAST_PATHS_OFF
    with pytest.raises(ValueError, match=r"engine_kwargs\.native\.lean_decode='no'"):
        sampler_fast_paths(OmegaConf.create({"engine_kwargs": {"native": {"lean_decode": "no"}}}))


# --- the bf16 bucketed sampler against an fp32 forward, and the negative control -------------------------------------


def _mismatch(sampler, model_dir: Path) -> tuple[float, float, int]:
    """Sample 4 chat prompts x 24 tokens (temperature 1, seeded) and compare each sampled token's log-prob with an
    fp32 Hugging Face forward of the same model over prompt + response: (mean |Δ|, max |Δ|, tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_tpu.sampler.params import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is 12 + 7?", "Name a colour.", "Write a haiku about rain.", "What is the capital of France?"]
    prompts = [
        list(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for q in questions
    ]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = sampler.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=24, seed=0))
    diffs = []
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
        at = logp[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
        fp32 = at.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        diffs.append((fp32 - torch.tensor(out.logprobs, dtype=torch.float32)).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item(), d.numel()


def test_bf16_bucketed_sampler_is_within_the_bound_and_a_reinitialised_layer_is_not(peaked_model_dir, job_settings):
    from omegaconf import OmegaConf

    from verl_backend.driver.profiles import PROFILES, tpu_dry_run
    from verl_backend.rollout.sampling import build_sampler

    native = tpu_dry_run(PROFILES["cpu"]).overrides["+actor_rollout_ref.rollout.engine_kwargs.native"]
    rollout = OmegaConf.create(
        {
            "dtype": "bfloat16",
            "prompt_length": 64,
            "response_length": 32,
            "max_num_seqs": 8,
            "engine_kwargs": {"native": OmegaConf.create(yaml.safe_load(native.replace(":", ": ").replace(",", ", ")))},
        }
    )
    sampler = build_sampler(str(peaked_model_dir), rollout, "cpu")
    # the TPU profile's sampler on a CPU device: no fast path, bucketed padded prefill, bf16
    assert (sampler.packed_prefill, sampler.lean_decode, sampler.packed) == (False, False, None)
    assert next(sampler.model.parameters()).dtype == torch.bfloat16
    mean, most, n = _mismatch(sampler, peaked_model_dir)
    print(f"bf16 bucketed sampler vs fp32 forward: {n} tokens, mean |Δ| {mean:.4f}, max {most:.4f} nats")
    assert n >= 64 and within_bound(mean, most), (mean, most)
    assert mean > 1e-4  # bf16 really sampled: not the fp32 model's own numbers
    assert {s[1] for s in sampler.shapes_seen} <= {1, 64}  # padded prefill to the 64 bucket, then 1-token decode

    layer = sampler.model.model.layers[1]  # negative control: one decoder layer of the rollout's copy re-initialised
    torch.manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, sampler.model.config.initializer_range) if p.dim() >= 2 else p.fill_(1.0)
    bad_mean, bad_max, _ = _mismatch(sampler, peaked_model_dir)
    print(f"with layer 1 re-initialised: mean |Δ| {bad_mean:.4f}, max {bad_max:.4f} nats")
    assert not within_bound(bad_mean, bad_max), (bad_mean, bad_max)


# --- end to end: 2 steps on a fake v6e-4 slice -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_v6e_4(tmp_path_factory):
    """A fake v6e-4 slice (head + one 4-chip host) for this module, stopped by pid at the end."""
    from e2e_helpers import fake_cluster

    with fake_cluster(["v6e-4"], tmp_path_factory.mktemp("cluster") / "state.json") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def dry_run(fake_v6e_4, peaked_model_dir, tmp_path_factory):
    import subprocess
    import sys

    from e2e_helpers import train_env, write_reward

    out = tmp_path_factory.mktemp("tpu_dry_run")
    env = dict(train_env(), RAY_ADDRESS=fake_v6e_4.address, RAY_DEDUP_LOGS="0")  # every rank's lines, undeduplicated
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--tpu-dry-run",
        "--output-dir",
        str(out),
        "--max-restarts",
        "0",
        f"actor_rollout_ref.model.path={peaked_model_dir}",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=2",
        "rl_tpu.train_size=8",
        "rl_tpu.val_size=4",
        "rl_tpu.slice_timeout_s=180",
        # 2 prompts x 2 samples = 4 sequences: one per rank
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "rl_tpu.compile_trainer=true",  # the TPU profile's compiled training step, on its padded micro batches
        # VeRL's token-level log-ratio diagnostics (module docstring); these thresholds reject nothing
        "algorithm.rollout_correction.rollout_rs='token_k1,token_k2'",
        "algorithm.rollout_correction.rollout_rs_threshold='1e-9_1e9,1e9'",
        *write_reward(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    (out / "driver.log").write_text(proc.stdout + proc.stderr)  # kept for a look after a failure
    return out, proc, proc.stdout + proc.stderr


@pytest.mark.slow
def test_dry_run_used_the_tpu_choices(dry_run):
    out, proc, log = dry_run
    assert proc.returncode == 0, log[-5000:]
    config = yaml.safe_load((out / "config.yaml").read_text())
    aro = config["actor_rollout_ref"]
    assert config["rl_tpu"]["tpu_dry_run"] is True and config["rl_tpu"]["slice"] == "v6e-4:2x2"
    assert config["trainer"]["device"] == "cpu"
    assert config["trainer"]["nnodes"] * config["trainer"]["n_gpus_per_node"] == 4
    assert aro["model"]["use_remove_padding"] is False
    assert aro["rollout"]["dtype"] == "bfloat16"
    # no mixed_precision key: VeRL 0.9.1's FSDP engine then computes in bf16, reduces and buffers in fp32
    # (verl/workers/engine/fsdp/transformer_impl.py), over fp32 master weights
    assert aro["actor"]["fsdp_config"].get("mixed_precision") is None
    assert aro["actor"]["fsdp_config"]["model_dtype"] == "fp32"
    assert aro["rollout"]["engine_kwargs"]["native"] == {"sampler_placement": "worker", **FAST_PATHS_OFF}
    assert aro["rollout"]["checkpoint_engine"]["backend"] == "native"
    assert config["algorithm"]["rollout_correction"]["bypass_mode"] is False
    assert aro["actor"]["use_prefix_grouper"] is False
    assert not config["ray_kwargs"]["ray_init"]["runtime_env"].get("py_executable")  # no fork server
    assert re.search(
        r"resource pool global_pool: slice v6e-4 \(fake-v6e-4-[^)]*\) reserved with ray\.util\.tpu, "
        r"4 workers, host of each: \[0, 0, 0, 0\]",
        log,
    ), log[-3000:]
    # four ranks, each with its own bf16 sampler, fast paths off, synced in process
    from verl_backend.tpu_on_cpu import aot_python_path

    compiled = "on" if aot_python_path() else "off"  # the sampler's steps as TorchTPU's graphs where it is installed
    samplers = re.findall(
        r"\[rl-tpu\] native sampler \(torch\.bfloat16, cpu\): packed prefill off, lean decode off, "
        rf"packed weights off, compiled {compiled}",
        log,
    )
    assert len(samplers) == 4, samplers
    routes = set(
        re.findall(
            r"weight sync route: planned in_worker, took in_worker, because [^\n]*?"
            r"\(trainer rank (\d) -> rollout replica \d: in the trainer worker",
            log,
        )
    )
    assert routes == {"0", "1", "2", "3"}, routes
    assert re.search(r"\[rl-tpu\] actor: FSDP2 wraps the model \(several ranks", log)  # said by rank 0
    assert "so the model runs unwrapped" not in log
    # compiled blocks (rl_tpu.compile_trainer) in every actor and reference policy, graphs bounded, never eager again
    assert (
        len(re.findall(r"\[rl-tpu\] compiled trainer blocks: 2 blocks of the actor compile per input shape", log)) == 4
    )
    assert "runs eagerly" not in log
    graphs = [int(n) for n in re.findall(r"compiled trainer blocks: graph (\d+) of at most 16", log)]
    assert graphs and max(graphs) <= 4, graphs  # per process: buckets x {update, no-grad forward}, over 2 steps


@pytest.mark.slow
def test_dry_run_ran_torch_tpu_graphs_on_xla_cpu_within_the_bucket_plan(dry_run):
    """rl_tpu.compile_backend=tpu-on-cpu, the dry run's default where torch-tpu is installed: every compiled region
    ran as TorchTPU's StableHLO on XLA:CPU (none as torch eager), each graph within the job's bucket plan, counted
    per kind in the summary and its last lines, with a step estimated on the slice's chip; without torch-tpu, one
    line says the model runs eager."""
    from verl_backend.tpu_on_cpu import aot_python_path

    out, proc, log = dry_run
    assert proc.returncode == 0, log[-5000:]
    if aot_python_path() is None:
        assert "not as TorchTPU's graphs (torch-tpu not installed: .ci/aot_venv)" in log
        return
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["rl_tpu"]["compile_backend"] == "tpu-on-cpu" and config["rl_tpu"]["compile_sampler"] is True
    assert config["rl_tpu"]["compile_cache_dir"] == str(out / "tpu-on-cpu")
    assert "runs as torch eager" not in log, [ln for ln in log.splitlines() if "torch eager" in ln][:3]
    assert "compiled steps off" not in log
    entry = json.loads((out / "summary.json").read_text())["tpu_on_cpu"]
    assert entry["eager"] == 0 and entry["outside_plan"] == [], entry["line"]
    kinds = entry["by_kind"]
    assert {"sampler.inf", "actor.block.fwd", "actor.block.bwd", "reference.block.inf"} <= set(kinds), kinds
    assert all(k["executions"] > 0 for k in kinds.values()), kinds
    # 2 steps: each kind's distinct graphs are a handful of buckets, not one per step or per block
    assert kinds["actor.block.bwd"]["distinct"] <= 2 and kinds["sampler.inf"]["distinct"] <= 8, kinds
    assert f"[rl-tpu] TPU graphs (tpu-on-cpu): {entry['line']}" in log
    estimate = entry["step_estimate"]
    assert estimate.get("error") is None and estimate["generation"] == "v6e", estimate
    assert 0 < estimate["graphs_s"] < estimate["step_s"] and estimate["collectives_s"] > 0
    assert estimate["cpu_step_s"] > 1000 * estimate["step_s"]  # a 2-core host against a v6e chip
    assert f"[rl-tpu] TPU step estimate: {estimate['line']}" in log
    print(f"tpu-on-cpu: {entry['line']}\nestimate: {estimate['line']}")


@pytest.mark.slow
def test_dry_run_lowered_and_compiled_its_graphs_for_the_fake_slice(dry_run):
    """rl_tpu.tpu_dry_run_compile (default on): the job's graphs (aot/graphs.json, the list --aot-only lowers for the
    same job: test_tpu_dry_run_compile.py) lowered by TorchTPU and compiled by libtpu for v6e:2x2 beside the training,
    in the summary and its last lines; without .venv-aot, skipped in one line, the run unharmed."""
    from verl_backend.driver.aot.dry_run import SKIPPED_NO_TORCH_TPU
    from verl_backend.driver.aot.graphs import WITH_BACKWARD, graph_list, graph_list_differences
    from verl_backend.driver.aot.run import AotError, aot_python

    out, proc, log = dry_run
    assert proc.returncode == 0, log[-5000:]
    from omegaconf import OmegaConf

    config = OmegaConf.load(out / "config.yaml")  # its interpolations resolved where read, as in the driver
    recorded = json.loads((out / "aot" / "graphs.json").read_text())
    assert graph_list_differences(recorded, graph_list(config)) == []
    entry = json.loads((out / "summary.json").read_text())["tpu_compile"]
    lines = [ln for ln in log.splitlines() if ln.startswith("[rl-tpu] TPU compile check: ")]
    assert lines[-1] == f"[rl-tpu] TPU compile check: {entry['line']}", lines
    try:
        aot_python()
    except AotError:
        assert entry["status"] == "skipped" and entry["line"] == SKIPPED_NO_TORCH_TPU
        return
    assert entry["status"] == "compiled", entry["line"]
    with_backward = sum(g["kind"] in WITH_BACKWARD for g in recorded)  # block, lm_head: fwd + bwd
    assert entry["topology"] == "v6e:2x2" and entry["compiled"] == len(recorded) + with_backward
    assert 0 < entry["per_chip"]["training_peak"] < entry["hbm_bytes"] == 32 * 2**30
    print(f"compile check: {entry['seconds']:.0f} s beside training, waited {entry['waited_s']:.1f} s after it")


@pytest.mark.slow
def test_dry_run_trains_and_its_bf16_rollout_matches_the_trainer(dry_run):
    from e2e_helpers import train_rows

    out, proc, log = dry_run
    assert proc.returncode == 0, log[-5000:]
    rows = train_rows(out)
    assert len(rows) == 2
    worst_rms = worst_max = worst_seq = 0.0
    spread_steps = 0
    for step, m in enumerate(rows, start=1):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert math.isfinite(m[key]), key
        # a step whose groups each scored alike has zero advantages and (the policy still the reference at step 1)
        # no gradient: the random model's samples tie under the length reward now and then (a CI run drew it), so
        # a gradient is asserted where some group's rewards differ
        groups: dict[str, set[float]] = {}
        for line in (out / "rollouts" / f"{step}.jsonl").read_text().splitlines():
            row = json.loads(line)
            groups.setdefault(row["input"], set()).add(row["score"])
        if any(len(scores) > 1 for scores in groups.values()):
            spread_steps += 1
            assert m["actor/grad_norm"] > 0, step
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0  # the diagnostics rejected nothing
        # every rank's in-worker sampler verified its sync: the bf16 probe (FSDP2 forward, eager beside the compiled
        # blocks: no extra graph) within the 16-bit bound, the fingerprints equal
        assert m["weight_sync/verified"] == 1.0, {k: v for k, v in m.items() if k.startswith("weight_sync/")}
        r_max = max(abs(m["rollout_corr/rollout_rs_token_k1_max"]), abs(m["rollout_corr/rollout_rs_token_k1_min"]))
        rms = math.sqrt(2 * m["rollout_corr/rollout_rs_token_k2_mean"])
        worst_rms, worst_max = max(worst_rms, rms), max(worst_max, r_max)
        worst_seq = max(worst_seq, m["rollout_corr/log_ppl_abs_diff"])
    print(
        f"dry run, bf16 rollout vs bf16-mixed-precision trainer: root mean square {worst_rms:.4f} (>= mean |Δ|), "
        f"max {worst_max:.4f}, per-sequence |mean Δ| {worst_seq:.4f} (<= mean |Δ|) nats per token"
    )
    assert spread_steps, "no step had a group whose rewards differ: the run trained on nothing"
    assert worst_max > 0  # the rollout's own log-probs were compared, not the trainer's twice
    assert worst_rms <= RMS_BOUND and worst_max <= MAX_BOUND, (worst_rms, worst_max)
    assert worst_seq <= MEAN_BOUND, worst_seq


@pytest.mark.slow
def test_dry_run_checkpoint_loads_and_weights_changed(dry_run, peaked_model_dir):
    from transformers import AutoModelForCausalLM

    out, proc, log = dry_run
    assert proc.returncode == 0, log[-5000:]
    ckpt = out / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(peaked_model_dir, dtype=torch.float32)
    deltas = [
        (a - b).abs().max().item() for (_, a), (_, b) in zip(trained.state_dict().items(), initial.state_dict().items())
    ]
    assert max(deltas) > 1e-4
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
