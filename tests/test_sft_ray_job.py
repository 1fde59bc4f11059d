"""`scripts/start_head.sh` + `scripts/submit.sh` run an SFT stage as a Ray job on a real local cluster.

The cluster is this test's own: fresh ports, its own temp dir, started with `--block` in a new process
group and stopped by signalling that group (never `ray stop`, which ends every Ray process on the host,
other runs included). While the job trains, the run's metrics are scraped from the node's Prometheus
endpoint.
"""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_head import REPO, job_client, ray_head, user_jobs, wait_for

from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model


@pytest.fixture
def cluster() -> Iterator[dict[str, str]]:
    with ray_head(num_cpus=2) as env:
        yield env


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
    (job,) = user_jobs(client)
    assert job.status == JobStatus.SUCCEEDED, client.get_job_logs(job.submission_id)[-3000:]
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000030"
    assert scraped == {"ray_infir2_train_loss", "ray_infir2_perf_tokens_per_s"}, "metrics not on the endpoint"
