#!/usr/bin/env bash
# Inter-token tails, side by side: the farm at a base commit, the farm as checked out, and
# llama-server, alternating rounds of `bench/serve.py` on the 1B Q4_0 random-weight shape
# (light raw SSE client, 1 / 4 / 16 streams). The base runs from a `git worktree` of BASE
# with the editable install pointed at it (a sitecustomize shim on PYTHONPATH), so both
# farms share this venv and the compiled kernels' cache.
#
#   bench/itl_compare.sh [BASE [ROUNDS [OUT]]]     # defaults: HEAD~1, 2, /tmp/itl-compare
#
# Each round: base farm, then this farm followed by llama-server (`--against`). Extra
# serve.py arguments come from $SERVE_ARGS (e.g. "--set prompt_stretch=1.5"). Tables are
# printed and kept in OUT/*.txt, per-request data in OUT/*.json. Takes ~15 min a round on 2
# quiet cores. Note `uptime` before trusting a run: other work on the cores sets the tails.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
BASE=${1:-HEAD~1}
ROUNDS=${2:-2}
OUT=${3:-/tmp/itl-compare}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
WT=$OUT/base-tree
SHIM=$OUT/shim
mkdir -p "$OUT" "$SHIM"
GGUF=$("$PY" "$ROOT/bench/gguf_shapes.py" --shape 1b --type Q4_0 | tail -1)
if [ ! -d "$WT" ]; then git -C "$ROOT" worktree add --detach "$WT" "$BASE" >/dev/null; fi
cat >"$SHIM/sitecustomize.py" <<PYEOF
import sys
mod = sys.modules.get("__editable___syshax_farm_0_1_0_finder")
if mod is not None:
    for k, v in list(mod.MAPPING.items()):
        mod.MAPPING[k] = v.replace("$ROOT", "$WT")
    for k, v in list(mod.NAMESPACES.items()):
        mod.NAMESPACES[k] = [p.replace("$ROOT", "$WT") for p in v]
PYEOF
ARGS=(--launch native --load "$GGUF" --client raw --num-prompts 16 --input-len 128
      --output-len 64 --concurrency-list 1,4,16)
for r in $(seq 1 "$ROUNDS"); do
    echo "# round $r, base $(git -C "$WT" rev-parse --short HEAD), $(date -u +%H:%M), load: $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd "$WT" && PYTHONPATH=$SHIM nice -n 10 "$PY" bench/serve.py "${ARGS[@]}" ${SERVE_BASE_ARGS:-} \
        --json "$OUT/base-$r.json") 2>"$OUT/base-$r.err" | tee "$OUT/base-$r.txt"
    echo "# round $r, this tree + llama-server, $(date -u +%H:%M), load: $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd "$ROOT" && nice -n 10 "$PY" bench/serve.py "${ARGS[@]}" ${SERVE_ARGS:-} --against llama-server \
        --json "$OUT/new-$r.json") 2>"$OUT/new-$r.err" | tee "$OUT/new-$r.txt"
done
echo "# done $(date -u +%H:%M); remove the base tree with: git worktree remove --force $WT"
