"""Interleaved rounds for benchmark comparisons (DESIGN.md, "Performance method").

A comparison runs every system once per round, in an order that alternates between rounds
(``round_orders``: A B, then B A, ...), reads the load average before and after each run (``capture``,
``run_rounds``), and reports per system the median over clean rounds with the min-max spread, and per
ratio the median of per-round ratios (``summarize``, ``format_table``, ``report``).

Decisions:
- At least ``MIN_ROUNDS`` (3) rounds: with two, a median is just a mean and one bad round decides it.
- For more than two systems the order rotates (A B C, B C A, C A B): each system takes each place once
  per ``len(systems)`` rounds; for two systems rotation is the alternation A B / B A.
- Before each run the machine settles (``settle``): up to ``SETTLE_MAX_S`` for the 1-minute load average to
  fall to ``NOISY_LOAD_PER_CPU`` (1.0) per CPU, since the previous run's own work is still in it. A run is
  noisy when the load average read then (``load_before``) still exceeds 1.0 per CPU: other work was
  competing for the cores. ``load_after`` is recorded and shown but does not decide: it includes the
  run's own work, which alone keeps a 2-core machine near 2 (a server with two torch threads), so it
  would mark every run. Noisy runs stay in the JSON and are marked in the table; medians use the clean
  runs only. When every run of a statistic is noisy, its median is over all
  of them and it is flagged ``noisy`` -- results are never dropped silently.
- A ratio ``system / peer`` pairs the two runs of the same round, so a slow round slows both sides. With
  several peer variants (the peer at its defaults and tuned), each round uses the peer's best value of
  that round: the larger one where higher is better, the smaller one otherwise. A round's ratio is noisy
  when any run it reads (the system's or any peer variant's) is noisy.
- A failed run (``error``) or one without the metric is left out of that statistic; a statistic with no
  usable round is ``None``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIN_ROUNDS = 3
NOISY_LOAD_PER_CPU = 1.0
SETTLE_MAX_S = 120.0
SETTLE_POLL_S = 5.0


def check_rounds(rounds: int) -> int:
    """``rounds`` itself; ValueError naming the argument when it is not an integer >= MIN_ROUNDS."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < MIN_ROUNDS:
        raise ValueError(f"rounds: need an integer >= {MIN_ROUNDS} (interleaved rounds), got {rounds!r}")
    return rounds


