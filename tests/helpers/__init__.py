"""Test support shared by every test folder (importable as ``helpers.<module>``: pytest puts ``tests/``
on ``sys.path``, see pyproject.toml).

- ``hf_oracle``: transformers' greedy ``generate`` and log-probs, the correctness oracle.
- ``tiny_models``: tiny random Hugging Face model folders of each supported architecture.
- ``worker_setup``: engine configs and workers (in-process or Ray actors) over those folders.
- ``ports``: free TCP ports on loopback.
- fakes and harnesses: ``fake_executor``, ``scheduler_harness``, ``fake_engine``, ``fake_openai_server``,
  ``gates``, ``worker_plans``, ``paged_kv_cases``, ``serve_fixtures``, ``bad_requests``,
  ``fuzz_requests``, ``burst_load``, ``abort_soak``.
"""
