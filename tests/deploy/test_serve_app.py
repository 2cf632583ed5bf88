"""The real Serve application (ingress + engine deployment + Ray TP worker, default model, fp32).

One app for this module, on 127.0.0.1 and a free port, in the session's Ray instance. The official
``openai`` client for the happy paths, httpx for errors, DeploymentHandles for the Python API.
Oracle for greedy text: the offline ``LLM`` API on the same model.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest
from helpers.bad_requests import assert_openai_error, bad_request_cases, send
from helpers.serve_fixtures import API_KEY, failovers_total, start_app, stop_app
from pagedray.deploy.openai.errors import APIError
from pagedray.deploy.openai.sse import parse_sse

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 12
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, executor="ray")   # the TP worker actor path (rank death below)
    yield running
    stop_app(running)


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app.url, headers=AUTH, timeout=300, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def offline_greedy(default_model_path):
    from pagedray.cluster import LLM, SamplingParams

    llm = LLM(default_model_path, dtype="float32", num_blocks=128, max_model_len=512)
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    llm.engine.shutdown()
    return [r.outputs[0].text for r in results]


def greedy_completion(client, app, prompt: str, **extra):
    return client.completions.create(model=app.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     **extra)


def test_completions_greedy_equal_offline_llm(client, app, offline_greedy):
    for prompt, expected in zip(PROMPTS, offline_greedy):
        response = greedy_completion(client, app, prompt)
        assert response.choices[0].text == expected
        assert response.choices[0].finish_reason in ("length", "stop")
        assert response.usage.prompt_tokens > 0 and 0 < response.usage.completion_tokens <= MAX_TOKENS


def test_token_id_prompt_equals_text_prompt(client, app, offline_greedy, default_model_path):
    from transformers import AutoTokenizer

    token_ids = AutoTokenizer.from_pretrained(default_model_path).encode(PROMPTS[0])
    response = client.completions.create(model=app.model, prompt=token_ids, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == offline_greedy[0]
    assert response.usage.prompt_tokens == len(token_ids)


def test_completion_stream_equals_whole(client, app, offline_greedy):
    stream = greedy_completion(client, app, PROMPTS[0], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline_greedy[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_whole_and_stream_agree(client, app):
    whole = client.chat.completions.create(model=app.model, messages=CHAT, max_tokens=MAX_TOKENS,
                                           temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(model=app.model, messages=CHAT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_n_samples(client, app):
    response = client.completions.create(model=app.model, prompt=PROMPTS[2], max_tokens=6, n=3,
                                         temperature=1.0)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("length", "stop") and c.text for c in response.choices)
    assert response.usage.completion_tokens <= 18
    stream = client.chat.completions.create(model=app.model, messages=CHAT, max_tokens=4, n=2,
                                            temperature=1.0, stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_logprobs_shapes(client, app, offline_greedy):
    response = greedy_completion(client, app, PROMPTS[0], logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == response.usage.completion_tokens == MAX_TOKENS
    assert "".join(logprobs.tokens) == offline_greedy[0]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the best
    chat = client.chat.completions.create(model=app.model, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_echo_logprobs_and_prompt_logprobs_equal_the_offline_engine(client, app, default_model_path):
    """Through the Ray TP worker and the wire: the echoed prompt's logprobs (OpenAI legacy shape) and
    vLLM's prompt_logprobs equal what the in-process engine computes for the same prompt."""
    from pagedray.cluster import LLM, SamplingParams

    with LLM(default_model_path, dtype="float32", num_blocks=64, max_model_len=512) as llm:
        offline, = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                                use_tqdm=False)
    response = client.completions.create(model=app.model, prompt=PROMPTS[2], max_tokens=2, temperature=0,
                                         echo=True, logprobs=2, extra_body={"prompt_logprobs": 2})
    choice = response.model_dump()["choices"][0]
    n = len(offline.prompt_token_ids)
    assert choice["text"].startswith(PROMPTS[2]) and response.usage.prompt_tokens == n
    legacy = choice["logprobs"]
    assert len(legacy["tokens"]) == n + 2 and legacy["token_logprobs"][0] is None
    assert legacy["token_logprobs"][1:n] == pytest.approx([e.logprob for e in offline.prompt_logprobs[1:]], abs=1e-4)
    assert legacy["text_offset"][0] == 0 and legacy["text_offset"][n] == len(PROMPTS[2])
    vllm = choice["prompt_logprobs"]
    assert len(vllm) == n and vllm[0] is None
    for entries, expected in zip(vllm[1:], offline.prompt_logprobs[1:]):
        own = entries[str(expected.token_id)]
        assert own["logprob"] == pytest.approx(expected.logprob, abs=1e-4) and own["rank"] == expected.rank
        assert {int(t) for t in entries} == {expected.token_id} | {t for t, _ in expected.top_logprobs}


