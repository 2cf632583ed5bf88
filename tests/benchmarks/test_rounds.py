"""benchmarks.rounds: interleaving, load-average bookkeeping, medians over clean rounds, per-round ratios
against the best peer variant, the table and the JSON report (pure: no timing, no servers)."""

import argparse
import json

import pytest

from benchmarks import rounds
from benchmarks.common import add_round_args
from benchmarks.rounds import Metric, Ratio, Run

CPUS = 2
QUIET, BUSY = 0.5, 2.5   # 1-minute load averages: 0.25 and 1.25 per CPU


def run(system, index, value, load=QUIET, after=None, key="tok_s", error=None):
    after = load if after is None else after
    return Run(system, index, {} if value is None else {key: value}, (load, 1.0, 1.0), (after, 1.0, 1.0),
               error=error)


def _noisy_lines(table: str) -> int:
    return sum(line.rstrip().endswith("NOISY") for line in table.splitlines())


def test_two_systems_alternate_and_more_rotate():
    assert rounds.round_orders(["A", "B"], 4) == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    orders = rounds.round_orders(["A", "B", "C"], 3)
    assert orders == [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"]]
    for place in range(3):  # every system takes every place once
        assert sorted(order[place] for order in orders) == ["A", "B", "C"]


@pytest.mark.parametrize("bad", [0, 2, True, 2.5, "3"])
def test_fewer_than_three_rounds_is_refused_naming_the_argument(bad):
    with pytest.raises(ValueError, match="rounds: need an integer >= 3"):
        rounds.round_orders(["A", "B"], bad)


def test_systems_must_be_distinct_and_present():
    with pytest.raises(ValueError, match="systems"):
        rounds.round_orders([], 3)
    with pytest.raises(ValueError, match="systems"):
        rounds.round_orders(["A", "A"], 3)


def test_rounds_flag_rejects_two_and_defaults_to_three():
    parser = argparse.ArgumentParser()
    add_round_args(parser, "x")
    assert parser.parse_args([]).rounds == 3 and parser.parse_args([]).out == "benchmarks/results/x.json"
    assert parser.parse_args(["--rounds", "5"]).rounds == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "2"])


def test_noisy_means_more_than_one_per_cpu_before_the_run():
    assert not rounds.is_noisy(2.0, 2) and rounds.is_noisy(2.01, 2) and rounds.is_noisy(1.5, 1)
    with pytest.raises(ValueError, match="cpus"):
        rounds.is_noisy(1.0, 0)
    assert not run("A", 0, 1.0).noisy(CPUS)
    assert run("A", 0, 1.0, load=BUSY).noisy(CPUS)
    assert not run("A", 0, 1.0, load=QUIET, after=BUSY).noisy(CPUS)   # after: the run's own work


def test_settle_waits_for_the_load_to_fall_but_not_forever():
    loads, naps = iter([5.0, 4.0, 3.0, 1.5, 9.0]), []
    waited = rounds.settle(2, loadavg=lambda: (next(loads), 0.0, 0.0), sleep=naps.append, max_s=120.0,
                           poll_s=5.0)
    assert waited == 15.0 and naps == [5.0, 5.0, 5.0]
    naps.clear()
    assert rounds.settle(2, loadavg=lambda: (8.0, 0.0, 0.0), sleep=naps.append, max_s=20.0, poll_s=5.0) == 20.0
    assert len(naps) == 4


def test_capture_reads_the_load_around_the_run_and_splits_values_from_details():
    readings = iter([(0.1, 0.2, 0.3), (3.0, 2.0, 1.0)])
    calls = []

    def measure():
        calls.append("ran")
        return {"tok_s": 12.5, "steps": 3, "ok": True, "command": ["x"]}

    result = rounds.capture("A", 1, measure, loadavg=lambda: next(readings))
    assert calls == ["ran"]
    assert result.load_before == (0.1, 0.2, 0.3) and result.load_after == (3.0, 2.0, 1.0)
    assert result.values == {"tok_s": 12.5, "steps": 3}
    assert result.details == {"ok": True, "command": ["x"]} and result.error is None


