"""A Ray head of a test's own, started through `scripts/start_head.sh` (helpers for tests, not a test module).

Fresh ports, its own temp dir and its own auth token (never the user's ~/.ray token), started with
`--block` in a new process group and stopped by signalling that group: never `ray stop`, which ends
every Ray process on the host, other runs included.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(check: Callable[[], object], timeout_s: float, what: str, every_s: float = 1.0) -> None:
    """Poll `check` until it returns a true value; TimeoutError naming `what`. Exceptions count as "not
    yet", except AssertionError: a check raises it to say waiting longer cannot help."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except AssertionError:
            raise
        except Exception as e:
            last_error = e
        time.sleep(every_s)
    raise TimeoutError(f"{what} within {timeout_s:.0f} s (last error: {last_error!r})")


def job_client(address: str, token: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers={"authorization": f"Bearer {token}"})


NO_OP_JOB = "python -c pass"  # the job _wait_for_job_agent runs first on every test head


def user_jobs(client: Any) -> list[Any]:
    """The head's jobs other than the fixture's no-op one."""
    return [j for j in client.list_jobs() if j.entrypoint != NO_OP_JOB]


def _wait_for_job_agent(address: str, token: str, temp_dir: str, timeout_s: float = 180) -> None:
    """Run a no-op job to its end: the head answers jobs only once its node's job agent has registered,
    "No available agent to submit job" until then (seconds, more on a loaded 2-core machine; CI failed on
    it with submit.sh's own 60 s of retries). On timeout the agent's log tail is in the error."""
    client = job_client(address, token)
    job: list[str] = []

    def submitted() -> bool:
        if not job:
            job.append(client.submit_job(entrypoint=NO_OP_JOB))
        status = str(client.get_job_status(job[0]))
        assert "FAILED" not in status and "STOPPED" not in status, f"the no-op job ended {status}"
        return "SUCCEEDED" in status

    try:
        wait_for(submitted, timeout_s, "the head's job agent did not run a no-op job")
    except TimeoutError as e:
        logs = sorted(Path(temp_dir).glob("session_*/logs/dashboard_agent*.log"))
        tail = logs[-1].read_text(errors="replace")[-2000:] if logs else "(no dashboard_agent log)"
        raise TimeoutError(f"{e}\n{tail}") from None


def _start_head(num_cpus: int) -> tuple[subprocess.Popen[str], dict[str, str], str]:
    """A head on fresh ports, its own temp dir and token: (process, client environment, dashboard address)."""
    gcs, dashboard, metrics, agent, client = free_ports(5)
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # unix socket paths must stay short
    token = secrets.token_hex(32)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "RAY_PORT": str(gcs),
        "DASHBOARD_PORT": str(dashboard),
        "METRICS_PORT": str(metrics),
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    head = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "start_head.sh"), "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
         f"--temp-dir={temp_dir}", f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
         "--include-dashboard=true", "--block"],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    env |= {"METRICS_URL": f"http://127.0.0.1:{metrics}/metrics", "RAY_TEMP_DIR": temp_dir}
    return head, env, f"http://127.0.0.1:{dashboard}"


def _stop_head(head: subprocess.Popen[str], temp_dir: str) -> None:
    # `ray start --block` does not always finish its own shutdown on SIGTERM: SIGKILL after a grace period.
    os.killpg(head.pid, signal.SIGTERM)
    time.sleep(5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    head.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_until_ready(address: str, token: str, temp_dir: str) -> None:
    wait_for(lambda: job_client(address, token).list_jobs() is not None, 120, "Ray head did not come up")
    _wait_for_job_agent(address, token, temp_dir)


@contextlib.contextmanager
def ray_head(num_cpus: int = 2) -> Iterator[dict[str, str]]:
    """Yield the environment a client of the head needs (RAY_ADDRESS, RAY_AUTH_TOKEN, ...) plus
    METRICS_URL (the node's Prometheus endpoint) and RAY_TEMP_DIR (where the session dir lives).

    A head whose job agent does not run the no-op job in time is stopped and started once more on fresh
    ports: on a loaded 2-core CI machine the agent once refused connections for the whole 180 s (the same
    test passed right after, 2026-11-27); a second failure is an error."""
    for attempt in (1, 2):
        head, env, address = _start_head(num_cpus)
        try:
            _wait_until_ready(address, env["RAY_AUTH_TOKEN"], env["RAY_TEMP_DIR"])
            break
        except TimeoutError as e:
            _stop_head(head, env["RAY_TEMP_DIR"])
            if attempt == 2:
                raise
            print(f"ray_head: starting the head again after: {str(e).splitlines()[0]}", file=sys.stderr)
        except BaseException:
            _stop_head(head, env["RAY_TEMP_DIR"])
            raise
    try:
        yield {**env, "RAY_ADDRESS": address}
    finally:
        _stop_head(head, env["RAY_TEMP_DIR"])
