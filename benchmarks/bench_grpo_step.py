"""Seconds per GRPO step and peak memory: ``verl train --backend cpu`` (VeRL 0.9.1 on our backend)
vs TRL's ``GRPOTrainer``.

Both sides train the same model (SmolLM2-135M-Instruct, float32, from ``verl_backend.models.ensure_default_model``)
on the same task (reasoning-gym ``basic_arithmetic``: the parquet that ``verl train`` writes is what TRL reads), with
the same reward (:func:`verl_backend.data.rewards.compute_score`), batch (4 prompts x 4 samples = 16 completions,
one optimizer step per GRPO step), lengths (prompt <= 128 tokens, completion <= 64 tokens), learning rate (1e-5,
constant), KL coefficient (0.001, k3 / low_var_kl estimator), clip 0.2, token-mean loss, AdamW weight decay 0.01,
grad-norm clip 1.0, sampling temperature 1.0, and torch thread count (``--threads`` per process). They run one after
the other (ours, then TRL), each in its own process tree, so they share no memory.

Gradient checkpointing is the one setting where the two defaults differ: TRL 1.16's ``GRPOConfig`` turns it on
(recompute activations in the backward: slower update, less memory), our CPU default leaves VeRL's off. By default
TRL runs twice, once each way, and the table gives the ratio to both.

Both run with glibc's default allocator settings. ``RL_TPU_COMPACT_MALLOC=1`` (set it for this script to have our run
use it) starts every process of ``verl train --backend cpu`` with settings that keep the trainer's backward from
fragmenting the heap, at the price of speed (``verl_backend.host_memory.heap.HOST_MALLOC_ENV``); ``--trl-malloc tuned``
(or ``both``) runs TRL with the same settings.

Step times are the mean over steps 2..N (step 1 is warm-up). Columns:

- ``rollout``: ours ``timing_s/gen`` (agent loop: generation by the rollout server, plus reward scoring); TRL
  ``transformers.generate`` + the reward function (TRL's own profiling contexts).
- ``log-prob (old+ref)``: ours ``timing_s/old_log_prob + timing_s/ref``; TRL every no-grad
  ``_get_per_token_logps_and_entropies`` call. TRL computes *no* old log-probs when each batch is used for exactly one
  optimizer step (its ratio is then 1 by construction), so its figure is the reference forward only.
- ``update``: ours ``timing_s/update_actor``; TRL step time minus ``_prepare_inputs`` (that is: loss forward,
  backward, grad clip, optimizer step).
- ``weight sync``: ours ``timing_s/update_weights`` (trainer -> rollout server); TRL generates with the model it
  trains, so it has none.
- ``s/step``: ours ``timing_s/step``; TRL wall time from ``on_step_begin`` to ``on_step_end`` (a ``TrainerCallback``).

Memory: a thread samples every 0.5 s every process that carries this run's marker environment variable (set on the
child that starts the run and inherited by everything it starts, including Ray's gcs/raylet and every ``ray::``
worker, even when re-parented), with its own ``RAY_TMPDIR`` so it never joins another Ray cluster on the machine.
``peak RSS total`` is the largest summed RSS seen in one sample; RSS counts shared pages (torch libraries, Ray's
shared-memory object store) once *per process*, so it overstates a many-process job: ``peak PSS total`` shares them
out and is the fairer total. ``peak RSS largest`` is the largest single process seen at any sample. Peaks cover the
whole run (start-up, model load, all steps).

    python benchmarks/bench_grpo_step.py [--steps 3] [--threads 1] [--out grpo_step.json] [--keep DIR]
        [--only ours|trl] [--trl-gradient-checkpointing on|off|both]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import psutil

MARKER = "RL_TPU_BENCH_RUN"
GIB = float(1 << 30)
BATCH_PROMPTS, N_SAMPLES, MAX_PROMPT, MAX_COMPLETION, LR, KL_COEF = 4, 4, 128, 64, 1e-5, 0.001


class BenchError(RuntimeError):
    """A run failed; the message names the run, its log file and the last lines of it."""


# ------------------------------------------------------------------------------------------------ memory
class MemorySampler(threading.Thread):
    """Every ``interval`` s: RSS/PSS of every process whose environment has ``MARKER=<run id>``."""

    def __init__(self, run_id: str, interval: float = 0.5, step_log: Path | None = None):
        super().__init__(daemon=True)
        self.run_id, self.interval, self.step_log = run_id, interval, step_log
        self.step_cpu_marks: list[float] = []  # summed CPU seconds when each step's metrics line appeared
        self._stop_event = threading.Event()
        self._ours: dict[tuple[int, float], bool] = {}
        self.peak_rss_total = self.peak_pss_total = self.peak_rss_largest = 0
        self.largest_name, self.max_processes, self.samples = "", 0, 0
        self.names: set[str] = set()
        self.peak_breakdown: dict[str, list[float]] = {}  # role -> [processes, PSS bytes] at the peak PSS sample
        self._cpu_s: dict[tuple[int, float], float] = {}  # last seen user+sys seconds per process (kept after exit)

    def processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["pid", "create_time"]):
            key = (p.pid, p.info["create_time"])
            ours = self._ours.get(key)
            if ours is None:
                try:
                    ours = p.environ().get(MARKER) == self.run_id
                except psutil.Error:  # gone, a zombie, or not readable: look again next sample
                    continue
                self._ours[key] = ours
            if ours:
                found.append(p)
        return found

    @staticmethod
    def _role(cmdline: list[str], name: str) -> str:
        """A process's role: ``ray::WorkerDict``, ``raylet``, ``gcs_server``, ``python ... dashboard/agent.py``."""
        if not cmdline:
            return name
        head = cmdline[0]
        if head.startswith("ray::"):
            return head.split(".")[0].split(" ")[0]
        script = next((a for a in cmdline[1:3] if a.endswith(".py") or a.startswith("-m")), "")
        return (Path(head).name + (" " + "/".join(Path(script).parts[-2:]) if script else ""))[:60]

    def sample(self) -> None:
        rss_total = pss_total = n = 0
        by_role: dict[str, list[float]] = {}
        for p in self.processes():
            try:
                mem = p.memory_full_info()  # rss + pss from /proc/<pid>/smaps_rollup
                cpu = p.cpu_times()
                self._cpu_s[(p.pid, p.create_time())] = cpu.user + cpu.system
                name = " ".join(p.cmdline()[:2])[:60] or p.name()
            except psutil.Error:
                continue
            n += 1
            rss_total += mem.rss
            pss_total += getattr(mem, "pss", mem.rss)
            try:
                role = self._role(p.cmdline(), p.name())
            except psutil.Error:
                role = "?"
            by_role.setdefault(role, [0, 0.0])
            by_role[role][0] += 1
            by_role[role][1] += getattr(mem, "pss", mem.rss)
            self.names.add(name.split(" ")[0])
            if mem.rss > self.peak_rss_largest:
                self.peak_rss_largest, self.largest_name = mem.rss, name
        self.peak_rss_total = max(self.peak_rss_total, rss_total)
        if pss_total > self.peak_pss_total:
            self.peak_pss_total, self.peak_breakdown = pss_total, by_role
        self.max_processes = max(self.max_processes, n)
        self.samples += 1
        if self.step_log is not None and self.step_log.is_file():
            done = self.step_log.read_text(errors="replace").count('"timing_s/step"')
            while len(self.step_cpu_marks) < done:
                self.step_cpu_marks.append(sum(self._cpu_s.values()))

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> dict:
        self._stop_event.set()
        self.join()
        return {
            "peak_rss_total_gib": self.peak_rss_total / GIB,
            "peak_pss_total_gib": self.peak_pss_total / GIB,
            "peak_rss_largest_gib": self.peak_rss_largest / GIB,
            "largest_process": self.largest_name,
            "max_processes": self.max_processes,
            "cpu_s": sum(self._cpu_s.values()),
            "step_cpu_marks": self.step_cpu_marks,
            "samples": self.samples,
            "pss_at_peak_gib_by_role": {
                k: [int(c), b / GIB] for k, (c, b) in sorted(self.peak_breakdown.items(), key=lambda kv: -kv[1][1])
            },
        }


