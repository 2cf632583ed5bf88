"""``main(argv)`` end to end against the fake server: table, JSON report, PNG plots, sweep, exit codes."""

import json
import subprocess
import sys

import pytest
from helpers.fake_openai_server import FakeBehavior, FakeOpenAIServer
from pagedray.deploy.loadtest import main

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)


@pytest.fixture
def matplotlib():
    return pytest.importorskip("matplotlib", reason="plots need the bench extra (matplotlib)")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    assert path.is_file() and path.read_bytes()[:8] == PNG_MAGIC, path


def test_single_run_writes_json_and_plots(tmp_path, capsys, matplotlib):
    out = tmp_path / "res" / "run.json"
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=0.05, inter_token_delay_s=0.02)) as server:
        rc = main(["--url", server.url, "--concurrency", "3", "--num-requests", "6", "--output-len", "4",
                   "--input-len", "5:10", "--metrics-interval", "0.05", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT p99 ms" in printed and "output tok/s" in printed and "concurrency=3" in printed
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert run["summary"]["completed"] == 6 and run["summary"]["output_tokens"] == 24
    assert len(run["requests"]) == 6 and all(r["output_tokens"] == 4 for r in run["requests"])
    assert run["metrics"]["times_s"] and run["metrics"]["values"]["pagedray:kv_cache_usage_perc"]
    assert sorted(report["plots"]) == sorted([str(out.parent / "run_latency_cdf.png"),
                                              str(out.parent / "run_timeline.png")])
    for path in (out.parent / "run_latency_cdf.png", out.parent / "run_timeline.png"):
        assert_png(path)


def test_sweep_writes_one_run_per_rate_and_the_curve(tmp_path, matplotlib):
    out = tmp_path / "sweep.json"
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=0.02, inter_token_delay_s=0.01)) as server:
        rc = main(["--url", server.url, "--sweep", "20,inf", "--num-requests", "5", "--output-len", "3",
                   "--out", str(out), "--no-progress", "--no-metrics"])
        assert server.arrivals == 10
    assert rc == 0
    report = json.loads(out.read_text())
    assert [run["summary"]["load"] for run in report["runs"]] == ["rate=20/s", "rate=inf/s"]
    assert all(run["summary"]["completed"] == 5 for run in report["runs"])
    assert_png(tmp_path / "sweep_sweep.png")
    assert_png(tmp_path / "sweep_rate20s_latency_cdf.png")
    assert_png(tmp_path / "sweep_rateinfs_timeline.png")


def test_exit_code_is_1_when_nothing_completes(tmp_path):
    with FakeOpenAIServer(FakeBehavior(faults=("500",))) as server:
        rc = main(["--url", server.url, "--concurrency", "2", "--num-requests", "4", "--no-progress",
                   "--no-metrics"])
    assert rc == 1


def test_metrics_unavailable_is_a_note_not_a_failure(tmp_path):
    out = tmp_path / "r.json"
    with FakeOpenAIServer(FakeBehavior()) as server:
        rc = main(["--url", server.url, "--concurrency", "1", "--num-requests", "2", "--no-progress",
                   "--no-plots", "--metrics-url", server.url + "/nope", "--metrics-interval", "0.05",
                   "--out", str(out)])
    metrics = json.loads(out.read_text())["runs"][0]["metrics"]
    assert rc == 0 and metrics["times_s"] == [] and "404" in metrics["note"]


def test_bad_arguments_exit_2_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:9", "--concurrency", "2", "--input-len", "5:1"])
    assert exc.value.code == 2 and "input_len" in capsys.readouterr().err


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "pagedray.deploy.loadtest", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--sweep" in done.stdout and "--check" in done.stdout


def test_without_model_the_servers_own_model_is_asked_for(tmp_path, capsys):
    """Issue #32: against a server started with --model PATH every request named "default" and got a 404.
    Without --model the load tester now sends the first model of /v1/models."""
    out = tmp_path / "r.json"
    with FakeOpenAIServer(FakeBehavior(models=("SmolLM2-local", "other"), strict_model=True)) as server:
        rc = main(["--url", server.url + "/v1", "--concurrency", "2", "--num-requests", "4", "--output-len", "2",
                   "--no-progress", "--no-metrics", "--no-plots", "--out", str(out)])
        assert server.arrivals == 4
    report = json.loads(out.read_text())
    assert rc == 0, report["runs"][0]["summary"]
    assert report["model"] == "SmolLM2-local" and report["runs"][0]["summary"]["completed"] == 4
    assert "model: SmolLM2-local" in capsys.readouterr().out


def test_a_model_the_server_does_not_serve_fails_every_request_and_exits_1(tmp_path):
    out = tmp_path / "r.json"
    with FakeOpenAIServer(FakeBehavior(models=("SmolLM2-local",), strict_model=True)) as server:
        rc = main(["--url", server.url, "--model", "default", "--concurrency", "2", "--num-requests", "3",
                   "--no-progress", "--no-metrics", "--no-plots", "--out", str(out)])
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert rc == 1 and summary["failed"] == 3 and summary["failed_by_cause"] == {"http_404": 3}


def test_a_server_listing_no_model_is_an_error_naming_the_option(capsys):
    with FakeOpenAIServer(FakeBehavior(models=())) as server:
        rc = main(["--url", server.url, "--concurrency", "1", "--num-requests", "1", "--no-progress",
                   "--no-metrics", "--no-plots"])
        assert server.arrivals == 0   # nothing was sent
    assert rc == 1 and "lists no model; pass --model" in capsys.readouterr().err
