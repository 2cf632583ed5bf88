"""The environment of a Ray started by ``pagedray serve`` (values already set win). Imports nothing, so that
test set-ups on machines without the serving stack (the GPU image has no Ray or uvicorn) can read it."""

# Serve's proxy gets 60 s for its checks, and Ray's worker processes (the model ranks, the replicas) run at
# normal priority
LOCAL_RAY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                 "RAY_worker_niceness": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                 "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "RAY_SERVE_PORT_QUARANTINE_S": "0",
                 "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}
