"""Bundle choice when the engine already lives in a placement group (a Serve replica's)."""

import pytest
from pagedray.cluster.placement import bundle_indices_in_existing_group


def test_replica_bundle_zero_is_left_to_the_replica():
    assert bundle_indices_in_existing_group(num_bundles=3, tp_size=2) == [1, 2]
    assert bundle_indices_in_existing_group(num_bundles=5, tp_size=2) == [1, 2]


def test_exactly_tp_bundles_are_used_in_order():
    assert bundle_indices_in_existing_group(num_bundles=2, tp_size=2) == [0, 1]


def test_too_few_bundles_is_a_value_error_naming_tensor_parallel_size():
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks need 4"):
        bundle_indices_in_existing_group(num_bundles=3, tp_size=4)
