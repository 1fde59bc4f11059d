"""What a local run prints about watching it, and the auth mode it starts Ray with (no Ray instance started)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infir2_rl.actors.ray_watch import choose_local_auth_mode, watch_instructions

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_config_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """monkeypatch restores the environment; Ray's cached config is re-read from it afterwards."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    yield monkeypatch
    monkeypatch.undo()
    Config.initialize("")


def test_local_start_keeps_token_auth_and_ray_sees_it(ray_config_restored: pytest.MonkeyPatch) -> None:
    from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

    ray_config_restored.delenv("RAY_AUTH_MODE", raising=False)
    assert choose_local_auth_mode() == "token"
    # Ray caches its config at import: without the refresh it would still report DISABLED here.
    assert get_authentication_mode() == AuthenticationMode.TOKEN


def test_user_disabled_auth_is_respected_loudly(
    ray_config_restored: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ray_config_restored.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING):
        assert choose_local_auth_mode() == "disabled"
    assert "WITHOUT token authentication" in caplog.text


def test_instructions_name_url_token_and_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/secrets/ray_token")
    text = watch_instructions("127.0.0.1:8265", "10.0.0.5:6379", "token", "/tmp/ray/session_x")
    assert "http://127.0.0.1:8265" in text
    assert "`ray get-auth-token`" in text and "/secrets/ray_token" in text
    assert "export RAY_AUTH_MODE=token" in text
    assert "ray status --address 10.0.0.5:6379" in text
    assert (
        "infir2-rl report RUN_DIR --watch" in text
        and "RAY_SESSION_DIR=/tmp/ray/session_x scripts/start_prometheus.sh" in text
    )
    plain = watch_instructions(None, "10.0.0.5:6379", "disabled", "/tmp/ray/session_x")
    assert "RAY_AUTH_MODE" not in plain and "get-auth-token" not in plain and "dashboard:  off" in plain


def auth_setup(mode: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`ray_auth_setup MODE` of scripts/ray_auth.sh (sourced as the cluster scripts do) with HOME=home."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    script = f". {REPO / 'scripts' / 'ray_auth.sh'}; ray_auth_setup {mode}"
    return subprocess.run(
        ["bash", "-c", script],
        env={**base, "HOME": str(home), "PATH": path, **env},
        capture_output=True,
        text=True,
    )


def test_cluster_scripts_generate_or_require_the_token(tmp_path: Path) -> None:
    missing = auth_setup("require", tmp_path)  # a worker / submitter without the head's token
    assert missing.returncode == 1 and "copy the head's ~/.ray/auth_token" in missing.stderr
    assert auth_setup("generate", tmp_path).returncode == 0  # the head makes one, readable by its owner only
    token = tmp_path / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 32
    assert auth_setup("require", tmp_path).returncode == 0
    wrong_path = auth_setup("require", tmp_path, RAY_AUTH_TOKEN_PATH=str(tmp_path / "nope"))
    assert wrong_path.returncode == 1 and "no such file" in wrong_path.stderr
    off = auth_setup("require", tmp_path / "empty", RAY_AUTH_MODE="disabled")
    assert off.returncode == 0 and "WITHOUT token authentication" in off.stderr
