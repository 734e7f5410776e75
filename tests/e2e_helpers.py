"""What the end-to-end tests share: a ``verl train --backend cpu`` subprocess with the test environment, the
length-based user reward (non-zero GRPO advantages even on a random model, through the guarded-reward path), and
the training rows of a run's ``metrics.jsonl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# reward in [0, 1) from the response's length in characters: varies within a GRPO group, so advantages are non-zero
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (len(solution_str) % 7) / 7.0
"""


# the same reward in VeRL's dict form, with accuracies apart from it as the project's reward gives them: "acc" (an
# even length) and "acc_strict" (a length that is a multiple of 4), so that they differ from the reward
REWARD_WITH_ACCURACY = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": (len(solution_str) % 7) / 7.0, "acc": float(len(solution_str) % 2 == 0),
            "acc_strict": float(len(solution_str) % 4 == 0)}
"""


def write_reward(folder: Path, accuracy: bool = False) -> list[str]:
    """Write the length reward (with ``accuracy``: :data:`REWARD_WITH_ACCURACY`) to ``folder/length_reward.py``;
    returns the overrides that make it the job's reward."""
    path = Path(folder) / "length_reward.py"
    path.write_text(REWARD_WITH_ACCURACY if accuracy else REWARD)
    return [f"reward.custom_reward_function.path={path}", "reward.custom_reward_function.name=compute_score"]


def train_env() -> dict[str, str]:
    """This process's environment for a child ``verl train``: Ray without token auth, no TorchTPU autoload, and no
    platform or Ray address inherited from a caller (the child starts its own Ray)."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_PLATFORM", None)
    env.pop("RAY_ADDRESS", None)
    return env


# The end-to-end tests' own small job, pinned: the default job's recipe (8 samples a prompt at temperature 0.7, 200
# validation items, DAPO's dynamic sampling; docs/recipe.md) is for learning, and would double every test's rollout
# and validation.
TEST_JOB = (
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.temperature=1.0",
    "rl_tpu.val_size=32",
    "rl_tpu.num_threads=1",
    # a random model's groups all score 0 under the default reward: DAPO's dynamic sampling would refill every step
    # to its bound; the tests that test it turn it on
    "algorithm.filter_groups.enable=false",
)  # tiny models: one thread, as every e2e test was timed


def pinned(args: tuple[str, ...] | list[str]) -> list[str]:
    """``args`` with :data:`TEST_JOB`'s keys added where ``args`` does not set them (a ``--config`` file sets its own
    rollout keys, so with one only ``rl_tpu.val_size`` is pinned)."""
    given = {a.split("=", 1)[0] for a in args if "=" in a and not a.startswith("-")}
    has_config = "--config" in args or any(a.startswith("--config=") for a in args)
    return [
        p
        for p in TEST_JOB
        if p.split("=", 1)[0] not in given and not (has_config and p.startswith("actor_rollout_ref."))
    ] + list(args)


def verl_train(
    out: Path,
    *args: str,
    timeout: float = 1500,
    cwd: Path | None = None,
    backend: str = "cpu",
    default_console: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``verl train --backend BACKEND --output-dir OUT ARGS...`` to the end (``args``: CLI flags and Hydra
    overrides); returns the finished process with text stdout/stderr. ``default_console``: the console a user gets
    (the rest in ``OUT/train.log``), not the whole output the tests' ``VERL_TRAIN_VERBOSE=1`` asks for."""
    cmd = [
        sys.executable,
        "-m",
        "verl_backend.driver.cli",
        "train",
        "--backend",
        backend,
        "--output-dir",
        str(out),
        *pinned(args),
    ]
    env = train_env()
    if default_console:
        env.pop("VERL_TRAIN_VERBOSE", None)
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def train_rows(out: Path, key: str = "actor/pg_loss") -> list[dict]:
    """The metric rows (dicts of name -> float) of the training steps in ``out/metrics.jsonl``, in step order:
    those that hold ``key``."""
    rows = [json.loads(line)["data"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if key in r]


@contextmanager
def fake_cluster(slices: list[str], state_file: Path, node_env: dict[str, str] | None = None) -> Iterator:
    """A fake-slice Ray cluster (:func:`ray_cluster.fake_slice.start`: a 4-CPU head plus the hosts of ``slices``)
    for the ``with`` block; its nodes get this environment plus ``node_env``, without any settings record. Stopped
    by pid at the end, and checked to leave no process behind."""
    from ray_cluster import fake_slice, ray_nodes

    saved = dict(os.environ)
    os.environ.update(node_env or {}, RAY_AUTH_MODE="disabled")
    for key in [k for k in os.environ if k.startswith("RL_TPU_SETTINGS")]:
        del os.environ[key]
    try:
        cluster = fake_slice.start(slices, head_cpus=4, object_store_mb=256, state_file=state_file, timeout_s=240)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield cluster
    finally:
        fake_slice.stop(state_file=state_file)
    assert not ray_nodes.tagged_processes(cluster.marker), "fake cluster processes left behind"
