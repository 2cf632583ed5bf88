"""``chat_template_kwargs`` on chat and /tokenize: the variables reach the model's chat template (Qwen3's
``enable_thinking`` is one), keys that would replace the template call's own arguments are a 400 naming
them, and a template that refuses the conversation (``raise_exception``) is a 400 with its message, not
a 500. ``documents`` reach a template that renders them and are a 400 for one that does not."""

import copy

import pytest
from fastapi.testclient import TestClient
from helpers.fake_engine import ScriptedEngine
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.validation import ModelLimits

THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                   "{{ raise_exception('System messages are not supported by this template') }}{% endif %}"
                   "{{ m['content'] }}{% endfor %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _client(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    engine = ScriptedEngine(tok.encode(" four"), eos_token_id=tok.eos_token_id)
    limits = ModelLimits("m", frozenset({"m"}), len(tok), 512)
    return TestClient(create_api(OpenAIService(engine, tok, limits, ServerMetrics("m")))), engine, tok


def test_the_template_sees_the_kwargs_in_chat_and_tokenize(tokenizer):
    client, engine, tok = _client(tokenizer, THINKING_TEMPLATE)
    off = tok.encode("<|user|>What is 2 + 2?\n<|assistant|><think>\n\n</think>\n\n", add_special_tokens=False)
    on = tok.encode("<|user|>What is 2 + 2?\n<|assistant|>", add_special_tokens=False)
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {}}).status_code == 200
    assert [prompt for _, prompt, _ in engine.calls] == [off, on]
    tokenized = client.post("/tokenize", json={"messages": MESSAGES,
                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert tokenized.json()["tokens"] == off


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenize": True}, "chat_template_kwargs.tokenize: not a variable"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt: not a variable"),
    ({"tools": []}, "chat_template_kwargs.tools: not a variable"),
    ({"not-a-name": 1}, "chat_template_kwargs.not-a-name: not a variable"),
    ({f"k{i}": i for i in range(33)}, "chat_template_kwargs: at most 32 keys"),
    ("enable_thinking", "chat_template_kwargs: Input should be a valid dictionary"),
])
def test_bad_kwargs_are_a_400_naming_them_and_reach_no_engine(tokenizer, kwargs, message):
    client, engine, _ = _client(tokenizer, THINKING_TEMPLATE)
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        response = client.post(path, json={"messages": MESSAGES, "chat_template_kwargs": kwargs, **extra})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "chat_template_kwargs" and error["message"].startswith(message), error
    assert engine.calls == []


def test_a_template_that_refuses_the_conversation_is_a_400(tokenizer):
    client, engine, _ = _client(tokenizer, STRICT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}] + MESSAGES
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 400 and engine.calls == []
    error = response.json()["error"]
    assert error["param"] == "messages" and "System messages are not supported" in error["message"]
    assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


def test_continue_final_message_leaves_the_assistant_turn_open(tokenizer):
    client, engine, tok = _client(tokenizer, tokenizer.chat_template)
    messages = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    assert rendered.endswith("The answer is")                      # no end-of-turn after the open message
    assert engine.calls[-1][1] == tok.encode(rendered, add_special_tokens=False)
    tokenized = client.post("/tokenize", json={k: v for k, v in body.items() if k != "max_tokens"})
    assert tokenized.json()["tokens"] == engine.calls[-1][1]


@pytest.mark.parametrize("body, message", [
    ({"messages": MESSAGES + [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message: cannot be combined with add_generation_prompt"),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message: the last message must be the assistant's"),
])
def test_continue_final_message_misuse_is_a_400(tokenizer, body, message):
    client, engine, _ = _client(tokenizer, tokenizer.chat_template)
    response = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert response.status_code == 400 and engine.calls == []
    assert response.json()["error"]["message"].startswith(message)
    assert response.json()["error"]["param"] == "continue_final_message"


def test_a_broken_model_template_is_a_server_error_not_the_requests(tokenizer):
    client, engine, _ = _client(tokenizer, "{% for m in messages %}{{ m['content'] }")
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert response.status_code == 500 and engine.calls == []
    assert response.json()["error"]["type"] == "internal_error"


RAG_TEMPLATE = ("{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}\n{% endfor %}"
                "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>")


def test_documents_reach_a_template_that_renders_them(tokenizer):
    client, engine, tok = _client(tokenizer, RAG_TEMPLATE)
    documents = [{"title": "Oslo", "text": "Rainy."}, {"title": "Paris", "text": "Sunny."}]
    body = {"messages": MESSAGES, "max_tokens": 2, "documents": documents}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    want = "[Oslo] Rainy.\n[Paris] Sunny.\n<|user|>What is 2 + 2?\n<|assistant|>"
    assert engine.calls[-1][1] == tok.encode(want, add_special_tokens=False)


@pytest.mark.parametrize("template, documents, message", [
    (THINKING_TEMPLATE, [{"text": "x"}], "documents: this model's chat template does not render documents"),
    (RAG_TEMPLATE, [{"text": 5}], "documents.0.text: Input should be a valid string"),
    (RAG_TEMPLATE, "a document", "documents: Input should be a valid list"),
    (RAG_TEMPLATE, [{"text": "x"}] * 65, "documents: List should have at most 64 items"),
])
def test_bad_documents_are_a_400_naming_them(tokenizer, template, documents, message):
    client, engine, _ = _client(tokenizer, template)
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                         "documents": documents})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "documents" and error["message"].startswith(message), error
    assert engine.calls == []


def test_documents_count_towards_the_prompt_bound(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = RAG_TEMPLATE
    engine = ScriptedEngine(tok.encode(" four"), eos_token_id=tok.eos_token_id)
    limits = ModelLimits("m", frozenset({"m"}), len(tok), 512, max_prompt_chars=5_000)
    client = TestClient(create_api(OpenAIService(engine, tok, limits, ServerMetrics("m"))))
    body = {"messages": MESSAGES, "max_tokens": 2, "documents": [{"text": "x" * 10_000}]}
    error = client.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "documents" and error["message"].startswith("documents: 10004 characters cannot fit")
    assert engine.calls == []