def run_sampled(
    name: str, cmd: list[str], env: dict, log: Path, timeout_s: float, step_log: Path | None = None
) -> tuple[dict, float]:
    """Run ``cmd`` with a fresh marker under the memory sampler; return (memory summary, wall seconds)."""
    run_id = uuid.uuid4().hex
    env = {**env, MARKER: run_id}
    sampler = MemorySampler(run_id, step_log=step_log)
    sampler.start()
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
    wall = time.perf_counter() - start
    leftovers = _wait_gone(sampler, grace_s=30.0)
    memory = sampler.stop()
    memory["leftover_processes_killed"] = leftovers
    memory["load_average_1min_start_end"] = [load_start, os.getloadavg()[0]]
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"exited {rc}"
        raise BenchError(f"{name} {why}; full log {log}; last lines:\n{tail}")
    return memory, wall


def _wait_gone(sampler: MemorySampler, grace_s: float) -> list[str]:
    """Give the run's processes (Ray's included) ``grace_s`` to exit; kill what is left, by pid; name them."""
    deadline = time.time() + grace_s
    while time.time() < deadline:
        left = sampler.processes()
        if not left:
            return []
        time.sleep(1.0)
    killed = []
    for p in sampler.processes():
        try:
            killed.append(f"{p.pid} {' '.join(p.cmdline()[:2])[:60]}")
            p.kill()
        except psutil.Error:
            pass
    return killed


