#!/usr/bin/env bash
# GPU check of kvagent's KV tiers (CPU + fs): see README.md beside this file.
# Usage: tools/gpu/check_tiers.sh [--dry-run] [--model PATH] [--out report.json]
# Needs: an NVIDIA GPU, `pip install vllm nixl` and this repo (`pip install -e .[server]`).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [[ " $* " != *" --dry-run "* ]]; then
  command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this check needs a GPU" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
"$PY" -c "import vllm, kvagent_server; print('vllm', vllm.__version__)" \
  || { echo "install vllm, nixl and kvagent first" >&2; exit 2; }
"$PY" -c "import nixl" 2>/dev/null || echo "warning: nixl not importable (the NIXL child connector will fail to start)" >&2
exec "$PY" -m tools.gpu.check_tiers "$@"
