#!/usr/bin/env bash
# Join this machine to an infir2-rl Ray cluster as a worker node.
#
#   scripts/start_worker.sh HEAD_IP[:PORT] [extra `ray start` flags, e.g. --num-gpus=8]
#
# PORT defaults to RAY_PORT or 6379 (the head's GCS port). METRICS_PORT [8080] is this node's
# Prometheus endpoint. Every node needs the same Python environment (pip install -e . or the image in
# docker/) and, for checkpoints, the same shared filesystem path for run directories.
# The head's Ray auth token must be here (scripts/ray_auth.sh says where Ray looks for it).
set -euo pipefail
# shellcheck source=scripts/ray_auth.sh
. "$(dirname "$0")/ray_auth.sh"
ray_auth_setup require

if [[ $# -lt 1 ]]; then
  echo "usage: $0 HEAD_IP[:PORT] [extra ray start flags]" >&2
  exit 2
fi
address="$1"
shift
if [[ "${address}" != *:* ]]; then
  address="${address}:${RAY_PORT:-6379}"
fi

ray start --address="${address}" --metrics-export-port="${METRICS_PORT:-8080}" "$@"