def _mean_after_warmup(values: list[float]) -> float | None:
    rest = [v for v in (values[1:] if len(values) > 1 else values) if v is not None]
    return sum(rest) / len(rest) if rest else None


# ------------------------------------------------------------------------------------------------ ours
def _prepare_train_file(work: Path) -> str:
    """The parquet ``verl train`` would write for the default job (for a TRL-only run)."""
    out = work / "verl" / "data"
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(work / "verl"),
        "--print-config",
    ]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    found = sorted(out.glob("*_train.parquet"))
    if not found:
        raise BenchError(f"no train parquet under {out} after `verl train --print-config`")
    return str(found[0])


# The config compared with TRL, pinned: the default job's recipe may change (docs/recipe.md) without the comparison
# changing with it. These are the TRL side's settings (4 prompts x 4 samples, temperature 1.0, lr 1e-5, KL loss).
PINNED = [
    "actor_rollout_ref.rollout.temperature=1.0",
    f"actor_rollout_ref.rollout.n={N_SAMPLES}",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "data.max_response_length=64",
]


def run_ours(work: Path, steps: int, threads: int, timeout_s: float, overrides: list[str] | None = None) -> dict:
    out = work / "verl"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # short: Ray's unix socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(ray_tmp), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)
    )
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--num-threads",
        str(threads),
        "--output-dir",
        str(out),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        *PINNED,
        *(overrides or []),
    ]
    try:
        memory, wall = run_sampled(
            "ours (verl train --backend cpu)", cmd, env, work / "verl.log", timeout_s, step_log=out / "metrics.jsonl"
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "timing_s/step" in r["data"]), key=lambda r: r["step"])
    if len(rows) < steps:
        raise BenchError(f"ours: metrics.jsonl in {out} has {len(rows)} training steps, expected {steps}")

    def col(*keys: str) -> list[float]:
        return [sum(float(r["data"].get(k, 0.0)) for k in keys) for r in rows]

    return {
        "framework": "ours: verl train --backend cpu"
        + "".join(
            f" {k}={v}"
            for k, v in sorted(os.environ.items())
            if k in ("RL_TPU_COMPACT_MALLOC", "RL_TPU_FORK_SERVER", "RL_TPU_TASK_RUNNER", "RL_TPU_SHARED_WEIGHTS")
        )
        + (f" ({' '.join(overrides)})" if overrides else ""),
        "steps": len(rows),
        "step_s": col("timing_s/step"),
        "rollout_s": col("timing_s/gen"),
        "logprob_s": col("timing_s/old_log_prob", "timing_s/ref"),
        "update_s": col("timing_s/update_actor"),
        "weight_sync_s": col("timing_s/update_weights"),
        # CPU seconds of all the run's processes between two steps' metrics lines (0.5 s sampling); step 1: unknown
        "cpu_step_s": [None] + [b - a for a, b in zip(memory["step_cpu_marks"], memory["step_cpu_marks"][1:])],
        "completion_tokens_mean": col("response_length/mean"),
        "reward_mean": col("critic/score/mean"),
        "wall_s": wall,
        "memory": memory,
        "train_file": str(next((out / "data").glob("*_train.parquet"))),
    }


