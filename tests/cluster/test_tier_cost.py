"""TierCost: the weight of a second-tier block for routing, from measured step and load times."""

import pytest
from pagedray.cluster.tier_cost import TierCost


def test_the_weight_is_zero_until_both_costs_were_seen_then_what_a_load_saves():
    cost = TierCost(block_size=16)
    assert cost.weight == 0.0
    cost.observe(num_tokens=160, step_s=0.32, num_loads=0, load_s=0.0)      # 2 ms a token: 32 ms a block
    assert cost.weight == 0.0 and cost.compute_s_per_token == pytest.approx(0.002)
    cost.observe(num_tokens=40, step_s=0.5, num_loads=4, load_s=0.032)      # 8 ms a block loaded
    assert cost.load_s_per_block == pytest.approx(0.008)
    assert cost.weight == pytest.approx(1 - 0.008 / 0.032)
    cost.observe(num_tokens=8, step_s=5.0, num_loads=0, load_s=0.0)         # under a block's tokens: ignored
    assert cost.compute_s_per_token == pytest.approx(0.002)


def test_a_load_dearer_than_computing_weighs_nothing_and_averages_move_gradually():
    cost = TierCost(block_size=16)
    cost.observe(num_tokens=16, step_s=0.016, num_loads=0, load_s=0.0)      # 16 ms a block computed
    cost.observe(num_tokens=16, step_s=1.0, num_loads=1, load_s=0.05)       # 50 ms a block loaded
    assert cost.weight == 0.0
    cost.observe(num_tokens=16, step_s=0.032, num_loads=0, load_s=0.0)
    assert cost.compute_s_per_token == pytest.approx(0.8 * 0.001 + 0.2 * 0.002)
