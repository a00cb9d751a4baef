#!/usr/bin/env bash
# On a GPU machine without network: join the chunks offline_site.py built, check their
# digests, unpack them, put them on PYTHONPATH and run run_device_checks.sh (see README.md).
#
# Usage: tools/gpu/assemble_site.sh DIR [DIR...] -- [run_device_checks.sh options]
#   DIRs hold the chunks (site.tar.xz.NN) and manifest.json, split across them any way
#   (one transfer each). --pack OUTDIR (before --) runs the checks into a work folder and
#   leaves in OUTDIR only summary.md, run.log, results.json and device-checks.tar.gz (all
#   of it), for a transfer that brings back few files.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
SITE=${KVAGENT_SITE:-/tmp/kvagent-site}
DIRS=()
PACK=""
while [[ $# -gt 0 && $1 != -- ]]; do
  case "$1" in
    --pack) PACK=$2; shift ;;
    *) DIRS+=("$1") ;;
  esac
  shift
done
[[ ${1:-} == -- ]] && shift
(( ${#DIRS[@]} )) || { sed -n '2,11p' "$0"; exit 2; }

# The manifest names the chunks in order with their digests; find each in any DIR. The
# last line printed is the manifest's vLLM series.
JOINED=$("$PY" - "$SITE" "${DIRS[@]}" <<'EOF'
import hashlib, json, sys
from pathlib import Path
site, dirs = Path(sys.argv[1]), [Path(d) for d in sys.argv[2:]]
found = [d / "manifest.json" for d in dirs if (d / "manifest.json").is_file()]
if not found:
    sys.exit(f"no manifest.json in {', '.join(map(str, dirs))}")
manifest = json.loads(found[0].read_text())
whole = hashlib.sha256()
with open(site.parent / "kvagent-site.tar.xz", "wb") as out:
    for chunk in manifest["chunks"]:
        paths = [d / chunk["name"] for d in dirs if (d / chunk["name"]).is_file()]
        if not paths:
            sys.exit(f"chunk {chunk['name']} is in none of {', '.join(map(str, dirs))}")
        data = paths[0].read_bytes()
        if hashlib.sha256(data).hexdigest() != chunk["sha256"]:
            sys.exit(f"chunk {paths[0]} does not match its digest")
        whole.update(data)
        out.write(data)
if manifest["chunks"] and whole.hexdigest() != manifest["chunks"][0]["archive_sha256"]:
    sys.exit("the joined archive does not match its digest")
print(f"joined {len(manifest['chunks'])} chunks: vllm {manifest['vllm']}, "
      f"nixl {manifest['nixl']}, {len(manifest['carried'])} packages")
print(manifest["allow_vllm"])
EOF
) || exit 3
echo "${JOINED%$'\n'*}"
rm -rf "$SITE" && mkdir -p "$SITE"
xz -dc -T0 "$(dirname "$SITE")/kvagent-site.tar.xz" | tar -x -C "$SITE" || { echo "unpack failed"; exit 4; }
rm -f "$(dirname "$SITE")/kvagent-site.tar.xz"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# The manifest's vLLM series may be one the plugin runs on only when named (known gap).
KVAGENT_ALLOW_VLLM=${KVAGENT_ALLOW_VLLM:-${JOINED##*$'\n'}}
export KVAGENT_ALLOW_VLLM PYTHONUNBUFFERED=1
"$PY" -c "import torch, vllm, nixl; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
  || exit 5
if [[ -z $PACK ]]; then
  exec tools/gpu/run_device_checks.sh "$@"
fi
WORKOUT=$(mktemp -d /tmp/kvagent-dc.XXXXXX)
tools/gpu/run_device_checks.sh --out "$WORKOUT" "$@"
rc=$?
mkdir -p "$PACK"
cp "$WORKOUT/summary.md" "$WORKOUT/run.log" "$PACK/" 2>/dev/null
cp "$WORKOUT/multiturn/results.json" "$PACK/results.json" 2>/dev/null
tar -czf "$PACK/device-checks.tar.gz" -C "$WORKOUT" .
exit "$rc"
