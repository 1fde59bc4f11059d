"""Watching a running stage the ways the README says: Prometheus (Debian's package, started by
`scripts/start_prometheus.sh`) and the Ray dashboard in a real headless Chromium, logged in with the token.

One SFT stage is submitted as a Ray job (`scripts/submit.sh`) to a head of this module's own
(`scripts/start_head.sh`, token authentication on) and keeps training while both tests look at it;
it is stopped at the end. A test whose tool is not installed skips, naming the package to install.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_head import REPO, free_ports, job_client, ray_head, user_jobs, wait_for

from infir2_rl.data.synthetic import make_data
from infir2_rl.metrics import names
from infir2_rl.metrics.grafana import panel_query, series_name
from infir2_rl.models.factory import init_model

pytestmark = (
    pytest.mark.slow
)  # a Ray head, a training job, Prometheus and Chromium: about 2 minutes on 2 cores

STAGE = "watch_sft"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Failure screenshots of the dashboard go here (CI keeps the folder as an artifact).
ARTIFACTS = Path(os.environ.get("INFIR2_TEST_ARTIFACTS", REPO / "test-artifacts"))


@pytest.fixture(scope="module")
def running_stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A head plus an SFT job in its training loop (its metrics already on the node's endpoint)."""
    from ray.job_submission import JobStatus

    tmp = tmp_path_factory.mktemp("watch")
    model = init_model(tmp / "model", preset="tiny", num_hidden_layers=2)
    make_data(tmp / "data", num_sft=64, num_rl=4, num_test=8)
    (tmp / "job").mkdir()
    (tmp / "job" / "sft.yaml").write_text(
        f"""kind: sft
name: {STAGE}
run_dir: {tmp}/run
model: {{path: {model}}}
data: {{train_path: {tmp}/data/sft_train.jsonl, test_path: null}}
trainer: {{global_batch_size: 8, micro_batch_size: 8, epochs: 100000, max_steps: 1000000}}
checkpoint: {{save_every: 0}}
metrics: {{progress_bar: false, tensorboard: false}}
"""
    )
    with ray_head() as env:
        client = job_client(env["RAY_ADDRESS"], env["RAY_AUTH_TOKEN"])
        submit = subprocess.run(
            ["bash", str(REPO / "scripts" / "submit.sh"), "sft.yaml"],
            cwd=tmp / "job", env={**env, "RAY_JOB_SUBMIT_FLAGS": "--no-wait"},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
        (job,) = user_jobs(client)

        def training() -> bool:
            status = client.get_job_status(job.submission_id)
            if status.is_terminal():
                raise AssertionError(f"job ended {status}: {client.get_job_logs(job.submission_id)[-3000:]}")
            text = urllib.request.urlopen(env["METRICS_URL"], timeout=5).read().decode()
            return status == JobStatus.RUNNING and "ray_infir2_train_loss" in text

        try:
            wait_for(training, 240, "the stage's train loss did not reach the node's metrics endpoint")
            yield {**env, "JOB_ID": job.submission_id, "RUN_DIR": str(tmp / "run")}
        finally:
            client.stop_job(job.submission_id)


def prometheus_query(base: str, query: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?query={urllib.parse.quote(query)}"
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_prometheus_scrapes_our_metrics_by_name(running_stage: dict[str, str], tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus package is not installed (apt-get install -y prometheus)")
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    env = {
        **running_stage,
        "PROMETHEUS_LISTEN": f"127.0.0.1:{port}",
        "PROMETHEUS_DATA": str(tmp_path / "prometheus"),
        "SCRAPE_INTERVAL": "1s",
    }
    prom = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "start_prometheus.sh")],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    found: dict[str, list[dict[str, Any]]] = {}
    try:
        # The Grafana dashboard's own panel queries, its variables set as a user picking this stage would.
        queries = {
            metric: panel_query(metric).replace("$SessionName", ".+").replace("$stage", STAGE)
            for metric in (names.TRAIN_LOSS, names.PERF_TOKENS_PER_S)
        }

        def scraped() -> bool:
            for metric, query in queries.items():
                found[metric] = prometheus_query(base, query)
            return all(found.values())

        wait_for(scraped, 90, f"Prometheus did not answer {queries}")
    finally:
        os.killpg(prom.pid, signal.SIGTERM)
        output, _ = prom.communicate(timeout=30)
    for name, series in found.items():
        value = float(series[0]["value"][1])
        assert series[0]["metric"]["__name__"] == series_name(name) == f"ray_infir2_{name.replace('/', '_')}"
        assert series[0]["metric"]["stage"] == STAGE
        assert value > 0 and value < float("inf"), (name, value, output[-2000:])


def chromium_driver(user_data_dir: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000", f"--user-data-dir={user_data_dir}"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def test_dashboard_lists_the_job_and_its_actors_after_token_login(
    running_stage: dict[str, str], tmp_path: Path
) -> None:
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)"
        )
    pytest.importorskip("selenium", reason="selenium is in the test extra: pip install -e '.[test]'")
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not try to download a driver
    browser = chromium_driver(tmp_path / "chromium-profile")
    page = "start"
    try:
        wait = WebDriverWait(browser, 60)
        # As documented: the dashboard asks for the token (`ray get-auth-token` prints it) in a dialog.
        page = "login"
        browser.get(running_stage["RAY_ADDRESS"])
        field = wait.until(
            expected_conditions.element_to_be_clickable(
                (By.CSS_SELECTOR, "input[placeholder='Enter your authentication token']")
            )
        )
        field.send_keys(running_stage["RAY_AUTH_TOKEN"], Keys.ENTER)

        def dialog_closed(driver: Any) -> bool:
            # selenium's invisibility_of_element_located lets chromedriver's "Node with given id does not
            # belong to the document" through when the dialog leaves the DOM between the find and the check
            # (seen in CI, 2026-11-25): treat it as "look again".
            try:
                found = driver.find_elements(By.ID, "token-auth-dialog-description")
                return all(not element.is_displayed() for element in found)
            except WebDriverException:
                return False

        wait.until(dialog_closed)
        page = "jobs"
        browser.get(f"{running_stage['RAY_ADDRESS']}/#/jobs")
        wait.until(
            expected_conditions.text_to_be_present_in_element((By.TAG_NAME, "body"), running_stage["JOB_ID"])
        )
        assert "RUNNING" in browser.find_element(By.TAG_NAME, "body").text
        page = "actors"
        browser.get(f"{running_stage['RAY_ADDRESS']}/#/actors")
        wait.until(expected_conditions.text_to_be_present_in_element((By.TAG_NAME, "body"), "TrainerWorker"))
        assert "ALIVE" in browser.find_element(By.TAG_NAME, "body").text
    except Exception as e:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / f"dashboard_{page}.png"
        browser.save_screenshot(str(shot))
        raise AssertionError(f"dashboard check failed on the {page} page; screenshot: {shot}") from e
    finally:
        browser.quit()
