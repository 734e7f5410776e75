"""The console of ``verl train``: the lines a person reads; everything else goes to the run's ``train.log``.

While VeRL runs, this process's file descriptors 1 and 2 point at the log file, then at pipes (so VeRL's config dump,
Ray's own lines, the worker output Ray forwards to the driver, C libraries' prints and tqdm's redraws are all caught).
Every line goes to ``<run folder>/train.log``; the terminal gets only

- the driver's own lines, written with :meth:`Console.say` (the job's settings line, one line per training step,
  the summary),
- rl-tpu's warnings (``[rl-tpu] warning: ...``), each once however many workers print it, and its notices
  (:data:`NOTICES`: a resumed or moved-aside run folder, a restart after a dead actor),

or everything with ``--verbose``. Errors reach the terminal after the capture ends: ``verl`` prints a bad input as
one ``verl: error:`` line, and a failure it cannot name with its traceback (the fds are back by then).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from verl_backend.driver.report import (
    GROUPS_REPLACED_KEY,
    KEPT_GROUPS_KEY,
    RUNNING_MEAN_STEPS,
    graded_reward,
    lenient_correct,
    strict_correct,
)

MAX_LINES = 60  # what the default job may print when nothing fails
ERROR_LOOKING = re.compile(r"(?i)error|fail|traceback|exception")
_WARNING = re.compile(r"\[rl-tpu\] warning: (.*)$")
# rl-tpu's own lines a person should see although they are no warning: the run folder's resume or start-over, and
# a restart after a dead Ray actor (verl_backend/driver/run_folder.py, runner.py)
NOTICES = re.compile(r"\[rl-tpu\] (resuming from the checkpoint|a Ray actor failed|.* held an earlier run)")
_RAY_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*\([^)]*pid=\d+[^)]*\)(\x1b\[[0-9;]*m)*\s*")


def console_lines(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: split on ``\\n`` and ``\\r`` (a redrawn progress bar counts each
    redraw), empty ones left out."""
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


def console_problems(text: str, max_lines: int = MAX_LINES) -> list[str]:
    """What is wrong with ``text`` as the console of a run where nothing failed: more than ``max_lines`` lines, a
    line that looks like an error (``error|fail|traceback|exception``, any case), a line shown twice. ``[]``: none."""
    lines = console_lines(text)
    problems = []
    if len(lines) > max_lines:
        problems.append(f"{len(lines)} lines (at most {max_lines})")
    problems += [f"error-looking line: {line!r}" for line in lines if ERROR_LOOKING.search(line)]
    seen: set[str] = set()
    for line in lines:
        if line in seen:
            problems.append(f"shown twice: {line!r}")
        seen.add(line)
    return problems


class ConsoleFilter:
    """Decides which captured lines the terminal shows (not thread-safe: :class:`Console` holds a lock)."""

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self._warned: set[str] = set()

    def show(self, line: str) -> str | None:
        """What the terminal shows of ``line`` (a captured line, without its end), or ``None``: all of it with
        ``verbose``, else an rl-tpu warning the first time (without Ray's ``(Actor pid=N)`` prefix)."""
        if self.verbose:
            return line
        text = _RAY_PREFIX.sub("", line)
        if NOTICES.match(text):
            return text
        match = _WARNING.search(text)
        if match is None:
            return None
        key = match.group(1).strip()
        if key in self._warned:
            return None
        self._warned.add(key)
        return text[match.start() :]


class Console:
    """The terminal and ``train.log`` while :func:`capture` is active (see the module's docstring)."""

    def __init__(self, log, terminal_fd: int | None, verbose: bool, terminal_err_fd: int | None = None):
        self._log = log
        self._terminal_fd = terminal_fd  # None: not capturing (say() prints to sys.stdout)
        self._terminal_err_fd = terminal_err_fd
        self._filter = ConsoleFilter(verbose)
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        """Show ``text`` (one or more lines) on the terminal and write it to ``train.log``."""
        self._show(text, self._terminal_fd, sys.stdout)

    def error(self, text: str) -> None:
        """Show ``text`` on the terminal's stderr and write it to ``train.log``."""
        self._show(text, self._terminal_err_fd, sys.stderr)

    def _show(self, text: str, fd: int | None, stream) -> None:
        data = (text.rstrip("\n") + "\n").encode()
        with self._lock:
            if self._log is not None:
                self._log.write(data)
            if fd is None:  # not capturing: this process's own stream
                stream.write(data.decode())
                stream.flush()
            else:
                os.write(fd, data)

    def pump(self) -> None:
        """Point fds 1 and 2 at pipes read by threads (all to the log, the filter's lines to the terminal)."""
        _flush_std()
        self._marker = f"\x00rl-tpu-console-end-{os.getpid()}\x00".encode()
        self._pipes, self._threads = {}, []
        for fd in (1, 2):
            read_fd, write_fd = os.pipe()
            os.set_inheritable(read_fd, False)
            os.set_inheritable(write_fd, False)
            os.dup2(write_fd, fd)  # fd itself stays inheritable: Ray's processes write their odd line here
            self._pipes[fd] = (read_fd, write_fd)
            thread = threading.Thread(
                target=_pump, args=(read_fd, self, self._marker), daemon=True, name=f"rl-tpu-console-{fd}"
            )
            thread.start()
            self._threads.append(thread)

    def _stop_pumps(self) -> None:
        """After fds 1 and 2 are restored: let the readers take what is in the pipes, up to an end marker. The read
        ends stay open (a Ray process that inherited a pipe and writes later must not get SIGPIPE)."""
        for fd, (_, write_fd) in getattr(self, "_pipes", {}).items():
            os.write(write_fd, self._marker)
        for thread in getattr(self, "_threads", []):
            thread.join(timeout=10)
        for _, write_fd in getattr(self, "_pipes", {}).values():
            os.close(write_fd)
        self._pipes, self._threads = {}, []

    def _captured(self, chunk: bytes) -> None:
        """Bytes read from the pipes: all to the log, the lines the filter keeps to the terminal."""
        with self._lock:
            self._log.write(chunk)
            for line in re.split(rb"[\r\n]", chunk):
                shown = self._filter.show(line.decode(errors="replace")) if line.strip() else None
                if shown is not None:
                    os.write(self._terminal_fd, shown.encode() + b"\n")


