"""Bad request bodies shared by the unit tests (test double engine) and the e2e tests (real engine).

Each case: (id, path, body, expected status, expected ``error.param``). Bodies are JSON-able dicts,
raw bytes sent as-is with ``Content-Type: application/json``, or ``RawBody`` (bytes + a content type).
``max_model_len`` / ``vocab_size`` placeholders are filled in by ``bad_request_cases``;
``malformed_cases`` adds the abuse catalogue (wrong types for every field, nested garbage, huge
numbers, NaN/Infinity literals, invalid UTF-8, lone surrogates, wrong content types, deep nesting,
structured-output schemas and regexes the grammar checks refuse, malformed tools and tool calls).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class RawBody:
    data: bytes
    content_type: str = "application/json"


def bad_request_cases(model: str, max_model_len: int, vocab_size: int) -> list[tuple]:
    ok = {"model": model, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("empty_prompt", COMPLETIONS, {**ok, "prompt": ""}, 400, "prompt"),
        ("empty_token_prompt", COMPLETIONS, {**ok, "prompt": []}, 400, "prompt"),
        ("too_long", COMPLETIONS, {**ok, "prompt": [1] * (max_model_len - 2), "max_tokens": 3}, 400,
         "max_tokens"),
        ("max_tokens_zero", COMPLETIONS, {**ok, "max_tokens": 0}, 400, "max_tokens"),
        ("max_tokens_negative", COMPLETIONS, {**ok, "max_tokens": -3}, 400, "max_tokens"),
        ("max_tokens_float", COMPLETIONS, {**ok, "max_tokens": 2.5}, 400, "max_tokens"),
        ("max_tokens_string", COMPLETIONS, {**ok, "max_tokens": "5"}, 400, "max_tokens"),
        ("temperature_negative", COMPLETIONS, {**ok, "temperature": -0.1}, 400, "temperature"),
        ("temperature_nan", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 4, "temperature": NaN}', 400,
         "temperature"),
        ("top_p_zero", COMPLETIONS, {**ok, "top_p": 0.0}, 400, "top_p"),
        ("top_p_above_one", COMPLETIONS, {**ok, "top_p": 1.5}, 400, "top_p"),
        ("top_k_bad", COMPLETIONS, {**ok, "top_k": -5}, 400, "top_k"),
        ("min_p_bad", COMPLETIONS, {**ok, "min_p": 1.5}, 400, "min_p"),
        ("n_zero", COMPLETIONS, {**ok, "n": 0}, 400, "n"),
        ("n_too_big", COMPLETIONS, {**ok, "n": 1000}, 400, "n"),
        ("token_out_of_vocab", COMPLETIONS, {**ok, "prompt": [5, vocab_size]}, 400, "prompt"),
        # 64 prompts x n=16 x (1 + max_model_len / 2) tokens: more than 16 full contexts for any length
        ("request_cost_too_big", COMPLETIONS, {**ok, "prompt": [[5]] * 64, "n": 16,
                                               "max_tokens": max_model_len // 2}, 400, "prompt"),
        ("negative_token", COMPLETIONS, {**ok, "prompt": [5, -1]}, 400, "prompt"),
        ("stop_token_out_of_vocab", COMPLETIONS, {**ok, "stop_token_ids": [vocab_size + 7]}, 400,
         "stop_token_ids"),
        ("malformed_json", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": ', 400, None),
        ("not_an_object", COMPLETIONS, [1, 2, 3], 400, None),
        ("prompt_wrong_type", COMPLETIONS, {**ok, "prompt": 42}, 400, "prompt"),
        ("stream_wrong_type", COMPLETIONS, {**ok, "stream": "yes"}, 400, "stream"),
        ("empty_stop_string", COMPLETIONS, {**ok, "stop": [""]}, 400, "stop"),
        ("chat_no_messages", CHAT, {**chat, "messages": []}, 400, "messages"),
        ("chat_bad_role", CHAT, {**chat, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        ("chat_temperature_nan", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
         400, "temperature"),
        ("chat_max_tokens_zero", CHAT, {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("chat_top_logprobs_without_logprobs", CHAT, {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        ("unknown_model", COMPLETIONS, {**ok, "model": "no-such-model"}, 404, "model"),
        ("chat_unknown_model", CHAT, {**chat, "model": "no-such-model"}, 404, "model"),
    ]


def _completion_type_cases(ok: dict) -> list[tuple]:
    """A wrong JSON type (or an out-of-range value) for every /v1/completions field."""
    wrong = {"model": 7, "prompt": {"text": "Hello"}, "max_tokens": [4], "temperature": "hot", "top_p": True,
             "top_k": 1.5, "min_p": [0.1], "presence_penalty": "0.5", "frequency_penalty": {"x": 1},
             "repetition_penalty": None, "seed": "42", "stop": 5, "stop_token_ids": "1,2", "n": 2.0,
             "best_of": "3", "ignore_eos": "true", "logit_bias": {"50": "up"}, "stream": 1,
             "stream_options": "yes", "user": 5, "logprobs": True, "echo": 1, "suffix": 9}
    cases = [(f"{field}_wrong_json_type", COMPLETIONS, {**ok, field: value}, 400, field)
             for field, value in wrong.items()]
    # repetition_penalty=None means "default" (accepted), so the case above must not be None
    cases[[c[0] for c in cases].index("repetition_penalty_wrong_json_type")] = (
        "repetition_penalty_wrong_json_type", COMPLETIONS, {**ok, "repetition_penalty": "1.1"}, 400,
        "repetition_penalty")
    return cases


def _range_cases(ok: dict, vocab_size: int) -> list[tuple]:
    """Huge numbers, non-finite literals and values outside their ranges."""
    return [
        ("max_tokens_huge", COMPLETIONS, {**ok, "max_tokens": 10**30}, 400, "max_tokens"),
        ("max_tokens_5000_digits", COMPLETIONS, b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", 400,
         None),
        ("max_tokens_1e400", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1e400}', 400, "max_tokens"),
        ("temperature_1e400", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1, "temperature": 1e400}', 400,
         "temperature"),
        ("temperature_huge_int", COMPLETIONS, {**ok, "temperature": 10**400}, 400, "temperature"),
        ("top_p_infinity", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1, "top_p": Infinity}', 400, "top_p"),
        ("presence_penalty_neg_infinity", COMPLETIONS,
         b'{"prompt": "Hello", "max_tokens": 1, "presence_penalty": -Infinity}', 400, "presence_penalty"),
        ("min_p_nan", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1, "min_p": NaN}', 400, "min_p"),
        ("repetition_penalty_nan", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1, "repetition_penalty": NaN}',
         400, "repetition_penalty"),
        ("frequency_penalty_out_of_range", COMPLETIONS, {**ok, "frequency_penalty": 3}, 400, "frequency_penalty"),
        ("repetition_penalty_zero", COMPLETIONS, {**ok, "repetition_penalty": 0}, 400, "repetition_penalty"),
        # issue #32: 1e-50 is 0 in float32 (a masked logit times 0 is NaN); 1e30 overflows a logit's quotient
        ("repetition_penalty_underflows", COMPLETIONS, {**ok, "repetition_penalty": 1e-50, "temperature": 0,
                                                        "structured_outputs": {"choice": ["yes", "no"]}},
         400, "repetition_penalty"),
        ("repetition_penalty_overflows", COMPLETIONS, {**ok, "repetition_penalty": 1e30}, 400, "repetition_penalty"),
        ("temperature_overflows_float32", COMPLETIONS, {**ok, "temperature": 1e39}, 400, "temperature"),
        ("stop_string_too_long", COMPLETIONS, {**ok, "stop": ["x" * 5000]}, 400, "stop"),
        ("too_many_stop_token_ids", COMPLETIONS, {**ok, "stop_token_ids": [5] * 2000}, 400, "stop_token_ids"),
        ("top_k_beyond_int64", COMPLETIONS, {**ok, "top_k": 2**70}, 400, "top_k"),
        ("seed_beyond_int64", COMPLETIONS, {**ok, "seed": INT64_MAX + 1}, 400, "seed"),
        ("n_beyond_int64", COMPLETIONS, {**ok, "n": -(2**64)}, 400, "n"),
        ("logprobs_negative", COMPLETIONS, {**ok, "logprobs": -1}, 400, "logprobs"),
        ("logprobs_huge", COMPLETIONS, {**ok, "logprobs": 10**6}, 400, "logprobs"),
        ("stop_too_many", COMPLETIONS, {**ok, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
        ("stop_nested_lists", COMPLETIONS, {**ok, "stop": [["a"]]}, 400, "stop"),
        ("stop_token_ids_negative", COMPLETIONS, {**ok, "stop_token_ids": [-4]}, 400, "stop_token_ids"),
        ("prompt_token_id_huge", COMPLETIONS, {**ok, "prompt": [1, 10**20]}, 400, "prompt"),
        ("prompt_batch_token_out_of_vocab", COMPLETIONS, {**ok, "prompt": [[1, 2], [vocab_size + 1]]}, 400,
         "prompt"),
        ("best_of_not_n", COMPLETIONS, {**ok, "n": 1, "best_of": 3}, 400, "best_of"),
        ("prompt_logprobs_out_of_range", COMPLETIONS, {**ok, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ("prompt_logprobs_negative", COMPLETIONS, {**ok, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
        ("logit_bias_key_not_an_id", COMPLETIONS, {**ok, "logit_bias": {"hello": 5}}, 400, "logit_bias"),
        ("logit_bias_id_out_of_vocab", COMPLETIONS, {**ok, "logit_bias": {str(vocab_size): 5}}, 400, "logit_bias"),
        ("logit_bias_value_too_big", COMPLETIONS, {**ok, "logit_bias": {"50": 101}}, 400, "logit_bias"),
        ("suffix_unsupported", COMPLETIONS, {**ok, "suffix": "end"}, 400, "suffix"),
        ("guided_choice", COMPLETIONS, {**ok, "guided_choice": ["a", "b"]}, 400, "guided_choice"),
        ("min_tokens_above_max_tokens", COMPLETIONS, {**ok, "min_tokens": 5}, 400, "min_tokens"),
        ("min_tokens_negative", COMPLETIONS, {**ok, "min_tokens": -1}, 400, "min_tokens"),
        ("add_special_tokens_false", COMPLETIONS, {**ok, "add_special_tokens": False}, 400, "add_special_tokens"),
    ]


def _prompt_shape_cases(ok: dict) -> list[tuple]:
    return [
        ("prompt_mixed_str_int", COMPLETIONS, {**ok, "prompt": ["a", 1]}, 400, "prompt"),
        ("prompt_mixed_list_str", COMPLETIONS, {**ok, "prompt": [[1, 2], "a"]}, 400, "prompt"),
        ("prompt_token_float", COMPLETIONS, {**ok, "prompt": [1, 2.5]}, 400, "prompt"),
        ("prompt_token_bool", COMPLETIONS, {**ok, "prompt": [1, True]}, 400, "prompt"),
        ("prompt_null", COMPLETIONS, {**ok, "prompt": None}, 400, "prompt"),
        ("prompt_missing", COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
        ("prompt_batch_with_empty", COMPLETIONS, {**ok, "prompt": ["a", ""]}, 400, "prompt"),
        ("prompt_batch_with_empty_tokens", COMPLETIONS, {**ok, "prompt": [[1], []]}, 400, "prompt"),
        ("prompt_batch_too_many", COMPLETIONS, {**ok, "prompt": ["a"] * 65}, 400, "prompt"),
        ("prompt_deeply_nested", COMPLETIONS, {**ok, "prompt": [[[1]]]}, 400, "prompt"),
        ("stream_options_nested_garbage", COMPLETIONS, {**ok, "stream_options": {"include_usage": {"a": [1]}}},
         400, "stream_options"),
    ]


def _body_cases() -> list[tuple]:
    """Bodies that are not one JSON object, or not JSON at all."""
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    return [
        ("empty_body", COMPLETIONS, b"", 400, None),
        ("json_null", COMPLETIONS, b"null", 400, None),
        ("json_string", COMPLETIONS, b'"Hello"', 400, None),
        ("json_number", COMPLETIONS, b"42", 400, None),
        ("chat_array_body", CHAT, [{"role": "user", "content": "hi"}], 400, None),
        ("trailing_garbage", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1} xyz', 400, None),
        ("deeply_nested_json", COMPLETIONS, deep, 400, None),
        ("invalid_utf8", COMPLETIONS, b'{"prompt": "Hello \xff\xfe", "max_tokens": 1}', 400, None),
        ("utf8_overlong_encoding", COMPLETIONS, b'{"prompt": "\xc0\xaf", "max_tokens": 1}', 400, None),
        ("lone_surrogate_prompt", COMPLETIONS, b'{"prompt": "ab\\ud800", "max_tokens": 1}', 400, "prompt"),
        ("lone_surrogate_key", COMPLETIONS, b'{"prompt": "a", "\\udfff": 1, "max_tokens": 1}', 400, None),
        # UTF-8-encoded surrogates (ED A0 80 = U+D800) are invalid UTF-8; no escape in sight
        ("raw_surrogate_bytes_prompt", COMPLETIONS, b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', 400, None),
        ("raw_surrogate_bytes_prompt_list", COMPLETIONS, b'{"prompt": ["ok", "\xed\xbf\xbf"], "max_tokens": 2}',
         400, None),
        ("raw_surrogate_bytes_stream", COMPLETIONS,
         b'{"prompt": "a\xed\xa0\x80", "max_tokens": 2, "stream": true}', 400, None),
        ("raw_surrogate_bytes_chat", CHAT,
         b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 1}', 400, None),
        ("form_content_type", COMPLETIONS, RawBody(b"prompt=Hello&max_tokens=1",
                                                   "application/x-www-form-urlencoded"), 415, None),
        ("text_plain_content_type", COMPLETIONS, RawBody(b'{"prompt": "Hello", "max_tokens": 1}', "text/plain"),
         415, None),
        ("multipart_content_type", CHAT, RawBody(b"--x\r\n", "multipart/form-data; boundary=x"), 415, None),
    ]


def _chat_cases(chat: dict, max_model_len: int) -> list[tuple]:
    user = {"role": "user", "content": "hi"}
    return [
        ("chat_messages_string", CHAT, {**chat, "messages": "hi"}, 400, "messages"),
        ("chat_messages_null", CHAT, {**chat, "messages": None}, 400, "messages"),
        ("chat_messages_missing", CHAT, {"max_tokens": 4}, 400, "messages"),
        ("chat_message_not_object", CHAT, {**chat, "messages": [["user", "hi"]]}, 400, "messages"),
        ("chat_message_missing_role", CHAT, {**chat, "messages": [{"content": "hi"}]}, 400, "messages"),
        ("chat_message_missing_content", CHAT, {**chat, "messages": [{"role": "user"}]}, 400, "messages"),
        ("chat_system_content_null", CHAT, {**chat, "messages": [{"role": "system", "content": None}, user]}, 400,
         "messages"),
        ("chat_content_image_part", CHAT, {**chat, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
        ("chat_content_part_without_text", CHAT, {**chat, "messages": [
            {"role": "user", "content": [{"type": "text"}]}]}, 400, "messages"),
        ("chat_content_number", CHAT, {**chat, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
        ("chat_role_null", CHAT, {**chat, "messages": [{"role": None, "content": "x"}]}, 400, "messages"),
        ("chat_name_wrong_type", CHAT, {**chat, "messages": [{"role": "user", "content": "x", "name": []}]}, 400,
         "messages"),
        ("chat_lone_surrogate_content", CHAT,
         b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 1}', 400, "messages"),
        ("chat_logprobs_int", CHAT, {**chat, "logprobs": 1}, 400, "logprobs"),
        ("chat_top_logprobs_too_big", CHAT, {**chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("chat_top_logprobs_negative", CHAT, {**chat, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
        ("chat_max_completion_tokens_negative", CHAT, {**chat, "max_completion_tokens": -1}, 400,
         "max_completion_tokens"),
        ("chat_n_too_big", CHAT, {**chat, "n": 17}, 400, "n"),
        ("chat_tools_unsupported", CHAT, {**chat, "tools": [{"type": "function"}]}, 400, "tools"),
        ("chat_tool_choice_required", CHAT, {**chat, "tool_choice": "required"}, 400, "tool_choice"),
        ("chat_functions", CHAT, {**chat, "functions": [{"name": "f"}]}, 400, "functions"),
        ("chat_store_true", CHAT, {**chat, "store": True}, 400, "store"),
        ("chat_audio_output", CHAT, {**chat, "modalities": ["text", "audio"]}, 400, "modalities"),
        ("chat_echo", CHAT, {**chat, "echo": True}, 400, "echo"),
        ("chat_prompt_logprobs", CHAT, {**chat, "prompt_logprobs": 0}, 400, "prompt_logprobs"),
        ("chat_continue_final_message", CHAT, {**chat, "continue_final_message": True}, 400,
         "continue_final_message"),
        ("chat_guided_json", CHAT, {**chat, "guided_json": {"type": "object"}}, 400, "guided_json"),
        ("chat_prompt_too_long", CHAT, {**chat, "messages": [{"role": "user", "content": "hello " * max_model_len}]},
         400, "messages"),
        ("chat_stop_too_many", CHAT, {**chat, "stop": ["x"] * 17}, 400, "stop"),
    ]


def _grammar_cases(ok: dict) -> list[tuple]:
    """Structured-output requests the ingress must refuse before admission (deploy/openai/structured_output.py)."""
    recursive = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    required_self = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    deep: dict = {"type": "string"}
    for _ in range(40):   # 81 levels of JSON objects
        deep = {"type": "object", "properties": {"a": deep}}
    return [
        ("schema_recursive_ref", COMPLETIONS, {**ok, "structured_outputs": {"json": recursive}}, 400,
         "structured_outputs"),
        ("schema_recursive_ref_response_format", COMPLETIONS, {**ok, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": recursive}}}, 400, "response_format"),
        ("schema_required_property_is_itself", COMPLETIONS, {**ok, "structured_outputs": {"json": required_self}},
         400, "structured_outputs"),
        # the red team sent 50,000 levels; 30,000 (60 KB) also fits the e2e app's 64 KiB body limit and is
        # just as far past Python's recursion limit
        ("schema_string_nested_30000_deep", COMPLETIONS, {**ok, "structured_outputs": {
            "json": "[" * 30_000 + "]" * 30_000}}, 400, "structured_outputs"),
        ("schema_nested_81_deep", COMPLETIONS, {**ok, "structured_outputs": {"json": deep}}, 400,
         "structured_outputs"),
        ("regex_lexer_explodes", COMPLETIONS, {**ok, "n": 16, "temperature": 1, "structured_outputs": {
            "regex": "(a{1000}){1000}"}}, 400, "structured_outputs"),
    ]


def _tool_cases(chat: dict) -> list[tuple]:
    """Malformed tools, tool_choice and earlier tool calls (deploy/openai/tools.py): 400s, never 500s."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = {**chat, "tools": [weather]}

    def turn(call) -> dict:
        return {**with_tools, "messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "user", "content": "and?"}]}
    return [
        ("tool_choice_function_not_object", CHAT, {**with_tools, "tool_choice": {
            "type": "function", "function": "get_weather"}}, 400, "tool_choice"),
        ("tool_choice_name_not_string", CHAT, {**with_tools, "tool_choice": {
            "type": "function", "function": {"name": ["get_weather"]}}}, 400, "tool_choice"),
        ("tool_function_not_object", CHAT, {**chat, "tools": [{"type": "function", "function": "get_weather"}]},
         400, "tools"),
        ("tool_description_not_string", CHAT, {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "description": {"a": 1}}}]}, 400, "tools"),
        ("tool_parameters_not_object_schema", CHAT, {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "string"}}}]}, 400, "tools"),
        ("tool_required_parameters_without_finite_instance", CHAT, {**chat, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}]}, 400, "tool_choice"),
        ("tool_call_arguments_object", CHAT, turn({"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Oslo"}}}), 400, "messages"),
        ("tool_call_function_string", CHAT, turn({"id": "call_1", "type": "function", "function": "get_weather"}),
         400, "messages"),
    ]


