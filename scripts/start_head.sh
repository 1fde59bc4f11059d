#!/usr/bin/env bash
# Start the Ray head node of an infir2-rl cluster (run once, on the head machine).
#
#   scripts/start_head.sh [extra `ray start` flags, e.g. --num-gpus=8 --block]
#
# Environment (defaults in brackets): RAY_PORT [6379] GCS port workers join; DASHBOARD_PORT [8265]
# dashboard + job API (what RAY_ADDRESS points at); METRICS_PORT [8080] Prometheus endpoint of this
# node, where the run's metrics (ray_infir2_train_loss, ...) can be scraped.
# Stop it with `ray stop` on that machine (note: `ray stop` ends every Ray process of the host).
set -euo pipefail

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
INFO

ray start --head \
  --port="${ray_port}" \
  --dashboard-host=0.0.0.0 \
  --dashboard-port="${dashboard_port}" \
  --metrics-export-port="${metrics_port}" \
  "$@"
