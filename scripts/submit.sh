#!/usr/bin/env bash
# Submit a stage or pipeline to the Ray cluster in RAY_ADDRESS; run it from the repository root.
#
#   RAY_ADDRESS=http://HEAD_IP:8265 scripts/submit.sh configs/sft_stage1.yaml [section.field=value ...]
#
# The current directory is uploaded as the job's working directory (files in .gitignore, such as runs/,
# are left out) and the job runs `python -m infir2_rl.cli run CONFIG ...` inside it, so the driver and
# every actor import the uploaded code (the `infir2-rl` console script would import the installed copy
# in the driver while actors import the uploaded one). Extra `ray job submit` flags go in
# RAY_JOB_SUBMIT_FLAGS (e.g. "--no-wait"). The head's Ray auth token must be available here
# (scripts/ray_auth.sh); `ray job submit` sends it because RAY_AUTH_MODE=token is exported.
set -euo pipefail
# shellcheck source=scripts/ray_auth.sh
. "$(dirname "$0")/ray_auth.sh"

if [[ -z "${RAY_ADDRESS:-}" ]]; then
  echo "set RAY_ADDRESS to the head's dashboard address, e.g. RAY_ADDRESS=http://HEAD_IP:8265" >&2
  exit 2
fi
if [[ $# -lt 1 ]]; then
  echo "usage: RAY_ADDRESS=http://HEAD_IP:8265 $0 CONFIG [section.field=value ...]" >&2
  exit 2
fi

ray_auth_setup require
# shellcheck disable=SC2086  # RAY_JOB_SUBMIT_FLAGS is a list of flags
ray job submit --address "${RAY_ADDRESS}" --working-dir . ${RAY_JOB_SUBMIT_FLAGS:-} -- \
  python -m infir2_rl.cli run "$@"
