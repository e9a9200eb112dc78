#!/bin/bash
# Start-up of `tidal serve` on an empty cache: the first-ever start (compiling), the second
# (measuring and storing the step-cost profile) and a warm third, each timed from launch to
# /health answering 200; the first also until its background compile lands.
#   bash benchmarks/startup.sh [PORT] [-- extra tidal serve flags]
set -euo pipefail
port=${1:-8123}
shift || true
[ "${1:-}" = "--" ] && shift
cache=$(mktemp -d)
logs=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
for run in 1 2 3; do
  log=$logs/serve-$run.log
  t0=$(date +%s.%N)
  TIDAL_CACHE_DIR=$cache tidal serve --port "$port" "$@" > "$log" 2>&1 &
  pid=$!
  until curl -sf "127.0.0.1:$port/health" > /dev/null; do
    kill -0 $pid 2> /dev/null || { cat "$log"; exit 1; }
    sleep 0.1
  done
  echo "start $run: ready after $(echo "$(date +%s.%N) - $t0" | bc) s"
  if [ $run = 1 ]; then
    until grep -q "compiled steps landed\|in the background failed" "$log" || ! grep -q "in the background" "$log"; do
      curl -s "127.0.0.1:$port/v1/completions" -H "Content-Type: application/json" \
        -d '{"prompt": "Hi", "max_tokens": 4}' > /dev/null
      sleep 1
    done
    echo "start 1: background compile done after $(echo "$(date +%s.%N) - $t0" | bc) s"
  fi
  kill $pid; wait $pid || true
  grep "start-up\|compil\|landed" "$log" | sed 's/^/    /'
done
echo "logs: $logs"
