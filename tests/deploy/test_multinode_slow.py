"""Two engine replicas on two simulated nodes through the YAML app; one node is removed mid-stream
(two_node_serve_check.py runs it in its own Ray cluster, as a subprocess)."""

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
    assert all(s["status"] == 200 and s["done"] for s in streams), streams     # both ended, none hung
    cut = [s for s in streams if s["error_event"]]
    assert len(cut) == 1 and cut[0]["finish_reason"] is None, streams   # the dead node's: a clean SSE error
    finished = next(s for s in streams if not s["error_event"])
    assert finished["finish_reason"] == "length"                # the live node's stream completed
    assert result["running_after"] == 1
    assert result["after_statuses"] == [200] * 5                # new requests go to the live replica
