"""`pagedray serve` with a model whose replica cannot start: the command ends with exit status 1 and
prints the replica's own exception and a hint (not Serve's "Failed to update the deployments" after its
retries), and never claims to be serving. Runs the real CLI in a subprocess with its private Ray."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from pagedray.deploy.cli.main import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]   # a process; slow (-m slow): CI keeps test_startup.py's units

CLI = "import sys; from pagedray.deploy.cli.main import main; sys.exit(main(sys.argv[1:]))"


def test_replica_start_failure_is_reported_with_its_cause_and_exit_1(default_model_path, tmp_path):
    model = tmp_path / "no-weights"
    model.mkdir()
    shutil.copy(os.path.join(default_model_path, "config.json"), model / "config.json")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS")}
    proc = subprocess.run([sys.executable, "-c", CLI, "serve", "--model", str(model), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=600, env=env)   # timeout: hang guard only
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    # one replica: the engine (and its failed weight load) is in the ingress replica (engine_in_ingress unset)
    assert "OpenAIIngress replica failed to start" in proc.stderr, proc.stderr[-4000:]
    assert f"WeightLoadError: model: no *.safetensors weight files in {model}" in proc.stderr
    assert "hint: --model must be" in proc.stderr
    assert "is serving at" not in proc.stdout
