"""Prefill/decode disaggregation on a real Serve app (one prefill and one decode replica, the default model in
fp32): streamed completions, greedy and seeded, equal what one engine generates for the same token ids, the
prompts ran on the prefill replica, and the decode replica found their blocks in its prefix cache."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.serve_fixtures import API_KEY, APP_NAME, start_app, stop_app

# slow: the extended tier (README: -m slow); CI keeps test_disaggregation.py's units; opt-in layout
pytestmark = [pytest.mark.integration, pytest.mark.slow]   # starts Ray, Serve or a process

PROMPT_TEXT = "The lighthouse keeper wrote in his log every evening, describing the weather and the ships. "
CASES = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, prefill_replicas=1, num_replicas=1, executor="local",
                        threads_per_worker=1)
    yield running
    stop_app(running)


def _streamed_text(url: str, prompt: list[int], case: dict) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, **case}
    parts = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                      trust_env=False) as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                parts += [choice["text"] for choice in event["choices"]]
    return "".join(parts)


def test_disaggregated_streams_equal_one_engine(app, default_model_path, tokenizer):
    from pagedray.cluster import LLM, SamplingParams
    from ray import serve

    prompt = tokenizer.encode(PROMPT_TEXT * 3)
    texts = [_streamed_text(app.url, prompt, case) for case in CASES]
    with LLM(default_model_path, dtype="float32", num_blocks=128, max_model_len=512, threads_per_worker=1) as llm:
        for case, text in zip(CASES, texts):
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **case)
            ids = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert text == tokenizer.decode(ids, skip_special_tokens=True), case
    prefill = serve.get_deployment_handle("PagedEnginePrefill", APP_NAME).stats.remote().result()
    decode = app.engine_handle().stats.remote().result()
    assert prefill.num_prompt_tokens_total >= len(CASES) * len(prompt)
    assert decode.prefix_hit_tokens_total >= len(CASES) * (len(prompt) // 16 * 16)