def test_capture_records_only_the_errors_it_is_told_to_catch():
    def fail():
        raise RuntimeError("did not start")

    result = rounds.capture("A", 0, fail, catch=(RuntimeError,), loadavg=lambda: (0, 0, 0))
    assert result.error == "RuntimeError: did not start" and result.values == {}
    with pytest.raises(RuntimeError):
        rounds.capture("A", 0, fail, loadavg=lambda: (0, 0, 0))


def test_run_rounds_measures_in_the_interleaved_order():
    seen = []
    loads = iter(float(i) for i in range(100))
    runs = rounds.run_rounds(["A", "B"], 3, lambda s, i: seen.append((s, i)) or {"v": i},
                             loadavg=lambda: (next(loads), 0.0, 0.0), on_run=lambda r: seen.append(r.system),
                             cpus=1000, sleep=lambda s: pytest.fail("a quiet machine needs no settling"))
    assert seen == [("A", 0), "A", ("B", 0), "B", ("B", 1), "B", ("A", 1), "A", ("A", 2), "A", ("B", 2), "B"]
    assert [(r.system, r.round, r.values["v"]) for r in runs] == [
        ("A", 0, 0), ("B", 0, 0), ("B", 1, 1), ("A", 1, 1), ("A", 2, 2), ("B", 2, 2)]
    # three readings per run: the settle check, then before and after
    assert [r.load_before[0] for r in runs] == [1, 4, 7, 10, 13, 16] and runs[-1].load_after[0] == 17


def test_median_and_spread_leave_noisy_and_failed_rounds_out():
    runs = [run("A", 0, 10.0), run("A", 1, 100.0, load=BUSY), run("A", 2, 11.0), run("A", 3, 12.0),
            run("A", 4, None, error="RuntimeError: x")]
    stat = rounds.system_stat(runs, "A", "tok_s", CPUS)
    assert (stat.median, stat.low, stat.high, stat.rounds, stat.noisy) == (11.0, 10.0, 12.0, (0, 2, 3), False)
    assert rounds.system_stat(runs, "A", "missing", CPUS) is None
    assert rounds.system_stat(runs, "B", "tok_s", CPUS) is None


def test_all_noisy_rounds_give_medians_over_all_flagged_noisy():
    runs = [run("A", 0, 10.0, load=BUSY), run("A", 1, 30.0, load=BUSY), run("A", 2, 20.0, load=BUSY)]
    stat = rounds.system_stat(runs, "A", "tok_s", CPUS)
    assert (stat.median, stat.low, stat.high, stat.rounds, stat.noisy) == (20.0, 10.0, 30.0, (0, 1, 2), True)
    summary = rounds.summarize(runs, [Metric("tok_s")], [], CPUS)
    assert summary["systems"]["A"]["tok_s"]["noisy"] is True and summary["systems"]["A"]["tok_s"]["median"] == 20.0
    table = rounds.format_table(runs, [Metric("tok_s")], [], CPUS)
    assert "20.0 [10.0-30.0] !" in table and _noisy_lines(table) == 3


def test_ratio_pairs_runs_of_the_same_round():
    runs = [run("A", 0, 30.0), run("P", 0, 10.0), run("P", 1, 12.0), run("A", 1, 36.0),
            run("A", 2, 20.0), run("P", 2, 5.0), run("A", 3, 99.0, load=BUSY), run("P", 3, 1.0)]
    ratio = Ratio("A", ("P",))
    samples = rounds.ratio_samples(runs, ratio, Metric("tok_s"), CPUS)
    assert samples == [(0, 3.0, False), (1, 3.0, False), (2, 4.0, False), (3, 99.0, True)]
    stat = rounds.ratio_stat(runs, ratio, Metric("tok_s"), CPUS)
    assert (stat.median, stat.low, stat.high, stat.rounds, stat.noisy) == (3.0, 3.0, 4.0, (0, 1, 2), False)
    # the median of per-round ratios, not the ratio of the medians (30 / 7.5 = 4.0 here)
    assert stat.median != rounds.system_stat(runs, "A", "tok_s", CPUS).median / \
        rounds.system_stat(runs, "P", "tok_s", CPUS).median
    assert ratio.name == "A / P"


