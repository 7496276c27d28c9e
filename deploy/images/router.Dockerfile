# The router image: grpc, protobuf and headrace's protos, SDK and router. No torch.
#   docker build -f deploy/images/router.Dockerfile -t headrace-router .   (from the repo root)
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=wheel /wheels /wheels
# Only the router extra. The final check fails the build if torch slipped in.
RUN pip install --no-cache-dir "$(ls /wheels/headrace-*.whl)[router]" \
    && rm -rf /wheels \
    && if python -c "import torch" 2>/dev/null; then echo "torch in the router image" >&2; exit 1; fi
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin headrace
USER 10001
# gRPC (Generation, grpc.health.v1) and Prometheus /metrics.
EXPOSE 50051 9400
# The flags are CMD, so `docker run IMAGE --workers HOST:PORT ...` and the Kubernetes args
# (deploy/k8s/base/router.yaml) each give the whole set.
ENTRYPOINT ["headrace", "router"]
CMD ["--workers-dns", "headrace-worker:50051", "--port", "50051", "--metrics-port", "9400"]
