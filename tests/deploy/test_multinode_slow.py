"""Two engine replicas on two simulated nodes through the YAML app; one node is removed mid-stream
(two_node_serve_check.py runs it in its own Ray cluster, as a subprocess): every stream, greedy and
seeded, completions and chat, ends with exactly its undisturbed text (the lost replica's streams continue
on the other one)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_lost_under_load_leaves_the_other_replica_serving(default_model_path):
    script = pathlib.Path(__file__).with_name("two_node_serve_check.py")
    proc = subprocess.run([sys.executable, str(script), default_model_path], capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replicas_per_node"] == [1, 1]            # one replica per node
    assert result["ingress_found"]                          # so the node removed is not the ingress' own
    assert result["cached_tokens"][0] == 0 and all(t > 0 for t in result["cached_tokens"][1:])   # routed together
    streams = result["streams"]
    assert all(s["status"] == 200 and s["done"] for s in streams), streams     # all ended, none hung
    assert not any(s["error_event"] for s in streams), streams                 # none cut
    assert all(s["finish_reason"] == "length" for s in streams), streams
    assert [s["text"] for s in streams] == result["expected"]                  # token for token
    assert result["failovers_after"] - result["failovers_before"] >= 1       # the dead node's streams moved
    assert result["running_after"] == 1
    assert result["after_statuses"] == [200] * 5                # new requests go to the live replica
