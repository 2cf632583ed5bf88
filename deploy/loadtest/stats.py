"""Summaries of a load run: counts by outcome, rates, latency percentiles; the printed table.

Decisions: docs/design/deploy.md, ``pagedray.deploy.loadtest.stats``.
"""

from __future__ import annotations

import math
from collections import Counter

from pagedray.deploy.loadtest.record import RequestRecord
from pagedray.deploy.loadtest.runner import RunResult

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile; ValueError for an empty list or p outside [0, 100]."""
    if not values:
        raise ValueError("values: cannot take a percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"p: must be within [0, 100], got {p!r}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds, per metric, over completed requests."""
    done = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2e": [r.e2e for r in done if r.e2e is not None],
    }


def describe_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    values_ms = [v * 1000.0 for v in values_s]
    return {"mean": sum(values_ms) / len(values_ms),
            **{f"p{p}": percentile(values_ms, p) for p in PERCENTILES}}


def summarize(result: RunResult) -> dict:
    """JSON-ready summary of one run."""
    records = result.records
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    duration = result.duration_s
    samples = latency_samples(records)
    return {
        "load": result.load.label,
        "sent": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failed_by_cause": dict(sorted(Counter(r.error for r in records if not r.ok).items())),
        "duration_s": duration,
        "req_per_s": len(done) / duration if duration > 0 else 0.0,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / duration if duration > 0 else 0.0,
        **{f"{name}_ms": describe_ms(samples[name]) for name in LATENCY_METRICS},
    }


def throughput_series(records: list[RequestRecord], bin_s: float) -> tuple[list[float], list[float]]:
    """Output text events per second in bins of ``bin_s`` over the run (client side), bin starts."""
    if bin_s <= 0:
        raise ValueError(f"bin_s: must be > 0, got {bin_s!r}")
    stamps = [r.send_s + t for r in records if r.ok for t in r.chunk_times]
    if not stamps:
        return [], []
    counts = Counter(int(stamp // bin_s) for stamp in stamps)
    last = max(counts)
    return [i * bin_s for i in range(last + 1)], [counts.get(i, 0) / bin_s for i in range(last + 1)]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(summaries: list[dict]) -> str:
    """A plain-text table, one column per run summary."""
    rows = [("load", [s["load"] for s in summaries]),
            ("completed", [str(s["completed"]) for s in summaries]),
            ("failed", [str(s["failed"]) for s in summaries])]
    causes = sorted({cause for s in summaries for cause in s["failed_by_cause"]})
    rows += [(f"  {cause}", [str(s["failed_by_cause"].get(cause, 0)) for s in summaries]) for cause in causes]
    rows += [("duration s", [f"{s['duration_s']:.2f}" for s in summaries]),
             ("req/s", [f"{s['req_per_s']:.2f}" for s in summaries]),
             ("output tok/s", [f"{s['output_tok_per_s']:.1f}" for s in summaries])]
    for name in LATENCY_METRICS:
        for stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
            rows.append((f"{name.upper()} {stat} ms", [_fmt(s[f"{name}_ms"][stat]) for s in summaries]))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(values[i]) for _, values in rows) for i in range(len(summaries))]
    lines = []
    for label, values in rows:
        cells = "  ".join(value.rjust(width) for value, width in zip(values, widths))
        lines.append(f"{label.ljust(label_width)}  {cells}")
    return "\n".join(lines)
