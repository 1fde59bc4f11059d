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
# A head that has just started answers "No available agent to submit job" (HTTP 500) until its job agent has
# registered (seconds; longer on a loaded machine): nothing was submitted then, so try again, up to
# SUBMIT_AGENT_WAIT_S seconds (default 60). Any other failure, or the job's own, ends here with its code.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
deadline=$(( $(date +%s) + ${SUBMIT_AGENT_WAIT_S:-60} ))
while true; do
  rc=0
  # shellcheck disable=SC2086  # RAY_JOB_SUBMIT_FLAGS is a list of flags
  ray job submit --address "${RAY_ADDRESS}" --working-dir . ${RAY_JOB_SUBMIT_FLAGS:-} -- \
    python -m infir2_rl.cli run "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  if [[ $rc -eq 0 ]] || ! grep -q "No available agent to submit job" "$log" || (( $(date +%s) >= deadline )); then
    exit "$rc"
  fi
  echo "submit.sh: the head's job agent is not up yet; trying again in 3 s" >&2
  sleep 3
done
