"""Between engine replicas: the cache-aware request router, the registry of this process' routers, and
the KV-pressure autoscaling policy."""
