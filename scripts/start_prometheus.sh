#!/usr/bin/env bash
# Start Prometheus (Debian's `prometheus` package: apt-get install prometheus; nothing is downloaded
# here) scraping every node of a Ray cluster, through the service-discovery file Ray keeps up to date
# in its session directory (one target per node's metrics export port). Run it on the head machine.
#
#   scripts/start_prometheus.sh            # in the foreground; Ctrl-C stops it
#
# Environment (defaults in brackets): RAY_SESSION_DIR [RAY_TEMP_DIR/session_latest] the Ray session to
# scrape (a local run prints its own; session_latest is the newest Ray started on the machine, which
# with several Ray instances may be another one); RAY_TEMP_DIR [/tmp/ray] Ray's --temp-dir; PROMETHEUS_LISTEN
# [127.0.0.1:9090] address of Prometheus's UI and HTTP API; PROMETHEUS_DATA [RAY_TEMP_DIR/prometheus]
# its config and time-series storage; SCRAPE_INTERVAL [10s]. Extra flags go to `prometheus`.
# Our metrics are the `ray_infir2_*` series, tagged by stage, e.g. ray_infir2_rollout_reward_mean{stage="rl_stage1"}.
# For the Ray dashboard's Metrics tab, start the head with RAY_PROMETHEUS_HOST=http://<this listen address>.
set -euo pipefail

if ! command -v prometheus >/dev/null 2>&1; then
  echo "prometheus is not installed: apt-get install -y prometheus (Debian/Ubuntu package)" >&2
  exit 2
fi
temp_dir="${RAY_TEMP_DIR:-/tmp/ray}"
session="${RAY_SESSION_DIR:-${temp_dir}/session_latest}"
# Ray's dashboard writes the file (a Ray started without its dashboard has none)
discovery="${session}/prom_metrics_service_discovery.json"
if [[ ! -f "${discovery}" ]]; then
  echo "no ${discovery}: start Ray (with its dashboard) first, or set RAY_SESSION_DIR to the run's session" \
    "directory (a local run prints it) or RAY_TEMP_DIR to Ray's --temp-dir" >&2
  exit 2
fi
# session_latest is a link to the current session; the file is resolved now, as Prometheus watches a file
discovery="$(readlink -f "${discovery}")"
listen="${PROMETHEUS_LISTEN:-127.0.0.1:9090}"
data="${PROMETHEUS_DATA:-${temp_dir}/prometheus}"
mkdir -p "${data}"
cat >"${data}/prometheus.yml" <<YAML
global:
  scrape_interval: ${SCRAPE_INTERVAL:-10s}
  evaluation_interval: ${SCRAPE_INTERVAL:-10s}
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: ['${discovery}']
YAML
echo "infir2-rl: Prometheus on http://${listen} scraping the Ray nodes listed in ${discovery}" >&2
exec prometheus \
  --config.file="${data}/prometheus.yml" \
  --storage.tsdb.path="${data}/tsdb" \
  --web.listen-address="${listen}" \
  "$@"