def test_a_noisy_peer_variant_makes_the_round_noisy():
    runs = [run("A", 0, 30.0), run("P", 0, 10.0), run("T", 0, 5.0, load=BUSY)]
    assert rounds.ratio_samples(runs, Ratio("A", ("P", "T")), Metric("tok_s"), CPUS) == [(0, 3.0, True)]
    assert rounds.ratio_samples(runs, Ratio("A", ("P",)), Metric("tok_s"), CPUS) == [(0, 3.0, False)]


def test_ratio_uses_the_best_peer_variant_of_each_round():
    default = [10.0, 12.0, 8.0]
    tuned = [15.0, 9.0, 8.0]     # tuned wins round 0 only
    mine = [30.0, 36.0, 24.0]
    runs = [run(s, i, v) for i in range(3) for s, v in (("A", mine[i]), ("P", default[i]), ("T", tuned[i]))]
    best = Ratio("A", ("P", "T"))
    assert [s[1] for s in rounds.ratio_samples(runs, best, Metric("tok_s"), CPUS)] == [2.0, 3.0, 3.0]
    assert best.name == "A / best of P, T"
    # lower is better (a latency): the best peer is the smaller one
    samples = rounds.ratio_samples(runs, best, Metric("tok_s", higher_is_better=False), CPUS)
    assert [s[1] for s in samples] == [3.0, 4.0, 3.0]
    stat = rounds.ratio_stat(runs, best, Metric("tok_s"), CPUS)
    assert (stat.median, stat.low, stat.high) == (3.0, 2.0, 3.0)
    # a failed peer variant is left out of that round's choice
    runs[1] = run("P", 0, None, error="RuntimeError: x")
    assert rounds.ratio_samples(runs, best, Metric("tok_s"), CPUS)[0][1] == 2.0


def test_ratio_restricted_to_metrics_and_the_table_shows_it():
    runs = [run(s, i, v, key=k) for i in range(3) for s, v in (("A", 20.0), ("P", 10.0)) for k in ("a", "b")]
    metrics = [Metric("a", "tok/s"), Metric("b", "TTFT ms", higher_is_better=False)]
    summary = rounds.summarize(runs, metrics, [Ratio("A", ("P",), ("a",), "A / peer")], CPUS)
    assert set(summary["ratios"]["A / peer"]) == {"a"}
    assert summary["ratios"]["A / peer"]["a"]["median"] == 2.0
    table = rounds.format_table(runs, metrics, [Ratio("A", ("P",), ("a",), "A / peer")], CPUS)
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "A", "P"]
    assert lines[1].split() == ["tok/s", "20.0", "[20.0-20.0]", "10.0", "[10.0-10.0]"]
    assert lines[2].split()[:2] == ["TTFT", "ms"]
    ratio_lines = [line for line in lines if line.startswith("A / peer")]
    assert [line.split() for line in ratio_lines] == [["A", "/", "peer", "tok/s", "2.00x", "[2.00-2.00]"]]
    assert _noisy_lines(table) == 0


def test_report_round_trips_through_json():
    runs = [run("A", 0, 30.0), run("P", 0, 10.0, load=BUSY), run("P", 1, 12.0), run("A", 1, 36.0),
            run("A", 2, 20.0), run("P", 2, 5.0)]
    runs[0].details["command"] = ["pagedray", "serve"]
    metrics, ratios = [Metric("tok_s", "tok/s")], [Ratio("A", ("P",))]
    data = rounds.report("demo", runs, metrics, ratios, CPUS, config={"rounds": 3})
    loaded = json.loads(json.dumps(data))
    back_runs, back_metrics, back_ratios, cpus = rounds.from_report(loaded)
    assert back_runs == runs and back_metrics == metrics and back_ratios == ratios and cpus == CPUS
    assert rounds.summarize(back_runs, back_metrics, back_ratios, cpus) == loaded["summary"]
    assert loaded["summary"]["ratios"]["A / P"]["tok_s"] == {"median": 3.5, "min": 3.0, "max": 4.0,
                                                              "rounds": [1, 2], "noisy": False}
    env = loaded["environment"]
    assert env["cpu_count"] and env["python"] and env["platform"] and "date" in env and "git_commit" in env
    assert loaded["rounds"] == 3 and loaded["config"] == {"rounds": 3}
