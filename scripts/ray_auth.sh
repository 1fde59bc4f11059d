#!/usr/bin/env bash
# Sourced by start_head.sh, start_worker.sh and submit.sh: Ray token authentication, on unless the user
# turns it off explicitly. Ray (>= 2.52) reads the token from RAY_AUTH_TOKEN, else the file in
# RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; the head, every worker and every machine that submits
# jobs or opens the dashboard need the same token. `ray start` would otherwise run a head WITHOUT
# authentication when no token file exists, and the `ray` CLI sends the token only when RAY_AUTH_MODE=token
# is in its environment.
#
#   ray_auth_setup generate   # head: create ~/.ray/auth_token when no token is found
#   ray_auth_setup require    # worker / submitter: fail with the fix when no token is found

ray_auth_setup() {
  if ! command -v ray >/dev/null 2>&1; then
    echo "infir2-rl: no \`ray\` command on PATH: activate the environment where infir2-rl is installed" >&2
    return 1
  fi
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
  if [[ "${RAY_AUTH_MODE}" != "token" ]]; then
    echo "infir2-rl: WARNING: RAY_AUTH_MODE=${RAY_AUTH_MODE}: this Ray cluster runs WITHOUT token" \
      "authentication; anyone who can reach its ports can run code on it. Unset RAY_AUTH_MODE to keep it." >&2
    return 0
  fi
  if [[ -n "${RAY_AUTH_TOKEN_PATH:-}" && -z "${RAY_AUTH_TOKEN:-}" && ! -f "${RAY_AUTH_TOKEN_PATH}" ]]; then
    echo "infir2-rl: RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH}: no such file; put the cluster's token there" >&2
    return 1
  fi
  if ray get-auth-token >/dev/null 2>&1; then
    return 0
  fi
  if [[ "$1" == "generate" ]]; then
    ray get-auth-token --generate >/dev/null 2>&1 || { echo "infir2-rl: \`ray get-auth-token --generate\` failed" >&2; return 1; }
    chmod 600 "${HOME}/.ray/auth_token"
    echo "infir2-rl: generated a Ray auth token in ${HOME}/.ray/auth_token; copy it to every worker and" \
      "submitting machine (same path), or export RAY_AUTH_TOKEN=\$(ray get-auth-token) there" >&2
    return 0
  fi
  echo "infir2-rl: no Ray auth token found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token):" \
    "copy the head's ~/.ray/auth_token to ~/.ray/auth_token here, or export RAY_AUTH_TOKEN=<the head's token>" >&2
  return 1
}
