"""SamplingParams and the engine configs reject bad values with messages naming the field."""

import math

import pytest
from pagedray.cluster import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1000), ("n", 1.5), ("max_tokens", 0), ("max_tokens", True), ("temperature", -0.1),
    ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("seed", "x"),
    ("stop_token_ids", [-1]), ("seed", 2**64), ("top_k", 2**63), ("stop_token_ids", [2**70]),
    ("ignore_eos", 1), ("logprobs", 21), ("logprobs", -1), ("min_tokens", -1), ("min_tokens", 17),
    ("logit_bias", [(3, 101.0)]), ("logit_bias", [(-1, 1.0)]), ("logit_bias", [(3, 1.0), (3, 2.0)]),
    ("logit_bias", [(3,)]), ("logit_bias", [(3, math.inf)]), ("logit_bias", [(i, 1.0) for i in range(1025)]),
])
def test_bad_sampling_param_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalise_and_round_trip():
    params = SamplingParams(temperature=0, stop_token_ids=[3, 4], top_k=-1, logprobs=0, min_tokens=2,
                            logit_bias=[[7, 5], (9, -2.5)])
    assert params.greedy and params.stop_token_ids == (3, 4) and params.logit_bias == ((7, 5.0), (9, -2.5))
    assert SamplingParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("build,field", [
    (lambda: ModelConfig(dtype="float64"), "dtype"),
    (lambda: ModelConfig(max_model_len=0), "max_model_len"),
    (lambda: CacheConfig(block_size=12), "block_size"),
    (lambda: CacheConfig(num_blocks=1), "num_blocks"),
    (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
    (lambda: ParallelConfig(executor="local", tensor_parallel_size=2), "executor"),
    (lambda: ParallelConfig(placement_strategy="RANDOM"), "placement_strategy"),
    (lambda: ParallelConfig(ray_transport="grpc"), "ray_transport"),
    (lambda: SchedulerConfig(policy="lifo"), "policy"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
])
def test_bad_config_names_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**_wrap(build()))


def _wrap(part):
    name = {ModelConfig: "model", CacheConfig: "cache", ParallelConfig: "parallel",
            SchedulerConfig: "scheduler"}[type(part)]
    return {name: part}


def test_max_model_len_must_fit_the_forced_pool():
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(model=ModelConfig(max_model_len=1000), cache=CacheConfig(num_blocks=10, block_size=16))
    config = EngineConfig(model=ModelConfig(max_model_len=160), cache=CacheConfig(num_blocks=10, block_size=16))
    assert config.parallel.use_ray is False
    assert ParallelConfig(tensor_parallel_size=2).use_ray


def test_merge_deltas_keeps_every_token_logprob_and_the_later_finish():
    from pagedray.cluster.outputs import CompletionOutput, RequestOutput, TokenLogprob, merge_deltas

    lp = [TokenLogprob(5, -0.1), TokenLogprob(6, -0.2), TokenLogprob(7, -0.3)]
    first = RequestOutput("r", [CompletionOutput(0, [5], lp[:1]), CompletionOutput(1, [9], lp[:1])], False,
                          prompt_token_ids=[1, 2], num_cached_prompt_tokens=8)
    later = RequestOutput("r", [CompletionOutput(0, [6, 7], lp[1:], "stop")], True)
    merged = merge_deltas(first, later)
    assert [(o.index, o.token_ids, o.finish_reason) for o in merged.outputs] == [(0, [5, 6, 7], "stop"),
                                                                               (1, [9], None)]
    assert merged.outputs[0].logprobs == lp and merged.finished and merged.prompt_token_ids == [1, 2]
    assert merged.num_cached_prompt_tokens == 8 and first.outputs[0].token_ids == [5]   # inputs untouched


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_stream_interval_must_be_a_positive_integer(value):
    from pagedray.workers.contract.config import EngineConfig

    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=value)
