"""``benchmarks.host_step``'s plumbing without timing anything that matters: a stubbed engine reaches an
all-decode batch, reports every part of its steps and ends with every request finished and every block
free, and a child process measures one system and says which code tree ran."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import host_step


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return host_step.save_tiny_model(tmp_path_factory.mktemp("host-step-model"))


def test_a_stubbed_engine_reports_each_part_of_its_decode_steps(tiny_model):
    engine, clock = host_step.build_engine(tiny_model, batch=6, prompt_len=20, steps=4, stub_forward=True)
    try:
        values = host_step.measure(engine, clock, batch=6, prompt_len=20, steps=4, round_index=0)
        assert set(values) == {f"{k}_ms" for k in ("step", *host_step.PARTS, "wire")}
        assert all(values[f"{part}_ms"] > 0 for part in host_step.PARTS)
        assert sum(values[f"{part}_ms"] for part in host_step.PARTS) <= values["step_ms"] * 1.05
        assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == \
            engine.block_manager.num_blocks                       # every request finished, every block back
    finally:
        engine.shutdown()


def test_a_child_process_measures_one_system_on_this_checkout():
    args = argparse.Namespace(prompt_len=8, steps=2, threads=1, device="cpu", tenants=0)
    values = host_step.run_child("stub-3", 0, args, None)
    assert values["code"] == str(host_step.REPO) and values["step_ms"] > 0 and values["sample_ms"] > 0


def test_a_stubbed_engine_with_tenants_spreads_its_requests_over_them(tiny_model):
    engine, clock = host_step.build_engine(tiny_model, batch=6, prompt_len=20, steps=4, stub_forward=True,
                                           tenants=3)
    try:
        host_step.measure(engine, clock, batch=6, prompt_len=20, steps=4, round_index=0, tenants=3)
        fair = engine.scheduler.fair
        assert sorted(fair.tenants) == ["default", "t0", "t1", "t2"]
        assert all(fair.tenants[f"t{i}"].counter > 0 for i in range(3)) and fair.tenants["default"].counter == 0
        assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == \
            engine.block_manager.num_blocks
    finally:
        engine.shutdown()
