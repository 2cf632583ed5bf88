"""pagedray.deploy: the Ray Serve front end (OpenAI-compatible HTTP, Python handles, YAML, CLI).

How a request flows through this package::

    HTTP ─▶ api.py (FastAPI routes, auth, body limit, SSE)  ┐
    handle ─▶ ingress.py (OpenAIIngress handle methods)     ┴▶ service.py (OpenAIService)
        protocol.py  request/response models      validation.py  -> PreparedRequest (400/404 here)
        generation.py engine outputs -> text deltas (detokenizer.py: incremental text + stop strings)
        openai_format.py  deltas -> OpenAI objects               metrics.py  Prometheus text
    ─▶ engine_deployment.py (EngineDeployment: AsyncEngine, TP workers in the replica's bundles;
       routing.py picks the replica) -- or, with engine_in_ingress, served_engine.py in the ingress itself

Entry points: ``app.build_app(args)`` (Serve application; ``serve.yaml`` points at it; its args are
``options.py``'s list) and ``cli.main`` (the ``pagedray`` command; ``startup.py`` watches the deploy).
``loadtest/`` is the cluster load tester (``pagedray loadtest``). Nothing is imported here, so that
importing a submodule (e.g. the load tester) does not pull in Ray Serve.
"""