def test_stop_string_cuts_text_and_aborts(client, app, offline_greedy):
    baseline = offline_greedy[0]
    stop = baseline[len(baseline) // 2:len(baseline) // 2 + 3]
    expected = baseline[:baseline.find(stop)]
    response = greedy_completion(client, app, PROMPTS[0], stop=[stop])
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    stream = greedy_completion(client, app, PROMPTS[0], stop=stop, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    stats = app.wait_idle()
    assert stats.num_running == 0 and stats.kv_usage == 0


def test_bad_input_never_touches_the_engine(app, http):
    before = app.wait_idle()
    for _name, path, body, status, param in bad_request_cases(app.model, app.max_model_len, app.vocab_size):
        assert_openai_error(send(http, path, body), status, param)
    huge = {"model": app.model, "prompt": "x" * (70 * 1024), "max_tokens": 1}
    assert_openai_error(http.post("/v1/completions", json=huge), 413, None)
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        assert_openai_error(http.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401, None)
    assert app.engine_stats() == before


def test_models_health_and_auth(app, http):
    card = http.get("/v1/models").json()["data"][0]
    assert (card["id"], card["dtype"]) == (app.model, "float32")     # the app asks for float32 (serve_fixtures)
    with httpx.Client(base_url=app.url, timeout=60, trust_env=False) as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert_openai_error(anonymous.get("/v1/models"), 401, None)


def test_model_retrieve_tokenize_and_unsupported_fields(client, app, http, default_model_path):
    from ray import serve
    from transformers import AutoTokenizer

    assert client.models.retrieve(app.model).id == app.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    tokens = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    assert tokens == AutoTokenizer.from_pretrained(default_model_path).encode(PROMPTS[0])
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == PROMPTS[0]
    handle = serve.get_app_handle(app.name)
    assert handle.tokenize.remote({"prompt": PROMPTS[0]}).result()["tokens"] == tokens
    assert handle.detokenize.remote({"tokens": tokens}).result() == {"prompt": PROMPTS[0]}
    # tool calling is not implemented: a 400 naming the field, never a 200 that ignored it
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=app.model, messages=CHAT, max_tokens=4, tool_choice="required")
    assert info.value.body["param"] == "tool_choice"


def test_structured_output_with_the_openai_client(client, app):
    import json

    import jsonschema
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int

    messages = [{"role": "user", "content": "Describe a person called Ada, aged 36, as JSON."}]
    parsed = client.beta.chat.completions.parse(model=app.model, messages=messages, response_format=Person,
                                                max_tokens=60, temperature=0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"
    # a bounded schema, streamed, two sampled choices: each text is one object of that schema
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    stream = client.chat.completions.create(
        model=app.model, messages=messages, max_tokens=60, n=2, seed=1, temperature=0.8, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["stop", "stop"], texts
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    # JSON mode (any object), greedy
    question = [{"role": "user", "content": "Reply with a JSON object with one key, city, for the capital of France."}]
    whole = client.chat.completions.create(model=app.model, messages=question, max_tokens=100, temperature=0,
                                           response_format={"type": "json_object"}).choices[0]
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
    choice = client.completions.create(model=app.model, prompt="Is the sky blue? Answer:", max_tokens=5,
                                       temperature=0, extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert choice.choices[0].text in (" yes", " no")


def _strict_json(text: str):
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")
    import json

    return json.loads(text, parse_constant=reject)


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_with_logprobs_lists_only_allowed_finite_tokens(app, http, stream):
    """Issue #32: top_logprobs under a grammar hold only tokens it allows (never -inf: a stream sent
    ``-Infinity``, which is not JSON, and a plain request got a 400 after generating)."""
    body = {"prompt": "Is the sky blue? Answer:", "max_tokens": 4, "temperature": 0, "logprobs": 5,
            "structured_outputs": {"choice": [" yes", " no"]}, "stream": stream}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        blocks = [b[len("data: "):] for b in response.text.split("\n\n") if b.startswith("data: {")]
        chunks = [_strict_json(b) for b in blocks]
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        choice = _strict_json(response.text)["choices"][0]
        logprobs, text = [choice["logprobs"]], choice["text"]
    assert text in (" yes", " no")
    tops = [top for lp in logprobs for top in lp["top_logprobs"]]
    assert tops and all(0 < len(top) <= 5 for top in tops)
    assert all(math.isfinite(v) and v <= 0 for top in tops for v in top.values())
    # the first position allows only the beginnings of " yes" / " no": far fewer than 5 tokens of the vocabulary
    assert all(piece.strip() == "" or " yes".startswith(piece) or " no".startswith(piece) for piece in tops[0])


def test_tool_calls_with_the_openai_client(client, app):
    import json

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 24}}}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=app.model, messages=messages, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client.beta.chat.completions.stream(model=app.model, messages=messages, tools=tools, tool_choice=named,
                                             max_tokens=60, temperature=0) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert set(json.loads(final.message.tool_calls[0].function.arguments)) == {"city"}
    # the next turn carries the call and the tool's answer
    follow_up = messages + [first.message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    answer = client.chat.completions.create(model=app.model, messages=follow_up, tools=tools, max_tokens=24,
                                            temperature=0).choices[0].message
    assert answer.content or answer.tool_calls


def test_handle_plain_and_streaming(app, http, offline_greedy):
    from ray import serve

    handle = serve.get_app_handle(app.name)
    params = {"max_tokens": MAX_TOKENS, "temperature": 0}
    result = handle.generate.remote(PROMPTS[1], params).result()
    assert result["choices"][0]["text"] == offline_greedy[1]
    chunks = list(handle.options(stream=True).generate_stream.remote(PROMPTS[1], params))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == offline_greedy[1]
    body = {"messages": CHAT, **params}
    whole = handle.chat.remote(body).result()["choices"][0]["message"]["content"]
    assert whole == http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    streamed = handle.options(stream=True).chat_stream.remote(body)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed if c["choices"]) == whole
    with pytest.raises(APIError) as info:
        handle.generate.remote("", params).result()
    assert info.value.status == 400 and info.value.param == "prompt"
    # the Responses and Messages APIs as Python calls: the same text as chat, whole and streamed
    response = handle.responses.remote({"input": CHAT, "max_output_tokens": MAX_TOKENS, "temperature": 0}).result()
    assert response["output"][-1]["content"][0]["text"] == whole
    events = list(handle.options(stream=True).responses_stream.remote({"input": CHAT, "max_output_tokens": MAX_TOKENS,
                                                                        "temperature": 0}))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == whole
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    message = handle.messages.remote({"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}).result()
    assert message["content"][-1]["text"] == whole
    events = list(handle.options(stream=True).messages_stream.remote({"messages": CHAT, "max_tokens": MAX_TOKENS,
                                                                      "temperature": 0}))
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == whole
    with pytest.raises(APIError) as info:
        handle.responses.remote({"input": CHAT, "max_output_tokens": -1}).result()
    assert info.value.status == 400 and info.value.param == "max_output_tokens"


def test_disconnect_mid_stream_frees_blocks(app, http):
    before = app.wait_idle()
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip((x for x in lines if x.startswith("data: ")), range(3))]
        assert len(received) == 3
        assert app.engine_stats().kv_usage > 0  # the request holds blocks while streaming
    after = app.wait_idle()
    assert after.num_running == 0 and after.kv_usage == 0
    assert after.num_generation_tokens_total - before.num_generation_tokens_total < 400
    assert 'outcome="abort"' in http.get("/metrics").text


async def _burst(url: str, count: int) -> list[httpx.Response]:
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300, trust_env=False) as c:
        return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(count)))


