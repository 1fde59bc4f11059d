"""Screenshots for the docs: Ray dashboard pages of a running job, and the `report --watch` view of a run.

    python scripts/screenshots.py dashboard http://127.0.0.1:8265 docs/img/dashboard_actors.png [--page actors]
    python scripts/screenshots.py report runs/demo docs/img/report_watch.png

Both drive Debian's headless chromium + chromium-driver through selenium (the `test` extra). The
dashboard is logged into as the README says: the token (`ray get-auth-token`, or RAY_AUTH_TOKEN) typed
into its "Authentication Token Required" dialog. The report view is rich's HTML export of the same
renderables `--watch` shows, photographed by the same browser.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def browser(width: int, height: int) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--window-size={width},{height}", f"--user-data-dir={tempfile.mkdtemp(prefix='chromium')}"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)


def dashboard(url: str, out: Path, page: str, wait_text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    token = (
        os.environ.get("RAY_AUTH_TOKEN")
        or subprocess.run(
            ["ray", "get-auth-token"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    driver = browser(1400, 660)
    try:
        wait = WebDriverWait(driver, 60)
        driver.get(url)
        field = wait.until(
            ec.element_to_be_clickable(
                (By.CSS_SELECTOR, "input[placeholder='Enter your authentication token']")
            )
        )
        field.send_keys(token, Keys.ENTER)
        wait.until(ec.invisibility_of_element_located((By.ID, "token-auth-dialog-description")))
        driver.get(f"{url}/#/{page}")
        wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), wait_text))
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def report(run_dir: Path, out: Path) -> None:
    from rich.console import Console, Group
    from rich.terminal_theme import MONOKAI

    from infir2_rl.metrics.report import make_report, summarize, summary_table
    from infir2_rl.metrics.watch import progress_table, run_stages, stage_progress

    make_report(run_dir)
    console = Console(record=True, width=150, file=open(os.devnull, "w"))  # noqa: SIM115
    rows = [stage_progress(d) for d in run_stages(run_dir)]
    console.print(
        Group(progress_table(rows), summary_table(summarize(run_dir), title=f"Run summary: {run_dir}"))
    )
    html = Path(tempfile.mkdtemp()) / "report.html"
    html.write_text(console.export_html(theme=MONOKAI, inline_styles=True))
    driver = browser(1480, 600)
    try:
        driver.get(html.as_uri())
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("dashboard")
    p.add_argument("url")
    p.add_argument("out", type=Path)
    p.add_argument("--page", default="actors", help="dashboard route: actors, jobs, overview, ...")
    p.add_argument("--wait-text", default="ALIVE", help="text that must be on the page before the shot")
    p = sub.add_parser("report")
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.what == "dashboard":
        dashboard(args.url.rstrip("/"), args.out, args.page, args.wait_text)
    else:
        report(args.run_dir, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
