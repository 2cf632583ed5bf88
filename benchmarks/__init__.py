"""Benchmark scripts: each prints a table and writes JSON to ``benchmarks/results/<name>.json``.

Run them from a checkout as ``python -m benchmarks.<name>`` or ``python benchmarks/<name>.py`` (``offline``,
``serving``, ...; each script puts the repo root first on ``sys.path`` when run by path, so its absolute
``benchmarks.*`` imports work both ways). This folder is tooling, not part of the installed ``pagedray``
package: the runtime never imports it. Comparisons follow DESIGN.md's performance method through
``benchmarks.rounds`` (peer at its defaults, systems interleaved over >= 3 rounds in alternating order,
median and min-max over clean rounds, per-round ratios against the peer's best variant, load average
recorded, noisy rounds marked); ``benchmarks.common`` holds the shared workload, flag and output helpers.
"""
