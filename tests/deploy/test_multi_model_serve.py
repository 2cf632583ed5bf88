"""Several models in one Serve app (#66 part 3): the default chat model and a second, small model served for
embeddings, each in its own engine deployment behind one ingress that routes by ``model``. Each model's greedy
output equals its own engine's offline run (``LLM``, the engine a one-model app serves), /v1/models lists both,
and killing the second model's engine replica leaves the first one serving."""

from __future__ import annotations

import httpx
import pytest
from helpers.serve_fixtures import API_KEY, start_app, stop_app
from helpers.tiny_models import save_tiny_reranker

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SECOND = "tiny-embedder"
PROMPT = "The three primary colors are"
SECOND_OPTIONS = {"served_model_name": SECOND, "task": "embed", "executor": "local", "dtype": "float32",
                  "num_blocks": 64, "max_model_len": 256}


@pytest.fixture(scope="module")
def second_path(tmp_path_factory, default_model_path):
    return save_tiny_reranker(tmp_path_factory.mktemp("second-model"), default_model_path)


@pytest.fixture(scope="module")
def app(ray_session, default_model_path, second_path):
    running = start_app(default_model_path, executor="local", models=[{"model": second_path, **SECOND_OPTIONS}])
    yield running
    stop_app(running)


def _offline(path: str, **options):
    from pagedray.cluster import LLM, SamplingParams

    with LLM(path, threads_per_worker=1, **options) as llm:
        text = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
        vector = llm.embed([PROMPT], use_tqdm=False)[0].embedding
    return text, vector


def _engine_actor(deployment: str):
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and deployment in a["name"].replace(":", "#").split("#")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def test_two_models_answer_by_name_as_their_own_engines_and_one_dying_leaves_the_other(app, default_model_path,
                                                                                       second_path):
    from helpers.serve_fixtures import APP_ARGS

    http = httpx.Client(base_url=app.url, headers=AUTH, timeout=300, trust_env=False)
    ids = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert ids == [app.model, SECOND]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()                           # no model: the first one
    second = http.post("/v1/completions", json={**body, "model": SECOND}).json()
    embedded = http.post("/v1/embeddings", json={"model": SECOND, "input": PROMPT}).json()
    first_options = {k: APP_ARGS[k] for k in ("num_blocks", "max_model_len", "dtype")}
    expected_first, _ = _offline(default_model_path, **first_options)
    expected_second, vector = _offline(second_path, **{k: v for k, v in SECOND_OPTIONS.items()
                                                       if k not in ("served_model_name", "task", "executor")})
    assert first["model"] == app.model and first["choices"][0]["text"] == expected_first
    assert second["model"] == SECOND and second["choices"][0]["text"] == expected_second
    assert embedded["data"][0]["embedding"] == pytest.approx(vector, abs=1e-5)
    assert http.post("/v1/completions", json={**body, "model": "nope"}).status_code == 404

    import ray

    ray.kill(_engine_actor("PagedEngine-1"), no_restart=True)          # the second model's only replica
    again = http.post("/v1/completions", json=body)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected_first