def test_overload_is_rejected_with_429(app):
    responses = asyncio.run(_burst(app.url, 14))
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected, "a burst of 14 > max_num_seqs 4 + max_queued_requests 4 must overflow the queue"
    for r in rejected:
        assert assert_openai_error(r, 429, None)["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"
    assert all(r.status_code == 200 for r in responses if r.status_code != 429)
    assert app.wait_idle().num_running == 0


def test_metrics_text(app, http):
    text = http.get("/metrics").text
    for series in ("pagedray:requests_total", "pagedray:time_to_first_token_seconds_count",
                   "pagedray:inter_token_latency_seconds_count", "pagedray:e2e_request_latency_seconds_count",
                   "pagedray:prompt_tokens_total", "pagedray:generation_tokens_total",
                   "pagedray:num_requests_running", "pagedray:num_requests_waiting",
                   "pagedray:kv_cache_usage_perc", "pagedray:prefix_cache_queries_total",
                   "pagedray:prefix_cache_hits_total", "pagedray:num_preemptions_total", "pagedray:engine_healthy"):
        assert series in text, series
    assert f'pagedray:requests_total{{endpoint="completions",model_name="{app.model}",outcome="rejected"}}' in text
    assert f'pagedray:engine_healthy{{model_name="{app.model}",replica="' in text
    sse = parse_sse(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}).text)
    assert sse[-1] == "[DONE]"


