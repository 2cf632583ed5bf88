"""pagedray.deploy: the Ray Serve front end (OpenAI-compatible HTTP, Python handles, YAML, CLI), in rooms.

How a request flows through this package::

    HTTP ─▶ http/routes.py (FastAPI routes, auth, body limit, SSE)  ┐
    handle ─▶ serve/ingress.py (OpenAIIngress handle methods)       ┴▶ openai/service.py (OpenAIService)
        openai/protocol.py   request/response models    openai/validation.py -> PreparedRequest (400/404)
        openai/streaming.py  engine outputs -> text deltas (openai/detokenizer.py: text + stop strings)
        openai/formatting.py deltas -> OpenAI objects     openai/metrics.py    Prometheus text
    ─▶ serve/engine_deployment.py (EngineDeployment: AsyncEngine, TP workers in the replica's bundles;
       routing/router.py picks the replica) -- or, with engine_in_ingress, serve/served_engine.py in the
       ingress itself

Rooms, each importing only those before it (tests/test_layers.py): ``openai/`` (the protocol, no Ray),
``bridges/`` (the Responses and Messages APIs as translations onto chat), ``routing/`` (router, registry,
autoscaling policy), ``http/`` (routes, connection guard, grafana/), ``serve/`` (app, ingress, engine
deployment, served engine, options, loopback, serve.yaml), ``cli/`` (the ``pagedray`` command, the only
room that starts Ray). ``loadtest/`` is the cluster load tester (``pagedray loadtest``).

Entry points: ``pagedray.deploy.app:build_app`` (the Serve application; serve.yaml and users' YAML name
this path, which re-exports ``serve/app.py``'s; its args are ``serve/options.py``'s list),
``pagedray.deploy.autoscaling:kv_pressure_policy`` (likewise, from ``routing/autoscaling.py``) and
``cli/main.py``'s ``main`` (the ``pagedray`` command). Nothing is imported here, so that importing a
submodule (e.g. the load tester) does not pull in Ray Serve.
"""
