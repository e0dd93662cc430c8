#!/usr/bin/env bash
# The run behind docs/img/dashboard.png: `mooncake serve` (1 prefill + 1 decode), a real
# Prometheus (Debian's package) scraping it with deploy/prometheus/prometheus.yml and its rules
# (targets moved to this run's ports), load from `mooncake bench` in three phases (steady, an
# overload burst of long prompts, steady again), then the dashboard's panels drawn from
# Prometheus by deploy/grafana/render_panels.py. Everything runs on loopback and stops at the end.
#
#   bash benchmarks/dashboard_run.sh [OUT.png]     (about 10 minutes; needs `make setup monitoring-tools`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-docs/img/dashboard.png}
WORK=$(mktemp -d /tmp/mooncake-dashboard.XXXXXX)
port() { "$PY" -c 'from mooncake.net import free_port; print(free_port())'; }
CONDUCTOR=$(port); WORKER=$(port); PROM=$(port)
# A TTFT SLO that a burst of long prompts on two CPU cores can break, so refusals and misses show.
SERVE_ARGS=(--ttft-slo 8 --tbt-slo 0.5 --no-flexible-roles --kv-cache-gib 1)

cleanup() {
    for pid in ${PROM_PID:-} ${SERVE_PID:-}; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

# TMPDIR: the workers' control sockets live in this run's own folder.
TMPDIR="$WORK" "$PY" -m mooncake.cli serve --port "$CONDUCTOR" --worker-port "$WORKER" "${SERVE_ARGS[@]}" \
    >"$WORK/serve.log" 2>&1 &
SERVE_PID=$!

# The committed scrape config, with this run's targets and absolute rule paths.
"$PY" - "$WORK/prometheus.yml" "$CONDUCTOR" "$WORKER" <<'EOF'
import sys, yaml
from pathlib import Path
out, conductor, worker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = Path("deploy/prometheus").resolve()
config = yaml.safe_load((base / "prometheus.yml").read_text())
config["rule_files"] = [str(base / f) for f in config["rule_files"]]
jobs = {job["job_name"]: job for job in config["scrape_configs"]}
jobs["mooncake-conductor"]["static_configs"] = [{"targets": [f"127.0.0.1:{conductor}"]}]
jobs["mooncake-worker"]["static_configs"] = [{"targets": [f"127.0.0.1:{worker}"], "labels": {"role": "prefill"}},
                                            {"targets": [f"127.0.0.1:{worker + 1}"], "labels": {"role": "decode"}}]
Path(out).write_text(yaml.safe_dump(config))
EOF
promtool check config "$WORK/prometheus.yml" >/dev/null
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
    --web.listen-address="127.0.0.1:$PROM" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!

for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$CONDUCTOR/health" >/dev/null && break
    kill -0 "$SERVE_PID" || { tail -30 "$WORK/serve.log"; exit 1; }
    sleep 1
done
START=$(date +%s)
URL="http://127.0.0.1:$CONDUCTOR/v1"
bench() { "$PY" -m mooncake.cli bench --url "$URL" --ttft-slo 8 --tbt-slo 0.5 --output-len 32 "$@"; }
echo "phase 1: steady, shared 256-token prefix"
bench --rate 0.4 --num-requests 50 --input-len 200-1200 --shared-prefix 256 --seed 1 >"$WORK/bench1.txt" 2>&1
echo "phase 2: overload burst of long prompts"
bench --rate 3 --num-requests 30 --input-len 1500-3000 --seed 2 >"$WORK/bench2.txt" 2>&1
echo "phase 3: steady again"
bench --rate 0.4 --num-requests 30 --input-len 200-1200 --shared-prefix 256 --seed 3 >"$WORK/bench3.txt" 2>&1
sleep 20  # two more rule evaluations after the last request
END=$(date +%s)
"$PY" deploy/grafana/render_panels.py --prometheus "http://127.0.0.1:$PROM" --end "$END" \
    --minutes "$(( (END - START) / 60 + 1 ))" --out "$OUT"
curl -s "http://127.0.0.1:$PROM/api/v1/alerts" >"$WORK/alerts.json"
echo "logs, bench summaries and alerts in $WORK"
tail -n 12 "$WORK"/bench*.txt
