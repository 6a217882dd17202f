#!/usr/bin/env bash
# GPU readiness check (bench/gpu_check.py) on a lent GPU machine, as one prepared run.
#
#   bench/gpu_check.sh prepare   # here, in the repo root: .gpucheck/ = the tokenizer folder and
#                                # the wheels the device lacks (gguf), ignored by git
#   bench/gpu_check.sh run       # there: installs the package and the wheels under /tmp, runs
#                                # the check; the log and gpu_check.json go to $OUT (or ./out)
#
# The device machine has no network and its own torch (CUDA); only small files travel, so the
# check writes random-weight models of public shapes on the device itself.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpucheck

case "${1:-}" in
prepare)
	PY=${PYTHON:-.venv/bin/python}
	rm -rf "$STAGE" && mkdir -p "$STAGE/wheels" "$STAGE/tokenizer"
	grep -qx "/$STAGE/" .git/info/exclude 2>/dev/null || echo "/$STAGE/" >>.git/info/exclude
	# SmolLM2's config, tokenizer and chat template (its weights stay here: random ones are made there)
	"$PY" -m syshax.cli convert default "$STAGE/hf" --dtype bfloat16 --no-progress --force
	cp "$STAGE"/hf/*.json "$STAGE/tokenizer/" && rm -rf "$STAGE/hf"
	"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$STAGE/wheels" gguf==0.19.0
	du -sh "$STAGE"
	;;
run)
	OUT=${OUT:-$PWD/out}
	mkdir -p "$OUT"
	# The package without its pinned torch (the device's CUDA torch stays), plus gguf.
	python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . "$STAGE"/wheels/*.whl
	export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
	nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
	python3 bench/gpu_check.py --tokenizer "$STAGE/tokenizer" --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/gpu_check.log"
	;;
*)
	echo "usage: $0 prepare|run [gpu_check.py options]" >&2
	exit 2
	;;
esac
