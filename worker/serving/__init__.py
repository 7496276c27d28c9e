"""The worker's gRPC layer: the `Generation` and `WorkerControl` services, the server process
and its Prometheus metrics."""
