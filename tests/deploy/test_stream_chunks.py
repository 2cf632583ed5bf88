"""The stream chunks are built as plain dicts on the per-token path (``openai/formatting.py``): each must be
exactly what dumping the protocol's models gives (the OpenAI schema lives there), for every field a chunk
can carry: text or a chat delta, logprobs, a finish reason, prompt logprobs."""

import pytest
from pagedray.deploy.openai.formatting import chat_chunk, completion_chunk
from pagedray.deploy.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
)

COMPLETION_LOGPROBS = CompletionLogprobs(tokens=[" a"], token_logprobs=[-0.25],
                                         top_logprobs=[{" a": -0.25, " b": -2.0}],
                                         text_offset=[3])
CHAT_LOGPROBS = ChatLogprobs(content=[ChatTokenLogprob(token="a", logprob=-0.5, bytes=[97],
                                                       top_logprobs=[TopLogprob(token="b", logprob=-1.5, bytes=[98])])])


@pytest.mark.parametrize("logprobs", [None, COMPLETION_LOGPROBS])
@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
@pytest.mark.parametrize("prompt_logprobs", [None, [None, {"5": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}]])
def test_a_completion_chunk_is_the_dumped_model(logprobs, finish_reason, prompt_logprobs):
    got = completion_chunk("cmpl-7", 1700000000, "m", 2, " a", logprobs, finish_reason, prompt_logprobs)
    choice = CompletionChoice(index=2, text=" a", logprobs=logprobs, finish_reason=finish_reason)
    want = CompletionResponse(id="cmpl-7", created=1700000000, model="m", choices=[choice]).model_dump()
    if prompt_logprobs is not None:
        want["choices"][0]["prompt_logprobs"] = prompt_logprobs
    assert got == want


@pytest.mark.parametrize("delta", [{"role": "assistant", "content": ""}, {"content": "hi"}, {},
                                   {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                    "function": {"name": "f", "arguments": "{}"}}]}])
@pytest.mark.parametrize("logprobs", [None, CHAT_LOGPROBS])
@pytest.mark.parametrize("finish_reason", [None, "tool_calls"])
def test_a_chat_chunk_is_the_dumped_model(delta, logprobs, finish_reason):
    got = chat_chunk("chat-7", 1700000000, "m", 1, dict(delta), logprobs, finish_reason)
    model_delta = ChatDelta(**delta)
    choice = ChatChunkChoice(index=1, delta=model_delta, logprobs=logprobs, finish_reason=finish_reason)
    want = ChatCompletionChunk(id="chat-7", created=1700000000, model="m", choices=[choice]).model_dump()
    want["choices"][0]["delta"] = model_delta.model_dump(exclude_none=True)   # OpenAI leaves unset fields out
    assert got == want
