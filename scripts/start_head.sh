#!/usr/bin/env bash
# Start the Ray head node of an infir2-rl cluster (run once, on the head machine).
#
#   scripts/start_head.sh [extra `ray start` flags, e.g. --num-gpus=8 --block]
#
# Environment (defaults in brackets): RAY_PORT [6379] GCS port workers join; DASHBOARD_PORT [8265]
# dashboard + job API (what RAY_ADDRESS points at); METRICS_PORT [8080] Prometheus endpoint of this
# node, where the run's metrics (ray_infir2_train_loss, ...) can be scraped.
# Token authentication stays on (scripts/ray_auth.sh): a token is generated into ~/.ray/auth_token when
# none is found; workers, submitters and the dashboard's login dialog use that same token
# (`ray get-auth-token` prints it). RAY_AUTH_MODE=disabled turns it off, with a warning.
# The dashboard's Metrics tab embeds Grafana panels: export RAY_PROMETHEUS_HOST=http://127.0.0.1:9090
# (scripts/start_prometheus.sh) and RAY_GRAFANA_HOST=http://GRAFANA:3000 before starting the head.
# Stop it with `ray stop` on that machine (note: `ray stop` ends every Ray process of the host).
set -euo pipefail
# shellcheck source=scripts/ray_auth.sh
. "$(dirname "$0")/ray_auth.sh"
ray_auth_setup generate

ray_port="${RAY_PORT:-6379}"
dashboard_port="${DASHBOARD_PORT:-8265}"
metrics_port="${METRICS_PORT:-8080}"
host_ip="$(hostname -I 2>/dev/null | awk '{print $1}')"
host_ip="${host_ip:-127.0.0.1}"

cat <<INFO
infir2-rl: starting the Ray head; once it is up:
  workers:    scripts/start_worker.sh ${host_ip}:${ray_port}
  submit:     RAY_ADDRESS=http://${host_ip}:${dashboard_port} scripts/submit.sh CONFIG [overrides]
  dashboard:  http://${host_ip}:${dashboard_port}    metrics: http://${host_ip}:${metrics_port}/metrics
  auth:       RAY_AUTH_MODE=${RAY_AUTH_MODE}; dashboard login and other machines: the output of \`ray get-auth-token\`
  ray CLI:    export RAY_AUTH_MODE=${RAY_AUTH_MODE}; ray status --address ${host_ip}:${ray_port}
INFO

ray start --head \
  --port="${ray_port}" \
  --dashboard-host=0.0.0.0 \
  --dashboard-port="${dashboard_port}" \
  --metrics-export-port="${metrics_port}" \
  "$@"
