"""The OpenAI protocol without a transport: request models and validation, the service that runs a
request against an engine client, text deltas, response objects, SSE framing and error bodies. Imports
no Ray and no other room of ``pagedray.deploy`` (tests/test_layers.py)."""
