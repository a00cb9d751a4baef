#!/usr/bin/env bash
# Ctrl-C on a foreground `kvagent-server up` under load: run its test N times in a row
# with busy loops on every core beside it, and count. See README.md beside this file.
#
# Usage: tools/ctrl_c/repeat.sh [N]        (default 20)
#   PYTHON=...      the interpreter with kvagent[server] and pytest (default .venv/bin/python)
#   LOAD_PROCS=...  busy loops beside the test (default: one per core, `nproc`)
#   LOAD_MAX_S=...  hard cap on each busy loop's life, should this script itself be killed
#                   (default 3600)
#   TEST=...        the pytest node id (default: the Ctrl-C test, both parametrizations)
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:-20}
PY=${PYTHON:-.venv/bin/python}
LOAD_PROCS=${LOAD_PROCS:-$(nproc)}
LOAD_MAX_S=${LOAD_MAX_S:-3600}
TEST=${TEST:-tests/bundle/test_supervisor.py::test_cli_foreground_ctrl_c_stops_everything}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/kvagent-ctrl-c.XXXXXX")

[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [N]  (N a positive integer)" >&2; exit 2; }
[ -x "$PY" ] || command -v "$PY" >/dev/null || { echo "no interpreter $PY (set PYTHON)" >&2; exit 2; }

LOAD_PIDS=()
stop_load() {
  local pid
  for pid in "${LOAD_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${LOAD_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  LOAD_PIDS=()
}
trap stop_load EXIT
trap 'stop_load; exit 130' INT
trap 'stop_load; exit 143' TERM

for _ in $(seq "$LOAD_PROCS"); do
  # `timeout` bounds each loop even if this script is SIGKILLed and its trap never runs.
  timeout "$LOAD_MAX_S" "$PY" -c 'while True: pass' &
  LOAD_PIDS+=("$!")
done
echo "load: $LOAD_PROCS busy loops (pids ${LOAD_PIDS[*]}); logs of failed runs in $LOGS"

passed=0 failed=0
for i in $(seq "$N"); do
  log="$LOGS/run-$i.log"
  start=$(date +%s.%N)
  if "$PY" -m pytest -p no:cacheprovider -q -x "$TEST" >"$log" 2>&1; then
    passed=$((passed + 1)) verdict=passed
    rm -f "$log"
  else
    failed=$((failed + 1)) verdict="FAILED (log: $log)"
  fi
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  echo "run $i/$N: $verdict in $took s"
done
stop_load
rmdir "$LOGS" 2>/dev/null  # kept only when it holds a failed run's log
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