def round_orders(systems: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of ``systems`` in each of ``rounds`` rounds: round ``r`` starts at ``systems[r % n]``."""
    check_rounds(rounds)
    systems = list(systems)
    if not systems or len(set(systems)) != len(systems):
        raise ValueError(f"systems: need at least one system and no duplicates, got {systems!r}")
    n = len(systems)
    return [systems[r % n:] + systems[:r % n] for r in range(rounds)]


def is_noisy(load: float, cpus: int) -> bool:
    """True when a load average ``load`` means more than NOISY_LOAD_PER_CPU runnable tasks per CPU."""
    if cpus < 1:
        raise ValueError(f"cpus: must be >= 1, got {cpus!r}")
    return load / cpus > NOISY_LOAD_PER_CPU


@dataclass
class Run:
    """One system measured once: its numeric ``values`` and the load averages (1, 5, 15 min) around it."""

    system: str
    round: int
    values: dict[str, float]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    details: dict = field(default_factory=dict)   # anything else JSON-able the script wants to keep
    error: str | None = None

    def noisy(self, cpus: int) -> bool:
        return is_noisy(self.load_before[0], cpus)

    def to_json(self) -> dict:
        return {"system": self.system, "round": self.round, "values": dict(self.values),
                "load_before": list(self.load_before), "load_after": list(self.load_after),
                "details": self.details, "error": self.error}

    @classmethod
    def from_json(cls, data: dict) -> Run:
        return cls(data["system"], data["round"], dict(data["values"]), tuple(data["load_before"]),
                   tuple(data["load_after"]), data.get("details") or {}, data.get("error"))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def capture(system: str, round_index: int, measure: Callable[[], dict], *,
            catch: tuple[type[BaseException], ...] = (), loadavg: Callable[[], tuple] = os.getloadavg) -> Run:
    """Run ``measure()`` between two load-average readings. Of the dict it returns, numbers (not bools)
    become the run's values and everything else its details. An exception of a type in ``catch`` is
    recorded as the run's ``error``; any other propagates."""
    before = tuple(loadavg())
    values, details, error = {}, {}, None
    try:
        for key, value in measure().items():
            (values if _is_number(value) else details)[key] = value
    except catch as err:
        error = f"{type(err).__name__}: {err}"
    return Run(system, round_index, values, before, tuple(loadavg()), details, error)


def settle(cpus: int, *, loadavg: Callable[[], tuple] = os.getloadavg, sleep: Callable[[float], None] = time.sleep,
           max_s: float | None = None, poll_s: float = SETTLE_POLL_S) -> float:
    """Waits until the 1-minute load average is at most NOISY_LOAD_PER_CPU per CPU, or ``max_s`` seconds
    (default: ``SETTLE_MAX_S`` as it is at the call; the test suite sets it to 0); returns the seconds waited."""
    max_s = SETTLE_MAX_S if max_s is None else max_s
    waited = 0.0
    while is_noisy(loadavg()[0], cpus) and waited < max_s:
        sleep(poll_s)
        waited += poll_s
    return waited


def run_rounds(systems: Sequence[str], rounds: int, measure: Callable[[str, int], dict], *,
               catch: tuple[type[BaseException], ...] = (), loadavg: Callable[[], tuple] = os.getloadavg,
               on_run: Callable[[Run], None] | None = None, cpus: int | None = None,
               sleep: Callable[[float], None] = time.sleep) -> list[Run]:
    """Every system once per round in ``round_orders`` order, each after ``settle``; ``measure(system,
    round)`` returns the dict ``capture`` splits. ``on_run`` sees each run as it finishes (progress)."""
    runs = []
    cpus = cpus or os.cpu_count() or 1
    for index, order in enumerate(round_orders(systems, rounds)):
        for system in order:
            settle(cpus, loadavg=loadavg, sleep=sleep)
            run = capture(system, index, lambda s=system, i=index: measure(s, i), catch=catch, loadavg=loadavg)
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return runs


@dataclass(frozen=True)
class Metric:
    """A value key of the runs, how to print it, and which direction is better."""

    key: str
    label: str | None = None
    higher_is_better: bool = True

    @property
    def name(self) -> str:
        return self.label or self.key


@dataclass(frozen=True)
class Ratio:
    """``system / best(peers)`` per round, for ``metrics`` (keys; None: every metric)."""

    system: str
    peers: tuple[str, ...]
    metrics: tuple[str, ...] | None = None
    label: str | None = None

    @property
    def name(self) -> str:
        peer = self.peers[0] if len(self.peers) == 1 else f"best of {', '.join(self.peers)}"
        return self.label or f"{self.system} / {peer}"


@dataclass(frozen=True)
class Stat:
    """Median and min-max of per-round samples; ``rounds``: the rounds it used; ``noisy``: all were."""

    median: float
    low: float
    high: float
    rounds: tuple[int, ...]
    noisy: bool

    def to_json(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high, "rounds": list(self.rounds),
                "noisy": self.noisy}


def stat(samples: Sequence[tuple[int, float, bool]]) -> Stat | None:
    """Median over the clean ``(round, value, noisy)`` samples, or over all of them flagged noisy."""
    if not samples:
        return None
    clean = [s for s in samples if not s[2]]
    used = clean or list(samples)
    values = [s[1] for s in used]
    return Stat(statistics.median(values), min(values), max(values), tuple(s[0] for s in used), not clean)


def _value(run: Run, key: str) -> float | None:
    return None if run.error is not None else run.values.get(key)


def system_stat(runs: Sequence[Run], system: str, metric: str, cpus: int) -> Stat | None:
    return stat([(r.round, _value(r, metric), r.noisy(cpus)) for r in runs
                 if r.system == system and _value(r, metric) is not None])


def ratio_samples(runs: Sequence[Run], ratio: Ratio, metric: Metric, cpus: int) -> list[tuple[int, float, bool]]:
    """``(round, system / best peer, noisy)`` for every round where both sides have the metric."""
    samples = []
    for index in sorted({r.round for r in runs}):
        in_round = [r for r in runs if r.round == index]
        mine = [r for r in in_round if r.system == ratio.system and _value(r, metric.key) is not None]
        peers = [r for r in in_round if r.system in ratio.peers and _value(r, metric.key) is not None]
        if not mine or not peers:
            continue
        pick = max if metric.higher_is_better else min
        peer = pick(_value(r, metric.key) for r in peers)
        if peer == 0:
            continue
        noisy = any(r.noisy(cpus) for r in in_round if r.system == ratio.system or r.system in ratio.peers)
        samples.append((index, _value(mine[0], metric.key) / peer, noisy))
    return samples


def ratio_stat(runs: Sequence[Run], ratio: Ratio, metric: Metric, cpus: int) -> Stat | None:
    return stat(ratio_samples(runs, ratio, metric, cpus))


def _systems(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(r.system for r in runs))


def _ratio_metrics(ratio: Ratio, metrics: Sequence[Metric]) -> list[Metric]:
    return [m for m in metrics if ratio.metrics is None or m.key in ratio.metrics]


def summarize(runs: Sequence[Run], metrics: Sequence[Metric], ratios: Sequence[Ratio], cpus: int) -> dict:
    """JSON-ready statistics: ``systems[system][metric]`` and ``ratios[ratio name][metric]``."""
    def js(value: Stat | None):
        return None if value is None else value.to_json()

    return {"systems": {s: {m.key: js(system_stat(runs, s, m.key, cpus)) for m in metrics} for s in _systems(runs)},
            "ratios": {q.name: {m.key: js(ratio_stat(runs, q, m, cpus)) for m in _ratio_metrics(q, metrics)}
                       for q in ratios}}


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):  # counts stay counts
        return str(value)
    size = abs(value)
    return f"{value:.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.2f}" if size >= 1 \
        else f"{value:.3g}"


