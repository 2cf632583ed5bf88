"""Ray Serve plumbing: ``build_app`` (app.py), the ingress and engine deployments, the engine as one
replica serves it, the option list (``AppArgs``, the keys of serve.yaml) and the loopback binding."""
