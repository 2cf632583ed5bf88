"""``main(argv)`` end to end against the fake server: table, JSON report, PNG plots, sweep, exit codes."""

import json
import subprocess
import sys

import pytest
from fake_openai_server import FakeBehavior, FakeOpenAIServer
from pagedray.deploy.loadtest import main


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