def _pump(read_fd: int, console: Console, stop_marker: bytes) -> None:
    """Read ``read_fd`` line by line into ``console`` until ``stop_marker`` arrives (the capture's end: Ray's own
    processes inherited the pipe, so it never reaches end of file while they live)."""
    pending = b""
    while True:
        try:
            data = os.read(read_fd, 65536)
        except OSError:
            data = b""
        if not data:
            if pending:
                console._captured(pending)
            return
        pending += data
        stop = pending.find(stop_marker)
        if stop >= 0:
            if pending[:stop]:
                console._captured(pending[:stop])
            return
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r"))
        if cut >= 0:
            console._captured(pending[: cut + 1])
            pending = pending[cut + 1 :]


@contextmanager
def capture(log_path: Path, verbose: bool = False):
    """Send fds 1 and 2 to ``log_path`` (appended) for the ``with`` block; yields the :class:`Console`.

    Two phases, because the fork server (:mod:`verl_backend.host_memory.fork_server`) must be forked while this process
    has one thread: first the fds point at the log file itself (nothing reaches the terminal but :meth:`Console.say`;
    with ``verbose`` they stay on the terminal); :meth:`Console.pump` then points them at pipes that threads read into
    the log and the filtered terminal. The fds are restored on the way out, whatever happens, after what was written
    to the pipes has been read.
    """
    log = open(log_path, "ab", buffering=0)
    log.write(f"==== verl train {time.strftime('%Y-%m-%d %H:%M:%S')} ({' '.join(sys.argv)})\n".encode())
    _flush_std()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd in saved.values():
        os.set_inheritable(fd, False)
    console = Console(log, saved[1], verbose, saved[2])
    if not verbose:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
    try:
        yield console
    except BaseException as exc:  # the log keeps the whole story; verl prints its one line (or traceback) after
        import traceback

        _flush_std()
        log.write("".join(traceback.format_exception(exc)).encode())
        raise
    finally:
        _flush_std()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)  # new writes go to the terminal again
        console._stop_pumps()
        for fd in saved.values():
            os.close(fd)
        log.close()


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class StepLines:
    """One console line per training step from VeRL's ``metrics.jsonl`` (its file logger, written where the trainer
    runs), read by a thread: reward and its running mean, accuracy, response length and seconds per step, instead of
    tqdm's redraws. Accuracy is the share of the step's samples that are right, strict (the answer in tags) and
    lenient, from VeRL's rollout dump (``trainer.rollout_data_dir``, ``<step>.jsonl``) when there is one
    (:func:`verl_backend.driver.report.strict_correct`, :func:`~verl_backend.driver.report.lenient_correct`)."""

    def __init__(self, metrics: Path, total_steps: int, say, rollouts: Path | None = None, poll_s: float = 1.0):
        self._path, self._total, self._say, self._poll = Path(metrics), int(total_steps or 0), say, poll_s
        self._rollouts = Path(rollouts) if rollouts else None
        self._offset = self._path.stat().st_size if self._path.is_file() else 0  # a resumed run's earlier steps
        self._rewards: dict[int, float] = {}  # step -> its reward (all groups graded, under DAPO): the running mean
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rl-tpu-steps")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self._read()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            self._read()

    def _read(self) -> None:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        self._offset += end + 1
        for raw in data[:end].splitlines():
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            step, data = int(row.get("step", 0)), row.get("data") or {}
            if (graded := graded_reward(data)) is not None:
                self._rewards[step] = graded[0]
            elif isinstance(data.get("critic/score/mean"), (int, float)):
                self._rewards[step] = float(data["critic/score/mean"])
            recent = [self._rewards[s] for s in sorted(self._rewards) if s <= step][-RUNNING_MEAN_STEPS:]
            line = step_line(
                step, data, self._total, self._accuracy(step), sum(recent) / len(recent) if len(recent) > 1 else None
            )
            if line:
                self._say(line)

    def _accuracy(self, step: int) -> tuple[float, float] | None:
        """``(strict, lenient)``: shares of the step's samples that are right in the rollout dump, which VeRL writes
        in a thread of its own just before the step's metrics: waited for up to 3 s."""
        if self._rollouts is None:
            return None
        path = self._rollouts / f"{step}.jsonl"
        for _ in range(30):
            if path.is_file():
                try:
                    items = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
                    marks = [(strict_correct(i), lenient_correct(i)) for i in items]
                except (OSError, ValueError, KeyError, TypeError, AttributeError):
                    marks = []  # still being written
                if marks:
                    return (sum(s for s, _ in marks) / len(marks), sum(l for _, l in marks) / len(marks))
            time.sleep(0.1)
        return None