def _tp_worker_processes():
    """This session's TP worker processes: descendants of the test process (Ray was started by it)
    whose title names the RayWorker actor class."""
    import os

    import psutil

    found = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "RayWorker" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def test_dead_tp_rank_mid_stream_is_recovered_with_exact_tokens(app, http):
    """Runs last: kills the app's only TP worker process mid-stream. /health must say 503 while the
    engine rebuilds its TP group (new actor, new process group), and the stream must then finish with
    exactly the text of an undisturbed greedy run (its sequence is re-admitted as if preempted)."""
    import threading
    import time

    workers = _tp_worker_processes()
    assert len(workers) == 1, workers
    body = {"prompt": PROMPTS[2], "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    health_codes: list[tuple[float, int]] = []
    stop_polling = threading.Event()

    def poll_health(killed_at: float) -> None:
        with httpx.Client(base_url=app.url, timeout=10, trust_env=False) as client:
            while not stop_polling.is_set():
                try:
                    health_codes.append((time.monotonic() - killed_at, client.get("/health").status_code))
                except httpx.HTTPError:
                    health_codes.append((time.monotonic() - killed_at, -1))
                time.sleep(0.2)

    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first.startswith("data: {")
        workers[0].kill()
        poller = threading.Thread(target=poll_health, args=(time.monotonic(),), daemon=True)
        poller.start()
        rest = "\n\n".join(line for line in lines if line.startswith("data: "))
    stop_polling.set()
    poller.join(timeout=15)
    events = [parse_sse(first)[0]] + parse_sse(rest)
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    streamed = "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))
    assert any(code == 503 for _, code in health_codes), health_codes[:40]   # seen while the TP group rebuilt
    undisturbed = http.post("/v1/completions", json=body)
    assert undisturbed.status_code == 200, undisturbed.text
    assert streamed == undisturbed.json()["choices"][0]["text"]
    assert http.get("/health").status_code == 200
    assert [p.pid for p in _tp_worker_processes()] != [workers[0].pid]


def _alive_engine_replica_names() -> list[str]:
    """Named actors of the engine deployment's replicas (GCS-backed: works without the dashboard)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and "PagedEngine" in a["name"])


def _is_single_new_replica(old: list[str]) -> bool:
    names = _alive_engine_replica_names()
    return len(names) == 1 and names != old


def _created_placement_group_ids() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}


def test_dead_engine_replica_mid_stream_continues_on_its_replacement(app, http):
    """Runs after the rank-death test: kills the engine replica actor (the central actor) mid-stream.
    The ingress continues the stream as a continuation once Serve has replaced the replica (the only one):
    the client sees one stream with exactly the undisturbed text, and /metrics counts the failover;
    afterwards exactly one TP worker and no extra placement group are left, and the app answers again."""
    import time

    import ray

    replicas = _alive_engine_replica_names()
    assert len(replicas) == 1, replicas
    groups_before = _created_placement_group_ids()
    body = {"prompt": PROMPTS[1], "max_tokens": 160, "ignore_eos": True, "temperature": 0}
    expected = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    failovers_before = failovers_total(http)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first.startswith("data: {")
        ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
        events = parse_sse("\n\n".join([first] + [line for line in lines if line.startswith("data: ")]))
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected
    assert failovers_total(http) == failovers_before + 1

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if http.get("/health").status_code == 200 and _is_single_new_replica(replicas):
            break
        time.sleep(0.5)
    again = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0})
    assert again.status_code == 200, again.text
    new_replicas = _alive_engine_replica_names()
    assert len(new_replicas) == 1 and new_replicas != replicas, (replicas, new_replicas)
    assert len(_tp_worker_processes()) == 1
    # the dead replica's placement group is gone; the new replica has exactly one in its place
    assert len(_created_placement_group_ids()) == len(groups_before)