# ------------------------------------------------------------------------------------------------ TRL
def run_trl(
    work: Path,
    train_file: str,
    steps: int,
    threads: int,
    timeout_s: float,
    gradient_checkpointing: bool = True,
    tuned_malloc: bool = False,
) -> dict:
    tag = f"gc{int(gradient_checkpointing)}" + ("_malloc" if tuned_malloc else "")
    result = work / f"trl_result_{tag}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        }
    )
    if tuned_malloc:  # the glibc settings RL_TPU_COMPACT_MALLOC=1 gives the processes of `verl train --backend cpu`
        from verl_backend.host_memory.heap import HOST_MALLOC_ENV

        env.update(HOST_MALLOC_ENV)
    cmd = [
        sys.executable,
        __file__,
        "--trl-worker",
        "--train-file",
        train_file,
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--work",
        str(work),
        "--result",
        str(result),
        "--trl-gradient-checkpointing",
        "on" if gradient_checkpointing else "off",
    ]
    memory, wall = run_sampled("TRL GRPOTrainer", cmd, env, work / f"trl_{tag}.log", timeout_s)
    out = json.loads(result.read_text())
    if tuned_malloc:
        out["framework"] += ", compact malloc settings"
    out.update(wall_s=wall, memory=memory)
    return out


def trl_worker(args) -> None:
    """Runs in its own process: TRL ``GRPOTrainer`` for ``args.steps`` steps; writes per-step timings as JSON."""
    import pandas as pd
    import torch

    torch.set_num_threads(args.threads)
    import trl.extras.profiling as profiling
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_backend.data.rewards import compute_score
    from verl_backend.models import ensure_default_model

    model_dir = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    # The GGUF-converted tokenizer names <|im_start|> as EOS; our rollout stops at <|im_end|> too (it adds the
    # generation config's EOS). TRL stops and masks at the tokenizer's EOS only, so give it <|im_end|>.
    if tok.convert_tokens_to_ids("<|im_end|>") not in (None, tok.unk_token_id):
        tok.eos_token = "<|im_end|>"
    rows = []
    for r in pd.read_parquet(args.train_file).itertuples(index=False):
        prompt = [dict(m) for m in r.prompt]
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if len(ids["input_ids"] if hasattr(ids, "keys") else ids) > MAX_PROMPT:
            continue  # what data.filter_overlong_prompts=true does on our side (TRL 1.16 has no max_prompt_length)
        rows.append(
            {
                "prompt": prompt,
                "data_source": r.data_source,
                "ground_truth": r.reward_model["ground_truth"],
                "extra_info": dict(r.extra_info),
            }
        )
    dataset = Dataset.from_list(rows)

    def arithmetic_reward(completions, data_source, ground_truth, extra_info, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            float(compute_score(d, t, g, e)["score"])
            for d, t, g, e in zip(data_source, texts, ground_truth, extra_info)
        ]

    # TRL times its parts with ProfilingContext but only reports them to wandb/mlflow/trackio: record them here.
    step_parts: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    current = {"step": 0}
    original_log = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:
        name = self.name.split(".", 1)[1]
        if name == "_get_per_token_logps_and_entropies":
            name += ".no_grad" if not torch.is_grad_enabled() else ".grad"
        step_parts[current["step"]][name] += duration
        original_log(self, duration)

    profiling.ProfilingContext._log_metrics = record

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s, self.cpu_step_s, self.logs, self._t0, self._c0 = [], [], [], 0.0, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            current["step"] = state.global_step + 1
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._t0)
            self.cpu_step_s.append(time.process_time() - self._c0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=BATCH_PROMPTS * N_SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=N_SAMPLES,
        max_completion_length=MAX_COMPLETION,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=KL_COEF,
        epsilon=0.2,
        loss_type="dapo",
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=1,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=args.trl_gradient_checkpointing == "on",
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.train()

    steps = sorted(s for s in step_parts if s >= 1)  # step 0: what ran before training (none so far)
    part = lambda *names: [sum(step_parts[s].get(n, 0.0) for n in names) for s in steps]  # noqa: E731
    train_logs = [entry for entry in timer.logs if "completions/mean_length" in entry]
    result = {
        "framework": f"TRL {__import__('trl').__version__} GRPOTrainer, gradient checkpointing "
        f"{args.trl_gradient_checkpointing}"
        + (" (TRL's default)" if args.trl_gradient_checkpointing == "on" else " (as ours)"),
        "steps": len(timer.step_s),
        "step_s": timer.step_s,
        "rollout_s": part("transformers.generate", "arithmetic_reward"),
        "logprob_s": part("_get_per_token_logps_and_entropies.no_grad"),
        "update_s": [t - p for t, p in zip(timer.step_s, part("_prepare_inputs"))],
        "weight_sync_s": [0.0] * len(timer.step_s),
        "cpu_step_s": timer.cpu_step_s,
        "completion_tokens_mean": [float(e["completions/mean_length"]) for e in train_logs],
        "reward_mean": [float(e.get("reward", float("nan"))) for e in train_logs],
        "trl_step_time_s": [float(e["step_time"]) for e in train_logs if "step_time" in e],
        "trl_profiled_s": {str(s): dict(step_parts[s]) for s in steps},
        "prompts_kept": len(rows),
    }
    Path(args.result).write_text(json.dumps(result, indent=1))


# ------------------------------------------------------------------------------------------------ report
COLUMNS = [
    ("s/step", "step_s"),
    ("rollout s", "rollout_s"),
    ("log-prob s (old+ref)", "logprob_s"),
    ("update s", "update_s"),
    ("weight sync s", "weight_sync_s"),
    ("CPU s/step", "cpu_step_s"),
    ("completion tok", "completion_tokens_mean"),
]
MEMORY = [
    ("peak RSS total GiB", "peak_rss_total_gib"),
    ("peak RSS largest proc GiB", "peak_rss_largest_gib"),
    ("peak PSS total GiB", "peak_pss_total_gib"),
    ("procs", "max_processes"),
    ("CPU s whole run", "cpu_s"),
]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(results: list[dict]) -> str:
    head = ["framework"] + [c for c, _ in COLUMNS] + [c for c, _ in MEMORY]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["framework"]] + [_fmt(r["mean"][k]) for _, k in COLUMNS]
        cells += [f"{r['memory'][k]:.2f}" if k != "max_processes" else str(r["memory"][k]) for _, k in MEMORY[:-1]]
        cells.append(f"{r['memory']['cpu_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    ours = next((r for r in results if r["framework"].startswith("ours")), None)

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "n/a"

    for trl in (r for r in results if ours is not None and r is not ours):
        gc = ("GC on" if "checkpointing on" in trl["framework"] else "GC off") + (
            ", compact malloc" if "malloc" in trl["framework"] else ""
        )
        cells = [f"ratio ours/TRL ({gc})"] + [ratio(ours["mean"][k], trl["mean"][k]) for _, k in COLUMNS]
        cells += [ratio(ours["memory"][k], trl["memory"][k]) for _, k in MEMORY]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per framework (step 1 is warm-up; >= 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process, both frameworks")
    ap.add_argument("--out", help="also write the results as JSON to this file")
    ap.add_argument("--keep", help="keep run folders (logs, metrics.jsonl, data) here instead of a temp folder")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per framework run")
    ap.add_argument("--only", choices=["ours", "trl"], help="run one side only (no ratio row)")
    ap.add_argument(
        "--ours-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra VeRL override for our run (to try a setting); the table says it was used",
    )
    ap.add_argument(
        "--trl-gradient-checkpointing",
        choices=["on", "off", "both"],
        default="both",
        help="TRL's gradient checkpointing: on (TRL 1.16's default), off (as our CPU default), or both "
        "(two TRL runs; default)",
    )
    ap.add_argument(
        "--trl-malloc",
        choices=["default", "tuned", "both"],
        default="default",
        help="glibc malloc settings of the TRL process: default (what a TRL user gets), tuned (the ones "
        "RL_TPU_COMPACT_MALLOC=1 gives verl train, verl_backend.host_memory.heap.HOST_MALLOC_ENV), or "
        "both (twice the TRL runs)",
    )
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--train-file", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return 0
    if args.steps < 2 or args.threads < 1:
        print("bench_grpo_step: error: --steps must be >= 2 (step 1 is warm-up) and --threads >= 1", file=sys.stderr)
        return 2
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="bench_grpo_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = []
        if args.only != "trl":
            print(f"[bench] ours: verl train --backend cpu, {args.steps} steps, logs in {work}", flush=True)
            ours = run_ours(work, args.steps, args.threads, args.timeout, args.ours_override)
            results.append(ours)
            print(f"[bench] ours done in {ours['wall_s']:.0f} s", flush=True)
            train_file = ours["train_file"]
        else:
            train_file = _prepare_train_file(work)
        if args.only != "ours":
            modes = {"on": [True], "off": [False], "both": [True, False]}[args.trl_gradient_checkpointing]
            mallocs = {"default": [False], "tuned": [True], "both": [False, True]}[args.trl_malloc]
            for gc in modes:
                for tuned in mallocs:
                    print(
                        f"[bench] TRL GRPOTrainer (gradient checkpointing {'on' if gc else 'off'}, "
                        f"{'compact' if tuned else 'default'} malloc settings), {args.steps} steps",
                        flush=True,
                    )
                    results.append(run_trl(work, train_file, args.steps, args.threads, args.timeout, gc, tuned))
    except BenchError as exc:
        print(f"bench_grpo_step: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for r in results:
        r["mean"] = {k: _mean_after_warmup(r[k]) for _, k in COLUMNS}
    load = os.getloadavg()
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"results": results, "load_average": load, "steps": args.steps, "threads": args.threads}, indent=1
            )
        )
    print(
        f"\nGRPO step, SmolLM2-135M-Instruct fp32, basic_arithmetic, {BATCH_PROMPTS} prompts x {N_SAMPLES} samples, "
        f"prompt <= {MAX_PROMPT} / completion <= {MAX_COMPLETION} tokens, lr {LR}, {args.threads} torch thread(s) "
        f"per process; mean of steps 2..{args.steps}; {os.cpu_count()} CPUs, load average {load[0]:.1f}\n"
    )
    print(table(results))
    for r in results:
        print(
            f"\n{r['framework']}: wall {r['wall_s']:.0f} s ({r['wall_s'] - sum(r['step_s']):.0f} s outside steps), "
            f"step s {[round(s, 1) for s in r['step_s']]}, largest process: {r['memory']['largest_process']!r}, "
            f"load average start/end {[round(x, 1) for x in r['memory']['load_average_1min_start_end']]}, "
            f"leftover processes killed: {r['memory']['leftover_processes_killed'] or 'none'}"
        )
        roles = r["memory"]["pss_at_peak_gib_by_role"]
        print(
            "  PSS at the peak sample, GiB (processes): "
            + ", ".join(f"{k} {v[1]:.2f} ({v[0]})" for k, v in roles.items() if v[1] >= 0.05)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
