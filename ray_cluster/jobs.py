"""Ray job submission around ``ray.job_submission.JobSubmissionClient``.

Ray's own ``ray job submit`` works unchanged (see the README). This wrapper exists only for
what that CLI leaves to the user:

- the address: ``--address``, else ``$RAY_ADDRESS``, else the local fake cluster's state file;
  one clear line when nothing answers there, instead of a connection-refused trace;
- the auth mode: Ray 2.60 silently switches token auth on when ``~/.ray/auth_token`` exists and
  ``RAY_AUTH_MODE`` is unset, so we always set it (default ``disabled``) and turn a 401 into
  "set RAY_AUTH_MODE=token";
- the interpreter: on a cluster on this machine a bare ``python``/``verl``/... entrypoint is
  resolved to this environment's absolute path, so the driver does not pick whatever is first
  on the raylet's ``PATH``;
- the runtime env: a ``working_dir`` upload excludes ``.venv``, ``.git`` and run outputs
  (Ray refuses uploads over its size limit, and a venv easily is); ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1``
  so a driver that gives ``ray.init`` its own ``env_vars`` (``verl train`` does) is merged with the
  job's instead of failing on the first shared key;
- waiting: follow the logs, then return the final status with the driver's error message.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .errors import ClusterError

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
DEFAULT_EXCLUDES = [".venv", "venv", ".git", "__pycache__", "*.pyc", "outputs", "runs", ".pytest_cache"]


def resolve_address(address: str | None = None, state_file: str | Path | None = None) -> str:
    """The dashboard URL to talk to: ``address`` > ``$RAY_ADDRESS`` > the fake cluster's state file.

    ``host:port`` without a scheme gets ``http://``.

    Raises:
        ClusterError: none of the three is available.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        from .fake_slice import FakeCluster, default_state_file

        path = Path(state_file or default_state_file())
        if not path.exists():
            raise ClusterError(
                "no cluster address: pass --address http://HOST:8265, set RAY_ADDRESS, or start a "
                "local one with `rl-tpu cluster up --fake-slice v6e-16`"
            )
        address = FakeCluster.load(path).dashboard_url
    if "://" not in address:
        address = "http://" + address
    return address.rstrip("/")


def set_auth_mode(mode: str | None = None) -> str:
    """Set ``RAY_AUTH_MODE`` explicitly (``mode`` > existing env > ``disabled``) and return it."""
    mode = (mode or os.environ.get("RAY_AUTH_MODE") or "disabled").lower()
    if mode not in ("disabled", "token"):
        raise ClusterError(f"auth mode {mode!r} is not one Ray 2.60 knows; use 'disabled' or 'token'")
    os.environ["RAY_AUTH_MODE"] = mode
    return mode


def check_answers(address: str, timeout_s: float = 5.0) -> None:
    """Raise :class:`ClusterError` unless a Ray dashboard answers ``/api/version`` at ``address``."""
    url = address.rstrip("/") + "/api/version"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            if r.status == 200:
                return
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ClusterError(
                f"the Ray cluster at {address} wants token auth (HTTP {e.code}): set RAY_AUTH_MODE=token "
                f"and RAY_AUTH_TOKEN (or ~/.ray/auth_token) to its token"
            ) from None
        raise ClusterError(f"{address} answered HTTP {e.code}, not a Ray 2.60 dashboard; check --address") from None
    except OSError as e:
        reason = getattr(e, "reason", e)
        raise ClusterError(
            f"no Ray dashboard answers at {address} ({reason}); check --address / RAY_ADDRESS, "
            f"or start a local cluster with `rl-tpu cluster up --fake-slice v6e-16`"
        ) from None


def _is_local(address: str) -> bool:
    return urllib.parse.urlparse(address).hostname in ("127.0.0.1", "localhost", "::1")


def resolve_entrypoint(entrypoint: Sequence[str] | str, address: str) -> str:
    """Shell command for the driver; on a local cluster ``python``/console scripts become absolute
    paths in this interpreter's environment."""
    argv = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    if not argv:
        raise ClusterError("empty entrypoint: give the command after `--`, e.g. -- python train.py")
    if _is_local(address):
        bindir = Path(sys.executable).parent
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif "/" not in argv[0] and (bindir / argv[0]).exists():
            argv[0] = str(bindir / argv[0])
        elif "/" not in argv[0] and shutil.which(argv[0]) is None:
            raise ClusterError(
                f"entrypoint command {argv[0]!r} is not in {bindir} nor on PATH; install it "
                f"(pip install -e .) or give its full path"
            )
    return shlex.join(argv)


@dataclass
class JobResult:
    """Where a job ended (or is, when not waited for)."""

    job_id: str
    status: str
    message: str
    logs: str
    submit_to_running_s: float | None = None
    submit_to_end_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "SUCCEEDED"


