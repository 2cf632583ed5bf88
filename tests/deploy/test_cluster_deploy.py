"""``pagedray deploy`` (deploy/cli/cluster_deploy.py) with the Ray and Serve CLIs faked: the calls it makes,
in order, with token auth; a cluster given by ``--address``; a failing step, a failed replica and a timeout
each end it with a report. The real commands run in .ci/serve_smoke, as the README gives them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pagedray.deploy.cli import cluster_deploy
from pagedray.deploy.cli import main as cli
from pagedray.deploy.cli.cluster_deploy import DeployError, deploy, http_endpoint

CONFIG = cli.PACKAGED_CONFIG


class FakeCli:
    """Records each call's argv (after the interpreter) and environment; answers from ``outcomes``."""

    def __init__(self, outcomes: dict[str, tuple[int, str]] | None = None) -> None:
        self.calls, self.envs, self.outcomes = [], [], outcomes or {}

    def __call__(self, argv, env, capture_output, text):
        assert argv[0] == sys.executable and capture_output and text
        words = argv[2:]
        self.calls.append(" ".join(["ray" if argv[2] == "ray.scripts.scripts" else "serve", *words[1:]]))
        self.envs.append(env)
        code, output = next((v for k, v in self.outcomes.items() if self.calls[-1].startswith(k)), (0, ""))
        return subprocess.CompletedProcess(argv, code, output, "")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _deploy(fake, environ=None, address=None, healthy_after=3, timeout_s=60.0, clock=None):
    clock = clock or Clock()
    polls = []

    def healthy(host, port):
        polls.append((host, port))
        return len(polls) > healthy_after
    url = deploy(CONFIG, address, timeout_s, environ or {}, run=fake, healthy=healthy, sleep=clock.sleep,
                 clock=clock, say=lambda line: None)
    return url, polls


def test_a_fresh_deploy_starts_ray_with_token_auth_deploys_and_waits_for_health():
    fake = FakeCli()
    url, polls = _deploy(fake)
    assert fake.calls == ["ray get-auth-token --generate", "ray start --head", f"serve deploy {CONFIG}"]
    assert all(env["RAY_AUTH_MODE"] == "token" for env in fake.envs)
    assert fake.envs[1]["RAY_worker_niceness"] == "0" and "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in fake.envs[1]
    assert url == "http://127.0.0.1:8000" and polls == [("127.0.0.1", 8000)] * 4


def test_an_auth_mode_set_by_the_user_wins_and_a_running_cluster_is_not_started_again():
    fake = FakeCli()
    _deploy(fake, environ={"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "5"}, address="auto")
    assert fake.calls == [f"serve deploy {CONFIG} --address http://127.0.0.1:8265"]
    assert fake.envs[0]["RAY_AUTH_MODE"] == "disabled" and fake.envs[0]["RAY_worker_niceness"] == "5"


def test_a_failing_step_ends_the_deploy_with_its_name_and_output():
    fake = FakeCli({"ray start": (1, "ConnectionError: Ray is already running at 127.0.0.1:6379")})
    with pytest.raises(DeployError, match=r"(?s)ray start --head failed .*already running"):
        _deploy(fake)
    assert fake.calls[-1] == "ray start --head"            # nothing deployed after it


def test_a_replica_that_fails_to_start_ends_the_wait_with_serve_status():
    fake = FakeCli({"serve status": (0, "applications:\n  pagedray:\n    status: DEPLOY_FAILED\n")})
    with pytest.raises(DeployError, match=r"(?s)failed to start; serve status:\n.*DEPLOY_FAILED"):
        _deploy(fake, healthy_after=10**6)
    assert fake.calls.count("serve status") == 1


def test_deploy_failed_is_seen_above_a_replica_traceback_of_many_pages():
    traceback = "".join(f"  File \"frame_{i}.py\", line {i}, in f\n    call_{i}()\n" for i in range(2000))
    report = ("applications:\n  pagedray:\n    status: DEPLOY_FAILED\n    message: failed to start 3 times\n"
              f"{traceback}ImportError: cannot import name 'X' from 'kernels'\n")
    fake = FakeCli({"serve status": (0, report)})
    with pytest.raises(DeployError) as failed:
        _deploy(fake, healthy_after=10**6)
    assert fake.calls.count("serve status") == 1              # the first report ends the wait
    shown = str(failed.value)
    assert "status: DEPLOY_FAILED" in shown and shown.endswith("from 'kernels'")   # head and tail both kept
    assert "characters left out" in shown and len(shown) < len(report) // 10


def test_an_app_that_never_answers_times_out_with_serve_status():
    fake = FakeCli({"serve status": (0, "status: DEPLOYING")})
    clock = Clock()
    with pytest.raises(DeployError, match="within 30 s; serve status:\nstatus: DEPLOYING"):
        _deploy(fake, healthy_after=10**6, timeout_s=30.0, clock=clock)
    assert clock.now == 30.0


def test_the_endpoint_comes_from_the_configs_http_options(tmp_path):
    assert http_endpoint(CONFIG) == ("127.0.0.1", 8000)
    other = tmp_path / "other.yaml"
    other.write_text("http_options:\n  host: 0.0.0.0\n  port: 9001\napplications: []\n")
    assert http_endpoint(other) == ("0.0.0.0", 9001)
    (tmp_path / "bad.yaml").write_text("just: text\n")
    with pytest.raises(ValueError, match="^config: .*not a Serve config"):
        http_endpoint(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="^config: cannot read"):
        http_endpoint(tmp_path / "missing.yaml")


def test_the_command_reports_a_failure_with_exit_status_1(monkeypatch, capsys):
    def failing(*args, **kwargs):
        raise DeployError("serve deploy failed (exit status 1):\nno cluster")
    monkeypatch.setattr(cluster_deploy, "deploy", failing)
    assert cli.main(["deploy", str(CONFIG)]) == 1
    assert "pagedray deploy: serve deploy failed" in capsys.readouterr().err
    ns = cli.build_parser().parse_args(["deploy"])
    assert ns.config == str(CONFIG) and CONFIG.is_file() and ns.address is None and ns.timeout_s == 900.0


def test_a_config_that_is_not_a_serve_config_is_a_usage_error_before_anything_starts(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cluster_deploy, "deploy", lambda *a, **k: pytest.fail("started with a bad config"))
    assert cli.main(["deploy", str(tmp_path / "missing.yaml")]) == 2
    assert "pagedray deploy: error: config: cannot read" in capsys.readouterr().err
    (tmp_path / "other.yaml").write_text("just: text\n")
    assert cli.main(["deploy", str(tmp_path / "other.yaml")]) == 2
    assert "not a Serve config" in capsys.readouterr().err
