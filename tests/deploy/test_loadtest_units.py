"""Load tester pieces without a server: percentiles, prompts, stream parsing, /metrics parsing, the
DeploymentHandle adapter (with a stand-in handle), argument validation."""

import asyncio
import json

import pytest
from pagedray.deploy.loadtest import build_parser, config_from_args
from pagedray.deploy.loadtest.client import (
    HANDLE_CHAT_STREAM_METHOD,
    HANDLE_STREAM_METHOD,
    HandleTarget,
    RequestOptions,
    server_root,
)
from pagedray.deploy.loadtest.metrics import parse_prometheus
from pagedray.deploy.loadtest.prompts import (
    LengthRange,
    PromptSpec,
    load_prompts_file,
    parse_length_range,
    synthetic_prompts,
)
from pagedray.deploy.loadtest.record import RequestRecord, StreamError, StreamParser
from pagedray.deploy.loadtest.runner import LoadSpec
from pagedray.deploy.loadtest.stats import describe_ms, percentile, throughput_series


def test_percentile_interpolates_linearly():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5          # rank 1.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile([7.0], 99) == 7.0
    assert describe_ms([0.001, 0.003]) == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8),
                                           "p99": pytest.approx(2.98)}
    assert describe_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    with pytest.raises(ValueError, match="values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="p:"):
        percentile([1.0], 101)


def test_record_latencies_from_event_times():
    record = RequestRecord(index=0, prompt_index=0, chunk_times=[0.5, 0.6, 0.8], chunks=["a", "b", "c"],
                           end_s=0.9)
    assert record.ttft == 0.5 and record.e2e == 0.9
    assert record.itls == pytest.approx([0.1, 0.2])
    assert record.output_tokens == 3
    assert record.tpot == pytest.approx((0.9 - 0.5) / 2)
    record.usage_output_tokens = 5  # the server's count wins over the number of events
    assert record.tpot == pytest.approx(0.4 / 4)


def test_throughput_series_bins_event_times():
    a = RequestRecord(index=0, prompt_index=0, send_s=0.0, chunk_times=[0.1, 0.2, 1.1], chunks=["x"] * 3,
                      end_s=1.2)
    b = RequestRecord(index=1, prompt_index=0, send_s=1.0, chunk_times=[0.5], chunks=["y"], end_s=0.6)
    failed = RequestRecord(index=2, prompt_index=0, chunk_times=[0.3], chunks=["z"], error="timeout")
    assert throughput_series([a, b, failed], 0.5) == ([0.0, 0.5, 1.0, 1.5], [4.0, 0.0, 2.0, 2.0])


def test_stream_parser_handles_completion_chat_usage_done_and_errors():
    clock = iter([0.1, 0.2, 0.3, 0.4]).__next__
    record = RequestRecord(index=0, prompt_index=0)
    parser = StreamParser(record, clock)
    parser.feed_line(": keep-alive comment")
    parser.feed_line('data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}')
    parser.feed_text('data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
                     'data: {"choices": [{"text": " there"}]}\n\n')
    parser.feed_chunk({"choices": [{"text": "", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    parser.feed_line("data: [DONE]")
    parser.finish()
    assert record.chunks == ["Hi", " there"] and record.chunk_times == [0.1, 0.2]
    assert (record.finish_reason, record.done, record.usage_output_tokens) == ("length", True, 2)
    assert record.end_s == 0.3 and record.usage_prompt_tokens == 4
    with pytest.raises(StreamError, match="server error"):
        StreamParser(RequestRecord(0, 0), clock).feed_line('data: {"error": "boom"}')
    with pytest.raises(StreamError, match="not JSON"):
        StreamParser(RequestRecord(0, 0), clock).feed_line("data: {oops")
    truncated = StreamParser(RequestRecord(0, 0), lambda: 1.0)
    truncated.feed_chunk({"choices": [{"text": "a"}]})
    with pytest.raises(StreamError, match="before a finish_reason"):
        truncated.finish()


def test_prometheus_parser_sums_counts_and_averages_usage():
    text = "\n".join([
        "# HELP pagedray:num_requests_running running",
        "# TYPE pagedray:num_requests_running gauge",
        'pagedray:num_requests_running{replica="a"} 3',
        'pagedray:num_requests_running{replica="b"} 2.0',
        "pagedray:num_requests_waiting 7 1700000000000",
        'pagedray:kv_cache_usage_perc{replica="a", model="x y"} 0.25',
        'pagedray:kv_cache_usage_perc{replica="b"} 0.75',
        "other_metric 99",
        "pagedray:num_requests_waiting_total 5",
    ])
    assert parse_prometheus(text) == {"pagedray:num_requests_running": 5.0,
                                      "pagedray:num_requests_waiting": 7.0,
                                      "pagedray:kv_cache_usage_perc": 0.5}
    assert parse_prometheus("garbage\n<html>") == {}


def test_synthetic_prompts_are_seeded_and_within_ranges():
    words, outs = LengthRange(8, 120), LengthRange(16, 64)
    prompts = synthetic_prompts(200, words, outs, seed=5)
    assert prompts == synthetic_prompts(200, words, outs, seed=5)
    assert prompts != synthetic_prompts(200, words, outs, seed=6)
    lengths = [len(p.prompt.split()) for p in prompts]
    assert min(lengths) >= 8 and max(lengths) <= 120 and len(set(lengths)) > 20
    assert all(16 <= p.max_tokens <= 64 for p in prompts)
    assert parse_length_range("64", "output_len") == LengthRange(64, 64)
    with pytest.raises(ValueError, match="input_len"):
        parse_length_range("9:3", "input_len")
    with pytest.raises(ValueError, match="input_len"):
        parse_length_range("a:b", "input_len")


def test_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 5}\n\n{"prompt": "bye"}\n')
    assert load_prompts_file(path, default_max_tokens=9) == [PromptSpec("hello", 5), PromptSpec("bye", 9)]
    path.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match="p.jsonl:2"):
        load_prompts_file(path, 9)
    path.write_text('{"prompt": "x", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        load_prompts_file(path, 9)
    with pytest.raises(ValueError, match="prompts_file"):
        load_prompts_file(tmp_path / "missing.jsonl", 9)


class StandInHandle:
    """Records which method the adapter calls and streams canned items, like a Serve handle would."""

    def __init__(self, items):
        self.items = items
        self.called = []
        self.payloads = []

    def __getattr__(self, name):
        handle = self

        class Method:
            def remote(self, payload):
                handle.called.append(name)
                handle.payloads.append(payload)
                return handle._stream()

        return Method()

    async def _stream(self):
        for item in self.items:
            await asyncio.sleep(0.01)
            yield item


def test_handle_target_streams_through_the_documented_method():
    items = [{"choices": [{"text": "A"}]}, 'data: {"choices": [{"text": "B"}]}\n\n',
             b'data: {"choices": [{"text": "", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n']
    handle = StandInHandle(items)
    target = HandleTarget("app", RequestOptions(model="m", temperature=0.0), handle=handle)
    record = RequestRecord(index=0, prompt_index=0)

    async def go():
        async with target:
            await target.send(PromptSpec("hi", 3), record)

    asyncio.run(go())
    assert handle.called == [HANDLE_STREAM_METHOD]
    assert handle.payloads[0]["prompt"] == "hi" and handle.payloads[0]["max_tokens"] == 3
    assert handle.payloads[0]["temperature"] == 0.0 and handle.payloads[0]["stream"] is True
    assert record.ok and record.text == "AB" and record.finish_reason == "stop"
    assert record.ttft >= 0.01 and record.e2e >= record.chunk_times[-1]


def test_handle_target_chat_uses_the_chat_method():
    handle = StandInHandle([{"choices": [{"delta": {"content": "A"}, "finish_reason": "stop"}]}])
    target = HandleTarget("app", RequestOptions(model="m", endpoint="chat"), handle=handle)
    record = RequestRecord(index=0, prompt_index=0)
    asyncio.run(target.send(PromptSpec("hi", 3), record))
    assert handle.called == [HANDLE_CHAT_STREAM_METHOD]
    assert handle.payloads[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert record.ok and record.text == "A"


def test_handle_target_maps_an_exception_to_a_failure():
    class Broken(StandInHandle):
        async def _stream(self):
            yield {"choices": [{"text": "A"}]}
            raise RuntimeError("replica died")

    record = RequestRecord(index=0, prompt_index=0)
    target = HandleTarget("app", RequestOptions(model="m"), handle=Broken([]))
    asyncio.run(target.send(PromptSpec("hi", 3), record))
    assert record.error == "handle_error" and "replica died" in record.error_detail


def args(*argv):
    return build_parser().parse_args(["--url", "http://127.0.0.1:1", *argv])


def test_config_validation_names_the_argument():
    with pytest.raises(ValueError, match="temperature"):
        config_from_args(args("--concurrency", "2", "--check", "--temperature", "0.7"))
    with pytest.raises(ValueError, match="reference"):
        config_from_args(args("--concurrency", "2", "--reference", "x.json"))
    with pytest.raises(ValueError, match="sweep"):
        config_from_args(args("--sweep", "1,-2"))
    with pytest.raises(ValueError, match="extra_body"):
        config_from_args(args("--rate", "1", "--extra-body", "[1]"))
    with pytest.raises(ValueError, match="url"):
        server_root("127.0.0.1:8000")
    with pytest.raises(ValueError, match="concurrency"):
        LoadSpec(num_requests=4, concurrency=0)
    with pytest.raises(ValueError, match="rate/concurrency"):
        LoadSpec(num_requests=4, rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="endpoint"):
        RequestOptions(model="m", endpoint="embeddings")


def test_config_from_args_builds_the_loads():
    config = config_from_args(args("--sweep", "0.5,2", "--num-requests", "7", "--duration", "30",
                                   "--extra-body", json.dumps({"ignore_eos": True})))
    assert [(load.rate, load.num_requests, load.duration_s) for load in config.loads] == [(0.5, 7, 30.0),
                                                                                           (2.0, 7, 30.0)]
    assert len(config.prompts) == 7 and config.options.extra_body == {"ignore_eos": True}
    check = config_from_args(args("--concurrency", "3", "--check"))
    assert check.options.temperature == 0.0 and check.loads[0].concurrency == 3
    assert server_root("http://h:1/v1/") == "http://h:1"
