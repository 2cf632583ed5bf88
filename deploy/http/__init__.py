"""The HTTP face of the ingress: FastAPI routes (auth, body limit, SSE) over ``openai/``'s service, and
the connection-level guard of the server that answers on ``--port``; ``grafana/`` holds a dashboard of
the /metrics series."""