def fmt_stat(value: Stat | None, suffix: str = "") -> str:
    if value is None:
        return "-"
    mark = " !" if value.noisy else ""
    return f"{fmt(value.median)}{suffix} [{fmt(value.low)}-{fmt(value.high)}]{mark}"


def _grid(rows: list[list[str]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first ``left`` columns left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)


def format_table(runs: Sequence[Run], metrics: Sequence[Metric], ratios: Sequence[Ratio], cpus: int) -> str:
    """Per metric each system's median [min-max]; then each ratio's per metric; then every run with its
    load averages, noisy runs and errors marked."""
    systems = _systems(runs)
    rows = [["metric", *systems]]
    rows += [[m.name, *(fmt_stat(system_stat(runs, s, m.key, cpus)) for s in systems)] for m in metrics]
    lines = [_grid(rows)]
    ratio_rows = [["ratio (per round)", "metric", "median [min-max]"]]
    ratio_rows += [[q.name, m.name, fmt_stat(ratio_stat(runs, q, m, cpus), "x")]
                   for q in ratios for m in _ratio_metrics(q, metrics)]
    if len(ratio_rows) > 1:
        lines += ["", _grid(ratio_rows, left=2)]
    run_rows = [["round", "system", "load", "mark"]]
    for r in runs:
        mark = "NOISY" if r.noisy(cpus) else ""
        if r.error is not None:
            mark = f"{mark} error: {r.error}".strip()
        run_rows.append([str(r.round), r.system, f"{r.load_before[0]:.2f} -> {r.load_after[0]:.2f}", mark])
    lines += ["", f"runs (1-minute load average before -> after; {cpus} CPUs):", _grid(run_rows, left=4),
              f"median [min-max] over clean runs; NOISY: load above {NOISY_LOAD_PER_CPU:g} per CPU before the "
              "run (after settling; 'after' includes the run's own work), left out of the medians; '!': every "
              "run was noisy, median over all of them"]
    return "\n".join(lines)


def git_commit(cwd: str | None = None) -> str | None:
    """``git rev-parse HEAD`` of ``cwd`` (default: the current directory), or None outside a checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (machines differ: AMD EPYC, Intel Xeon with AMX)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


NOTED_CPU_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni")


def cpu_features() -> dict:
    """Whether the CPU has AMX, and which of ``NOTED_CPU_FLAGS`` (the ones that decide the CPU kernels) it has."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {"amx": "amx_tile" in flags, "cpu_flags": [f for f in NOTED_CPU_FLAGS if f in flags]}


def environment() -> dict:
    """Machine, date and commit a report was taken on."""
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), **cpu_features(), "platform": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(os.path.dirname(os.path.abspath(__file__)))}


def report(name: str, runs: Sequence[Run], metrics: Sequence[Metric], ratios: Sequence[Ratio], cpus: int,
           config: dict | None = None) -> dict:
    """Everything as one JSON-able dict: environment, config, metric and ratio specs, runs, summary."""
    return {"benchmark": name, "environment": environment(), "config": config or {},
            "rounds": len({r.round for r in runs}), "cpus": cpus, "noisy_load_per_cpu": NOISY_LOAD_PER_CPU,
            "metrics": [{"key": m.key, "label": m.label, "higher_is_better": m.higher_is_better} for m in metrics],
            "ratios": [{"system": q.system, "peers": list(q.peers), "label": q.label,
                        "metrics": None if q.metrics is None else list(q.metrics)} for q in ratios],
            "runs": [r.to_json() for r in runs], "summary": summarize(runs, metrics, ratios, cpus)}


def from_report(data: dict) -> tuple[list[Run], list[Metric], list[Ratio], int]:
    """Runs, metrics, ratios and CPU count back from a ``report`` dict (after a JSON round trip)."""
    metrics = [Metric(m["key"], m["label"], m["higher_is_better"]) for m in data["metrics"]]
    ratios = [Ratio(q["system"], tuple(q["peers"]), None if q["metrics"] is None else tuple(q["metrics"]),
                    q["label"]) for q in data["ratios"]]
    return [Run.from_json(r) for r in data["runs"]], metrics, ratios, data["cpus"]
