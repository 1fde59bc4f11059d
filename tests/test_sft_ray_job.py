"""`scripts/start_head.sh` + `scripts/submit.sh` run an SFT stage as a Ray job on a real local cluster.

The cluster is this test's own: fresh ports, its own temp dir, started with `--block` in a new process
group and stopped by signalling that group (never `ray stop`, which ends every Ray process on the host,
other runs included). While the job trains, the run's metrics are scraped from the node's Prometheus
endpoint.
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
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model

REPO = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except Exception:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{what} within {timeout_s:.0f} s")


@pytest.fixture
def cluster() -> Iterator[dict[str, str]]:
    gcs, dashboard, metrics, agent, client = free_ports(5)
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # unix socket paths must stay short
    # The cluster uses token authentication with a token of its own (never the user's ~/.ray token).
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
        ["bash", str(REPO / "scripts" / "start_head.sh"), "--node-ip-address=127.0.0.1", "--num-cpus=2",
         f"--temp-dir={temp_dir}", f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
         "--include-dashboard=true", "--block"],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for(lambda: job_client(address, token).list_jobs() is not None, 120, "Ray head did not come up")
        yield {**env, "RAY_ADDRESS": address, "METRICS_URL": f"http://127.0.0.1:{metrics}/metrics"}
    finally:
        # The head and everything it started (its process group), nothing else. `ray start --block` does
        # not always finish its own shutdown on SIGTERM, hence the SIGKILL after a grace period.
        os.killpg(head.pid, signal.SIGTERM)
        time.sleep(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def job_client(address: str, token: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers={"authorization": f"Bearer {token}"})


def test_ray_job_submit_runs_an_sft_stage_to_success(cluster: dict[str, str], tmp_path: Path) -> None:
    from ray.job_submission import JobStatus

    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=2)
    make_data(tmp_path / "data", num_sft=240, num_rl=4, num_test=8)
    work = tmp_path / "job"
    work.mkdir()
    run_dir = tmp_path / "run"
    (work / "sft.yaml").write_text(
        f"""kind: sft
name: sft_job
run_dir: {run_dir}
model: {{path: {model}}}
data: {{train_path: {tmp_path}/data/sft_train.jsonl, test_path: {tmp_path}/data/sft_test.jsonl}}
precision: fp8
trainer: {{global_batch_size: 8, micro_batch_size: 4}}
checkpoint: {{save_every: 10}}
metrics: {{progress_bar: false}}
"""
    )
    submit = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "submit.sh"), "sft.yaml", "trainer.max_steps=30"],
        cwd=work, env=cluster, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    scraped: set[str] = set()

    def metric_seen() -> bool:
        text = urllib.request.urlopen(cluster["METRICS_URL"], timeout=5).read().decode()
        scraped.update(n for n in ("ray_infir2_train_loss", "ray_infir2_perf_tokens_per_s") if n in text)
        return len(scraped) == 2 or submit.poll() is not None

    wait_for(metric_seen, 240, "no metric scraped and the job did not end")
    output, _ = submit.communicate(timeout=240)
    assert submit.returncode == 0, output[-3000:]
    client = job_client(cluster["RAY_ADDRESS"], cluster["RAY_AUTH_TOKEN"])
    (job,) = client.list_jobs()
    assert job.status == JobStatus.SUCCEEDED, client.get_job_logs(job.submission_id)[-3000:]
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000030"
    assert scraped == {"ray_infir2_train_loss", "ray_infir2_perf_tokens_per_s"}, "metrics not on the endpoint"
