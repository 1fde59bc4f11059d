"""scripts/submit.sh tries again while a fresh head's job agent is not up ("No available agent to submit job":
nothing was submitted), up to SUBMIT_AGENT_WAIT_S, and passes any other exit code through. A fake ``ray`` on
PATH stands in for the cluster (the real submission: tests/test_sft_ray_job.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKE_RAY = """#!/usr/bin/env bash
[[ "$1" == "get-auth-token" ]] && exit 0
n=$(cat "$COUNT" 2>/dev/null || echo 0); echo $((n + 1)) > "$COUNT"
if [[ $n -lt $AGENT_LATE ]]; then
  echo "RuntimeError: Request failed with status code 500: No available agent to submit job, please try again later.."
  exit 1
fi
[[ "$*" == *bad.yaml* ]] && { echo "job failed"; exit 7; }
echo "job ran"
"""


def _submit(tmp_path: Path, config: str, agent_late: int, wait_s: int) -> tuple[int, int, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text(FAKE_RAY)
    (bin_dir / "ray").chmod(0o755)
    count = tmp_path / f"count_{config}_{agent_late}_{wait_s}"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RAY_ADDRESS="http://127.0.0.1:1",
               COUNT=str(count), AGENT_LATE=str(agent_late), SUBMIT_AGENT_WAIT_S=str(wait_s))  # fmt: skip
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "submit.sh"), config],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return done.returncode, int(count.read_text()), done.stdout + done.stderr


@pytest.mark.parametrize(("config", "agent_late", "wait_s", "rc", "calls"), [
    ("ok.yaml", 0, 60, 0, 1),    # agent up: one call
    ("ok.yaml", 2, 60, 0, 3),    # agent late: tried again until it answers
    ("bad.yaml", 1, 60, 7, 2),   # the job's own failure is passed through, not retried
    ("ok.yaml", 5, 0, 1, 1),     # no wait allowed: the submit error is the answer
])  # fmt: skip
def test_submit_waits_for_the_job_agent_only(
    tmp_path: Path, config: str, agent_late: int, wait_s: int, rc: int, calls: int
) -> None:
    got_rc, got_calls, out = _submit(tmp_path, config, agent_late, wait_s)
    assert (got_rc, got_calls) == (rc, calls), out
    assert ("job agent is not up yet" in out) == (calls > 1)