def _input_bound_cases(ok: dict, chat: dict, max_model_len: int) -> list[tuple]:
    """Inputs the ingress refuses before working on them (validation.py: input bounds)."""
    user = {"role": "user", "content": "hi"}
    parts = [{"type": "text", "text": "a"}] * (max_model_len + 1)
    too_many = [user] * (max_model_len + 1)
    long_prompt = [5] * (max_model_len // 2)   # x 21 logprobs x n=16: 4x more than the budget of 4 contexts
    return [
        ("prompt_tokens_beyond_context", COMPLETIONS, {**ok, "prompt": [5] * (max_model_len + 1)}, 400, "prompt"),
        ("chat_too_many_messages", CHAT, {**chat, "messages": too_many}, 400, "messages"),
        ("chat_too_many_content_parts", CHAT, {**chat, "messages": [{"role": "user", "content": parts}]}, 400,
         "messages"),
        ("tokenize_chat_too_many_messages", "/tokenize", {"messages": too_many}, 400, "messages"),
        ("detokenize_beyond_context", "/detokenize", {"tokens": [5] * (max_model_len + 1)}, 400, "tokens"),
        ("prompt_logprobs_response_too_big", COMPLETIONS, {**ok, "prompt": long_prompt, "prompt_logprobs": 20,
                                                           "n": 16, "max_tokens": 1}, 400, "prompt_logprobs"),
        ("echo_logprobs_response_too_big", COMPLETIONS, {**ok, "prompt": long_prompt, "echo": True, "logprobs": 20,
                                                         "n": 16, "max_tokens": 1}, 400, "logprobs"),
    ]


def malformed_cases(model: str, max_model_len: int, vocab_size: int) -> list[tuple]:
    """``bad_request_cases`` plus the abuse catalogue (every case a 4xx with an OpenAI error body)."""
    ok = {"model": model, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = (bad_request_cases(model, max_model_len, vocab_size) + _completion_type_cases(ok)
             + _range_cases(ok, vocab_size) + _prompt_shape_cases(ok) + _body_cases()
             + _chat_cases(chat, max_model_len) + _grammar_cases(ok) + _tool_cases(chat)
             + _input_bound_cases(ok, chat, max_model_len))
    ids = [case[0] for case in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases


def send(client, path: str, body, headers: dict | None = None):
    """POST a case body with any httpx-compatible client (raw bytes are sent unchanged)."""
    if isinstance(body, RawBody):
        return client.post(path, content=body.data, headers={"content-type": body.content_type, **(headers or {})})
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})
    return client.post(path, json=body, headers=headers)


def assert_openai_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    return error
