"""Two engine replicas behind the cache-aware router (the real app, default model, fp32, 1 thread per rank).

/metrics and /health cover both replicas (from the summaries Serve's poll brings the router).

Requests sharing a prompt prefix, sent one after another, must all land on the replica that computed
the prefix first (the router remembers what it sent where), so every one after the first reads the
shared blocks from the prefix cache (``usage.prompt_tokens_details.cached_tokens``). With Serve's default
router each of them would pick one of the two replicas at random.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from helpers.serve_fixtures import API_KEY, start_app, stop_app

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

SHARED = ("You are a careful assistant for a small bakery. Answer in one short sentence, name the product, "
          "give its price in euros and never invent products that are not on the menu of the day. ")


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, num_replicas=2, request_router="cache_aware", threads_per_worker=1)
    yield running
    stop_app(running)


def test_requests_sharing_a_prefix_follow_the_replica_that_cached_it(app, default_model_path):
    from transformers import AutoTokenizer

    shared = AutoTokenizer.from_pretrained(default_model_path).encode(SHARED)
    full_blocks = len(shared) // 16 * 16
    assert full_blocks >= 32
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=app.url, headers=auth, timeout=300, trust_env=False) as http:
        cached = []
        for question in ("Bread?", "Croissants?", "Cake?", "Tea?", "Coffee?", "Pies?"):
            body = {"prompt": SHARED + question, "max_tokens": 2, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0
    assert all(tokens >= full_blocks - 16 for tokens in cached[1:]), cached   # the question may split a block


def test_metrics_and_health_cover_both_replicas(app):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    healthy_line = re.compile(r'pagedray:engine_healthy\{model_name="[^"]+",replica="([^"]+)"\} 1.0')
    with httpx.Client(base_url=app.url, headers=auth, timeout=300, trust_env=False) as http:
        deadline = time.monotonic() + 120   # hang guard: the replicas report once a second
        while len(replicas := set(healthy_line.findall(http.get("/metrics").text))) < 2:
            assert time.monotonic() < deadline, replicas
            time.sleep(0.5)
        text = http.get("/metrics").text
        for replica in replicas:
            assert f'pagedray:num_requests_running{{model_name="{app.model}",replica="{replica}"}}' in text
            assert f'pagedray:prefix_cache_queries_total{{model_name="{app.model}",replica="{replica}"}}' in text
        assert http.get("/health").status_code == 200



def test_a_cached_prefix_moves_to_the_other_replica_through_the_object_store(app, default_model_path):
    """The driver's handle: ``export_prefix`` goes to the replica that cached the prefix, its shards come back as
    object-store refs, and ``import_prefix`` goes to the replica without it (routing/router.py), after which both
    replicas report the prefix's blocks. Both replicas run a PeerPull (serve/kv_pull.py)."""
    import ray
    from helpers.serve_fixtures import APP_NAME
    from pagedray.block_manager import prefix_block_hashes
    from pagedray.deploy.routing.router import replica_summaries
    from transformers import AutoTokenizer

    text = "A different shop: a florist that sells tulips, roses and lilies by the stem, and ferns by the pot. "
    shared = AutoTokenizer.from_pretrained(default_model_path).encode(text * 3)
    tokens = shared[:len(shared) // 16 * 16]
    hashes = prefix_block_hashes(tokens, 16)
    with httpx.Client(base_url=app.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                      trust_env=False) as http:
        response = http.post("/v1/completions", json={"prompt": text * 3, "max_tokens": 1, "temperature": 0})
        assert response.status_code == 200, response.text
    handle = app.engine_handle()

    def holders() -> int:
        return sum(set(hashes) <= set(s.get("prefix_hashes") or ())
                   for s in replica_summaries(APP_NAME, app.engine_deployment) or [])

    deadline = time.monotonic() + 120        # hang guard: the summaries reach the driver's router once a second
    while holders() < 1:
        assert time.monotonic() < deadline
        handle.stats.remote().result()        # a call: the driver's router exists from the handle's first one
        time.sleep(0.5)
    export = handle.export_prefix.remote(tokens, None, exclude="the driver").result()
    assert export.token_ids == tokens and len(export.shards) == 1
    assert isinstance(export.shards[0], ray.ObjectRef)
    assert len(ray.get(export.shards[0])) == export.num_blocks * export.layout.rank_block_bytes
    assert handle.import_prefix.remote(export).result() == len(tokens)
    while holders() < 2:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    reports = {}
    while len(reports) < 2:
        assert time.monotonic() < deadline
        replica, report = handle.peer_pull_report.remote().result()
        reports[replica] = report
    assert all(report is not None for report in reports.values())
