"""A hybrid model's engine (cluster/hybrid.py): prefix caching with state snapshots (a log line says how many),
or switched off with a log line when ``hybrid_prefix_states`` is 0; a state pool of max_num_seqs seats plus the
snapshots in the block manager; peer pulls off and KV exports refused (states do not move); the options it cannot
take refused before any rank starts (ValueError naming the option)."""

from __future__ import annotations

import logging

import pytest
from pagedray.cluster.engine import Engine
from pagedray.cluster.llm import build_engine_config


def test_prefix_caching_keeps_state_snapshots_with_a_log_line(tiny_model_path, caplog):
    config = build_engine_config(tiny_model_path("qwen3.5"), dtype="float32", block_size=8, num_blocks=32,
                                 max_num_seqs=5, threads_per_worker=1, enable_prefix_caching=True,
                                 hybrid_prefix_states=3)
    with caplog.at_level(logging.INFO, logger="pagedray.cluster.hybrid"):
        engine = Engine(config)
    try:
        assert engine.config.cache.enable_prefix_caching and engine.block_manager.enable_prefix_caching
        assert not engine.config.cache.kv_peer_pull
        assert any("keeps 3 recurrent-state snapshots" in r.getMessage() for r in caplog.records)
        states = engine.block_manager.states
        assert (states.num_slots, states.num_snapshots) == (5, 3)
        assert engine.executor.worker.model.num_state_slots == 8        # every slot on the rank too
        with pytest.raises(ValueError, match="^export: not for Qwen3_5ForCausalLM"):
            engine.start_export([1, 2, 3])
    finally:
        engine.shutdown()


def test_without_snapshots_prefix_caching_goes_off_with_a_log_line(tiny_model_path, caplog):
    config = build_engine_config(tiny_model_path("qwen3.5"), dtype="float32", block_size=8, num_blocks=32,
                                 max_num_seqs=5, threads_per_worker=1, hybrid_prefix_states=0)
    with caplog.at_level(logging.INFO, logger="pagedray.cluster.hybrid"):
        engine = Engine(config)
    try:
        assert not engine.config.cache.enable_prefix_caching and not engine.block_manager.enable_prefix_caching
        assert any("prefix caching is off for Qwen3_5ForCausalLM" in r.getMessage() for r in caplog.records)
        assert engine.block_manager.stats().num_state_slots == 5 and engine.block_manager.states.num_snapshots == 0
        assert engine.executor.worker.model.num_state_slots == 5
    finally:
        engine.shutdown()


def test_a_dense_model_keeps_prefix_caching_and_has_no_state_pool(tiny_model_path):
    engine = Engine(build_engine_config(tiny_model_path("qwen3"), dtype="float32", block_size=8, num_blocks=32,
                                        threads_per_worker=1))
    try:
        assert engine.config.cache.enable_prefix_caching and engine.block_manager.states is None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("option, value", [("num_speculative_tokens", 2), ("kv_offload_gib", 0.01)])
def test_options_a_hybrid_cannot_take_are_refused_naming_them(tiny_model_path, option, value):
    config = build_engine_config(tiny_model_path("qwen3.5"), dtype="float32", block_size=8, num_blocks=32,
                                 threads_per_worker=1, **{option: value})
    with pytest.raises(ValueError, match=f"^{option}: .*Qwen3_5ForCausalLM"):
        Engine(config)


def test_a_state_pool_the_device_cannot_hold_is_a_value_error_naming_both_options(tiny_model_path, monkeypatch):
    """What torch raises when the seats + snapshots do not fit (the allocator is replaced here: a real allocation
    that large would depend on the machine's overcommit policy) reaches the caller as a ValueError naming them."""
    from pagedray.workers.models.qwen3_5 import Qwen3_5ForCausalLM

    def too_big(self, num_slots):
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {num_slots} slots")

    monkeypatch.setattr(Qwen3_5ForCausalLM, "allocate_states", too_big)
    config = build_engine_config(tiny_model_path("qwen3.5"), dtype="float32", block_size=8, num_blocks=32,
                                 max_num_seqs=5, threads_per_worker=1, hybrid_prefix_states=10**9)
    with pytest.raises(ValueError, match=r"^max_num_seqs / hybrid_prefix_states: 5 \+ 1000000000 recurrent-state "
                                         r"slots do not fit on this rank's cpu \(DefaultCPUAllocator"):
        Engine(config)
