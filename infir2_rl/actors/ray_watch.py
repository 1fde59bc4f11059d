"""How a user watches a local run: Ray's token authentication made explicit, and the lines that say where to look.

Ray 2.52+ turns token authentication on for every new local instance (`ray.init()` with `RAY_AUTH_MODE`
unset): it writes a random token to `~/.ray/auth_token` when none exists and prints a warning. The
dashboard then answers 401 until the token is pasted into its "Authentication Token Required" dialog
(which stores it in a cookie), and the `ray` CLI in another shell fails with InvalidAuthToken, because
the CLI only sends the token when its own environment says `RAY_AUTH_MODE=token` (it reads the token
from `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`).

We keep the authentication (the dashboard binds to 127.0.0.1, but Ray's other ports listen on the
node's address, and anyone who reaches them can run code), set the mode explicitly so Ray's generic
warning gives way to our instructions, and print them: URL, where the token is, the CLI's one export.
`RAY_AUTH_MODE=disabled` set by the user is respected, with a loud warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"


def choose_local_auth_mode() -> str:
    """The auth mode of the local Ray instance about to start: the user's `RAY_AUTH_MODE`, else "token".

    Setting the variable here (instead of letting `ray.init` do it) changes nothing in what Ray does but
    replaces its warning with `watch_instructions`. Ray caches its config at import, so it is re-read.
    """
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is None:
        os.environ[AUTH_MODE_ENV] = mode = "token"
        try:  # what ray's own `_enable_token_auth` does after setting the variable
            from ray._raylet import Config  # type: ignore[attr-defined]

            Config.initialize("")
        except ImportError:  # a Ray without token authentication: nothing to refresh
            pass
    mode = mode.lower()
    if mode == "disabled":
        log.warning(
            "%s=disabled: this local Ray instance runs WITHOUT token authentication; anyone who can reach"
            " its ports can run code as you. Unset it to keep Ray's token authentication.",
            AUTH_MODE_ENV,
        )
    return mode


def token_location() -> str:
    """Where Ray reads the token from, in its own order: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")


def watch_instructions(dashboard_url: str | None, gcs_address: str, auth_mode: str, session_dir: str) -> str:
    """The lines printed once a local Ray instance is up: dashboard, authentication, CLI, metrics, report.

    The CLI lines name this instance's address: with several Ray instances on one machine (other users,
    tests) a bare `ray status` refuses to guess.
    """
    lines = ["how to watch this run:"]
    token = auth_mode == "token"
    if dashboard_url:
        url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
        lines.append(f"  dashboard:  {url}  (jobs, actors, logs; Metrics tab needs Prometheus + Grafana)")
        if token:
            lines.append(
                "              token authentication: paste the output of `ray get-auth-token` (token in"
                f" {token_location()}) into its 'Authentication Token Required' dialog"
            )
    else:
        lines.append("  dashboard:  off (INFIR2_RAY_DASHBOARD=0)")
    commands = f"ray status --address {gcs_address}; ray list actors --address {gcs_address}"
    if token:  # the CLI sends the token only when its own environment asks for token mode
        lines.append("  ray CLI:    export RAY_AUTH_MODE=token   (in the other shell, then:)")
        lines.append(f"              {commands}")
    else:
        lines.append(f"  ray CLI:    {commands}")
    lines.append(
        f"  metrics:    RAY_SESSION_DIR={session_dir} scripts/start_prometheus.sh"
        "  (Prometheus on 127.0.0.1:9090, ray_infir2_* series)"
    )
    lines.append("  live plots: infir2-rl report RUN_DIR --watch  (progress, ETA and PNGs, no server)")
    return "\n".join(lines)