class Jobs:
    """A ``JobSubmissionClient`` with the address, auth mode and entrypoint handled (see module doc).

    Args:
        address: dashboard URL; default :func:`resolve_address`.
        auth_mode: ``disabled`` or ``token``; default ``$RAY_AUTH_MODE`` or ``disabled``.

    Raises:
        ClusterError: nothing answers at the address, or it wants a token.
    """

    def __init__(self, address: str | None = None, auth_mode: str | None = None, state_file: str | Path | None = None):
        from ray.job_submission import JobSubmissionClient

        self.auth_mode = set_auth_mode(auth_mode)
        self.address = resolve_address(address, state_file)
        check_answers(self.address)
        try:
            self.client = JobSubmissionClient(self.address)
        except Exception as e:  # e.g. an auth error formatted by Ray
            raise ClusterError(f"cannot open a job client on {self.address}: {str(e).splitlines()[0]}") from None

    def submit(
        self,
        entrypoint: Sequence[str] | str,
        *,
        working_dir: str | Path | None = None,
        env_vars: dict[str, str] | None = None,
        excludes: Sequence[str] | None = None,
        submission_id: str | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_resources: dict[str, float] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> str:
        """Submit ``entrypoint`` (argv list or shell string); returns the submission id.

        Raises:
            ClusterError: a missing ``working_dir`` or an entrypoint that cannot be found.
        """
        runtime_env: dict = {}
        if working_dir is not None:
            wd = Path(working_dir).resolve()
            if not wd.is_dir():
                raise ClusterError(f"--working-dir {working_dir} is not a directory; give an existing folder")
            runtime_env["working_dir"] = str(wd)
            runtime_env["excludes"] = list(DEFAULT_EXCLUDES if excludes is None else excludes)
        # A driver that passes its own runtime_env to ray.init (verl train does) is refused by Ray when
        # a key is also in the job's env ("Failed to merge the Job's runtime env"); this makes Ray merge
        # them, the driver's value winning.
        runtime_env["env_vars"] = {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1", **(env_vars or {})}
        cmd = resolve_entrypoint(entrypoint, self.address)
        try:
            return self.client.submit_job(
                entrypoint=cmd,
                runtime_env=runtime_env,
                submission_id=submission_id,
                entrypoint_num_cpus=entrypoint_num_cpus,
                entrypoint_resources=entrypoint_resources,
                metadata=metadata,
            )
        except RuntimeError as e:
            raise ClusterError(f"job submission to {self.address} refused: {str(e).splitlines()[0][:300]}") from None

    def status(self, job_id: str) -> JobResult:
        """Status, message (the driver's error on FAILED) and the logs so far.

        Raises:
            ClusterError: no such job at this address.
        """
        try:
            info = self.client.get_job_info(job_id)
            logs = self.client.get_job_logs(job_id)
        except RuntimeError as e:
            raise ClusterError(
                f"no job {job_id!r} at {self.address} ({str(e).splitlines()[0][:200]}); "
                f"list jobs with `ray job list --address {self.address}`"
            ) from None
        return JobResult(
            job_id=job_id,
            status=str(info.status.value if hasattr(info.status, "value") else info.status),
            message=info.message or "",
            logs=logs,
        )

    def wait(
        self,
        job_id: str,
        timeout_s: float = 600.0,
        poll_s: float = 0.2,
        on_log: Callable[[str], None] | None = None,
        until: Sequence[str] = TERMINAL,
    ) -> JobResult:
        """Poll until the job reaches a status in ``until`` (default: it ended) or ``timeout_s``
        passes, passing new log text to ``on_log``.

        Returns:
            The final :class:`JobResult`, with seconds from this call to RUNNING and to the end.
            On timeout the job is left running and its current status is returned.
        """
        t0 = time.monotonic()
        seen = 0
        running_at = None
        while True:
            r = self.status(job_id)
            if on_log is not None and len(r.logs) > seen:
                on_log(r.logs[seen:])
                seen = len(r.logs)
            if running_at is None and r.status in ("RUNNING",) + TERMINAL:
                running_at = time.monotonic() - t0
            if r.status in until or r.status in TERMINAL or time.monotonic() - t0 > timeout_s:
                r.submit_to_running_s = running_at
                r.submit_to_end_s = time.monotonic() - t0 if r.status in TERMINAL else None
                return r
            time.sleep(poll_s)

    def stop(self, job_id: str) -> bool:
        """Ask the job to stop (SIGTERM, then SIGKILL after Ray's grace period)."""
        try:
            return self.client.stop_job(job_id)
        except RuntimeError as e:
            raise ClusterError(
                f"cannot stop job {job_id!r} at {self.address}: {str(e).splitlines()[0][:200]}"
            ) from None
