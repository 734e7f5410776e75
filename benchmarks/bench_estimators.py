"""Every advantage estimator VeRL 0.9.1 registers (``verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY``), two
steps each on ``verl train --backend cpu``: does it run, or is it refused before Ray (one ``verl: error:`` line from
``verl_backend/driver/preflight.py``, which names why and what to use), and the first step's figures.

Each estimator gets the companion keys VeRL requires of it (:data:`COMPANIONS`; GAE brings VeRL's critic by
itself, on the same model). The job is the default one (GRPO's config: 4 prompts x 4 samples, basic_arithmetic)
with ``algorithm.adv_estimator`` changed, 2 steps, no validation, no checkpoint, responses of at most
``--response-length`` tokens. The model is a tiny random Llama (2 layers, 64 wide, SmolLM2's tokenizer, as the
tests' fixture) unless ``--model default`` (SmolLM2-135M-Instruct, ~1.5 min a step here) or a folder; a random
model never answers an arithmetic problem, so the reward is the tests' length reward (response characters mod 7,
/ 7: it varies within a group, so advantages are not all zero).

Columns (step 1): ``s/step`` (VeRL's ``timing_s/step``), ``reward`` (``critic/score/mean``), ``pg_loss``
(``actor/pg_loss``), ``ppo_kl`` (``actor/ppo_kl``); ``wall s`` is the whole ``verl train`` process.

    python benchmarks/bench_estimators.py [--model tiny|default|DIR] [--estimators grpo,gae,...] [--out est.json]
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what VeRL 0.9.1 requires beside algorithm.adv_estimator (the refused ones are refused whatever is added)
COMPANIONS: dict[str, list[str]] = {
    # the critic: VeRL's need_critic() turns it on for GAE; its micro batch VeRL requires (pre-flight says so)
    "gae": ["algorithm.lam=0.95", "critic.ppo_micro_batch_size_per_gpu=4"],
    "gdpo": ["+algorithm.gdpo_reward_keys=[score]"],
    "optimal_token_baseline": ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
    "tir_optimal_token_baseline": ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
}

LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (len(solution_str) % 7) / 7.0
"""

FIGURES = (
    ("s/step", "timing_s/step"),
    ("reward", "critic/score/mean"),
    ("pg_loss", "actor/pg_loss"),
    ("ppo_kl", "actor/ppo_kl"),
)


def tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama (tests/verl_backend/conftest.py) in ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from verl_backend.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_one(name: str, model: Path | None, work: Path, steps: int, response_length: int) -> dict:
    """``verl train`` with ``algorithm.adv_estimator=name``: ``{"estimator", "status": runs|refused|failed,
    "why", figures..., "wall_s"}``."""
    out = work / name
    reward = work / "length_reward.py"
    args = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        "cpu",
        "--output-dir",
        str(out),
        "--max-restarts",
        "0",
        f"algorithm.adv_estimator={name}",
        *COMPANIONS.get(name, []),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "rl_tpu.train_size=16",
        "rl_tpu.val_size=4",
        f"data.max_response_length={response_length}",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
    ]
    if model is not None:
        args += [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}"]
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    for key in ("VERL_PLATFORM", "RAY_ADDRESS", "VERL_TRAIN_VERBOSE"):
        env.pop(key, None)
    start = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    row: dict = {
        "estimator": name,
        "wall_s": round(time.time() - start, 1),
        "companions": " ".join(COMPANIONS.get(name, [])),
    }
    errors = [line[len("verl: error: ") :] for line in proc.stderr.splitlines() if line.startswith("verl: error: ")]
    if proc.returncode == 2 and errors:
        return {**row, "status": "refused", "why": errors[-1]}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {**row, "status": "failed", "why": f"exit {proc.returncode}: {tail} (see {out / 'train.log'})"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next((r["data"] for r in rows if r["step"] == 1 and "actor/pg_loss" in r["data"]), {})
    return {**row, "status": "runs", "why": "", **{col: first.get(key) for col, key in FIGURES}}


def table(rows: list[dict]) -> str:
    """A Markdown table of :func:`run_one`'s rows."""

    def num(x, fmt):
        return "" if x is None else format(float(x), fmt)

    lines = [
        "| estimator | companion keys | runs or refused | s/step | reward | pg_loss | ppo_kl | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = r["status"] if r["status"] == "runs" else f"{r['status']}: {r['why']}"
        lines.append(
            f"| `{r['estimator']}` | {('`' + r['companions'] + '`') if r['companions'] else ''} | {status} "
            f"| {num(r.get('s/step'), '.2f')} | {num(r.get('reward'), '.3f')} | {num(r.get('pg_loss'), '.4f')} "
            f"| {num(r.get('ppo_kl'), '.2e')} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (random 2-layer Llama), default (SmolLM2-135M) or a folder")
    p.add_argument("--estimators", default=",".join(ADV_ESTIMATOR_REGISTRY), help="comma-separated names")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--response-length", type=int, default=16, help="data.max_response_length")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--keep", help="keep the run folders here (default: a temporary folder, removed)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_estimators_") as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "length_reward.py").write_text(LENGTH_REWARD)
        model = (
            None if a.model == "default" else tiny_model(work / "tiny_model") if a.model == "tiny" else Path(a.model)
        )
        rows = []
        for name in a.estimators.split(","):
            row = run_one(name, model, work, a.steps, a.response_length)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(
        f"\nmodel: {a.model}; {a.steps} steps of 4 prompts x 4 samples, responses <= {a.response_length} tokens, "
        "length reward; figures of step 1\n"
    )
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