def step_line(
    step: int, data: dict, total: int, accuracy: tuple[float, float] | None = None, reward_mean: float | None = None
) -> str | None:
    """``[rl-tpu] step 3/12 | reward 0.312 (4-step mean 0.405) | accuracy strict 12.5% lenient 40.6% | response 41
    tokens | 38.2 s/step`` for a training step's metrics: ``accuracy`` is ``(strict, lenient)`` shares of the step's
    samples, ``reward_mean`` the running mean of the reward over the last :data:`RUNNING_MEAN_STEPS` steps.

    With DAPO's dynamic sampling (``algorithm.filter_groups.enable=true``) VeRL's reward and the accuracy are those of
    the groups trained on, which have a reward spread by construction. On the reward
    (``algorithm.filter_groups.metric=reward``) the line gives the reward of every group graded beside it, and
    ``reward_mean`` is then that reward's running mean: ``reward 0.531 of 4 groups trained on | reward 0.688 of all 9
    graded (4-step mean 0.602) | ... | 5 groups without a reward spread replaced`` (the count is VeRL's
    ``training/filter_groups/evicted_samples``, groups despite its name). ``None`` for a row without training metrics
    (a validation-only row)."""
    if "critic/score/mean" not in data:
        return None
    reward = f"reward {float(data['critic/score/mean']):.3f}"
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    if (graded := graded_reward(data)) is not None:
        kept = int(data[KEPT_GROUPS_KEY])
        parts.append(f"{reward} of {kept} group{'' if kept == 1 else 's'} trained on")
        reward = f"reward {graded[0]:.3f} of all {graded[1]} graded"
    if reward_mean is not None:
        reward += f" ({RUNNING_MEAN_STEPS}-step mean {reward_mean:.3f})"
    parts.append(reward)
    if accuracy is not None:
        parts.append(f"accuracy strict {100 * accuracy[0]:.1f}% lenient {100 * accuracy[1]:.1f}%")
    if isinstance(data.get(GROUPS_REPLACED_KEY), (int, float)):
        parts.append(f"{int(data[GROUPS_REPLACED_KEY])} groups without a reward spread replaced")
    if isinstance(data.get("response_length/mean"), (int, float)):
        parts.append(f"response {float(data['response_length/mean']):.0f} tokens")
    if isinstance(data.get("timing_s/step"), (int, float)):
        parts.append(f"{float(data['timing_s/step']):.1f} s/step")
    return "[rl-tpu] " + " | ".join(parts)


def job_line(config, backend: str, threads: int, out: Path) -> str:
    """The job's settings in one line: algorithm, model, data, steps, batch (and whether DAPO's dynamic sampling keeps
    only groups with a reward spread, ``algorithm.filter_groups.enable``), backend, where the full log is."""
    model = Path(str(config.actor_rollout_ref.model.path)).name
    from verl_backend.driver.data_prep import data_files

    files = data_files(config.data.get("train_files"))
    task = Path(str(files[0])).stem.removesuffix("_train") if files else "?"  # the built-in data: <task>_train
    prompts, n = int(config.data.train_batch_size), int(config.actor_rollout_ref.rollout.n)
    filtered = (config.algorithm.get("filter_groups") or {}).get("enable", False)
    return (
        f"[rl-tpu] {str(config.algorithm.adv_estimator).upper()} on {model}, {task}: "
        f"{config.trainer.total_training_steps or 'all'} steps of {prompts} prompts x {n} samples"
        f"{' with a reward spread (DAPO dynamic sampling)' if filtered else ''}, {backend} backend, "
        f"{threads or 'default'} thread{'' if threads == 1 else 's'}; full log: {out / 'train.log'}"
    )
