"""PNG plots of load runs (matplotlib, the ``bench`` extra; imported only when plots are drawn).

- ``*_latency_cdf.png``: empirical CDFs of TTFT, TPOT, ITL and E2E (ms), completed requests only.
- ``*_timeline.png``: client-side output throughput (text events per second, binned) and, from the
  target's ``/metrics``, running / waiting requests and KV-cache usage over the run.
- ``*_sweep.png``: latency against achieved output throughput, one point per swept rate.
The Agg backend is selected so plots work without a display.
"""

from __future__ import annotations

import pathlib

from pagedray.deploy.loadtest.metrics import KV_USAGE, RUNNING, WAITING
from pagedray.deploy.loadtest.runner import RunResult
from pagedray.deploy.loadtest.stats import LATENCY_METRICS, latency_samples, throughput_series


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'pagedray[bench]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(result: RunResult, path: pathlib.Path) -> None:
    plt = _pyplot()
    samples = latency_samples(result.records)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, LATENCY_METRICS):
        values = sorted(v * 1000.0 for v in samples[name])
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name.upper()} ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction <= x")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"latency CDFs, {result.load.label}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _series(result: RunResult, name: str) -> tuple[list[float], list[float]]:
    points = [(t, v) for t, v in zip(result.metrics.times, result.metrics.values[name]) if v is not None]
    return [t for t, _ in points], [v for _, v in points]


def timeline_bin_s(duration_s: float) -> float:
    """About 40 bins over the run, each between 0.05 s and 5 s."""
    return min(max(duration_s / 40.0, 0.05), 5.0)


def plot_timeline(result: RunResult, path: pathlib.Path) -> None:
    plt = _pyplot()
    fig, (ax_tp, ax_queue, ax_kv) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    bin_s = timeline_bin_s(result.duration_s)
    starts, rates = throughput_series(result.records, bin_s)
    if starts:  # close the last bin so a single bin still draws a step
        ax_tp.step(starts + [starts[-1] + bin_s], rates + [rates[-1]], where="post")
    ax_tp.set_ylabel(f"output events/s (client, {bin_s:.2g} s bins)")
    for name, label in ((RUNNING, "running"), (WAITING, "waiting")):
        times, values = _series(result, name)
        ax_queue.plot(times, values, marker=".", label=label)
    ax_queue.set_ylabel("requests (/metrics)")
    ax_queue.legend()
    times, values = _series(result, KV_USAGE)
    ax_kv.plot(times, values, marker=".")
    ax_kv.set_ylabel("KV cache usage (/metrics)")
    ax_kv.set_xlabel("seconds since start")
    if not result.metrics.times:
        note = result.metrics.note or "no /metrics polled"
        for ax in (ax_queue, ax_kv):
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, fontsize=8)
    for ax in (ax_tp, ax_queue, ax_kv):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"over time, {result.load.label}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(summaries: list[dict], path: pathlib.Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    throughput = [s["output_tok_per_s"] for s in summaries]
    for ax, metric in zip(axes, ("ttft_ms", "e2e_ms")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            points = [(x, s[metric][stat]) for x, s in zip(throughput, summaries) if s[metric][stat] is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=stat)
        for x, s in zip(throughput, summaries):
            if s[metric]["p50"] is not None:
                ax.annotate(s["load"], (x, s[metric]["p50"]), fontsize=7, textcoords="offset points",
                            xytext=(3, 3))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{metric[:-3].upper()} ms")
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.suptitle("latency vs throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
