"""``pagedray loadtest`` / ``python -m pagedray.deploy.loadtest``: load-test an LLM serving endpoint.

Targets any OpenAI-compatible HTTP server (``--url``) or our Serve app through a DeploymentHandle
(``--handle APP``). Load is open loop (``--rate``, Poisson arrivals), closed loop (``--concurrency``) or a
sweep over open-loop rates (``--sweep 0.5,1,2``), bounded by ``--num-requests`` and ``--duration``.
Prints a summary table, writes JSON (``--out``) and PNG plots next to it. ``--check`` compares every
greedy response with a reference (a sequential run first, or ``--reference FILE``) and fails the requests
whose text differs: tokens lost, duplicated or corrupted under load.

Without ``--model``, an HTTP target is asked for its model (the first of ``GET /v1/models``: a server
started with ``--model PATH`` answers to that folder's name, not to "default"); a handle target gets
"default".

Exit status: 0 when the run finished, 1 when ``--check`` found a mismatch, no request completed (every
one failed) or, without ``--model``, the server listed no model; 2 for bad arguments (argparse's
convention; the message names the argument).

Package map (pagedray.deploy.loadtest): prompts (inputs), record (per-request measurements and stream
parsing), client (targets), runner (open / closed loop), metrics (/metrics polling), stats (summary and
table), check (--check), plots (PNGs); main (this module: configuration, run, command line).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys
from dataclasses import dataclass, field

from pagedray.deploy.loadtest.check import (
    check_records,
    load_reference,
    reference_from_records,
    save_reference,
)
from pagedray.deploy.loadtest.client import (
    HandleTarget,
    HttpTarget,
    RequestOptions,
    parse_extra_body,
    served_model,
)
from pagedray.deploy.loadtest.prompts import (
    PromptSpec,
    load_prompts_file,
    parse_length_range,
    synthetic_prompts,
)
from pagedray.deploy.loadtest.runner import LoadSpec, RunResult, run_load
from pagedray.deploy.loadtest.stats import format_table, summarize

DEFAULT_MODEL = "default"   # the model name sent to a handle target when --model is not given


@dataclass
class LoadtestConfig:
    """Everything one invocation does. ``url`` xor ``handle_app`` names the target."""

    options: RequestOptions
    prompts: list[PromptSpec]
    loads: list[LoadSpec]
    url: str | None = None
    api_key: str | None = None
    handle_app: str | None = None
    check: bool = False
    reference_path: str | None = None
    save_reference_path: str | None = None
    metrics_url: str | None = None
    metrics_interval_s: float = 1.0
    progress: bool = True


@dataclass
class LoadtestReport:
    runs: list[RunResult]
    summaries: list[dict]
    checks: list[dict | None] = field(default_factory=list)

    @property
    def mismatches(self) -> int:
        return sum(check["mismatched"] for check in self.checks if check)


def make_target(config: LoadtestConfig, handle=None):
    if config.url is not None:
        return HttpTarget(config.url, config.options, config.api_key)
    return HandleTarget(config.handle_app, config.options, handle=handle)


async def _reference_run(target, config: LoadtestConfig) -> dict:
    """A sequential run over the distinct prompts the load will send."""
    distinct = min(max(load.num_requests for load in config.loads), len(config.prompts))
    result = await run_load(target, config.prompts[:distinct], LoadSpec(num_requests=distinct, concurrency=1),
                            progress=config.progress)
    return reference_from_records(config.prompts, result.records)


async def run_loadtest(config: LoadtestConfig, handle=None) -> LoadtestReport:
    """Run every load of ``config`` against its target (``handle`` overrides the Serve lookup)."""
    report = LoadtestReport(runs=[], summaries=[])
    async with make_target(config, handle) as target:
        reference = None
        if config.check:
            if config.reference_path:
                reference = load_reference(config.reference_path)
            else:
                reference = await _reference_run(target, config)
            if config.save_reference_path:
                save_reference(config.save_reference_path, reference)
        metrics_url = config.metrics_url
        if metrics_url is None and isinstance(target, HttpTarget):
            metrics_url = target.metrics_url
        for load in config.loads:
            result = await run_load(target, config.prompts, load, metrics_url or None,
                                    config.metrics_interval_s, config.progress)
            check = check_records(config.prompts, result.records, reference) if reference is not None else None
            report.runs.append(result)
            report.checks.append(check)
            report.summaries.append(summarize(result))  # after the check: mismatches count as failures
    return report


def request_rows(result: RunResult) -> list[dict]:
    return [{"index": r.index, "prompt_index": r.prompt_index, "send_s": r.send_s, "ttft_s": r.ttft,
             "tpot_s": r.tpot, "e2e_s": r.e2e, "output_tokens": r.output_tokens,
             "prompt_tokens": r.usage_prompt_tokens, "finish_reason": r.finish_reason,
             "error": r.error, "error_detail": r.error_detail or None} for r in result.records]


def report_json(report: LoadtestReport, config: LoadtestConfig, plots: list[str]) -> dict:
    return {
        "target": config.url or f"handle:{config.handle_app}",
        "model": config.options.model,
        "endpoint": config.options.endpoint,
        "num_prompts": len(config.prompts),
        "runs": [{"summary": summary, "check": check, "metrics": run.metrics.to_json(),
                  "requests": request_rows(run)}
                 for run, summary, check in zip(report.runs, report.summaries, report.checks)],
        "plots": plots,
    }


def write_plots(report: LoadtestReport, folder: pathlib.Path, stem: str) -> list[str]:
    from pagedray.deploy.loadtest.plots import plot_latency_cdfs, plot_sweep, plot_timeline

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in report.runs:
        tag = stem if len(report.runs) == 1 else f"{stem}_{run.load.label.replace('=', '').replace('/', '')}"
        paths += [folder / f"{tag}_latency_cdf.png", folder / f"{tag}_timeline.png"]
        plot_latency_cdfs(run, paths[-2])
        plot_timeline(run, paths[-1])
    if len(report.runs) > 1:
        paths.append(folder / f"{stem}_sweep.png")
        plot_sweep(report.summaries, paths[-1])
    return [str(p) for p in paths]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedray loadtest", description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    target.add_argument("--handle", metavar="APP", help="Serve application name (DeploymentHandle target)")
    p.add_argument("--model", default=None, help="model name sent in every request (default: the first of "
                   "the server's /v1/models; 'default' for --handle)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second (inf: all at once)")
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    load.add_argument("--sweep", metavar="RATES", help="open loop at each rate, e.g. 0.5,1,2")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run (upper bound)")
    p.add_argument("--duration", type=float, default=None, help="seconds after which no request starts")
    p.add_argument("--input-len", default="8:120", help="synthetic prompt length in words, N or MIN:MAX")
    p.add_argument("--output-len", default="64", help="max_tokens per request, N or MIN:MAX")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times")
    p.add_argument("--prompts-file", default=None, help='JSONL of {"prompt": ..., "max_tokens": ...}')
    p.add_argument("--temperature", type=float, default=None, help="sent when given (--check forces 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request, stream included")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--check", action="store_true", help="compare greedy outputs with a reference run")
    p.add_argument("--reference", default=None, help="JSON file of expected outputs for --check")
    p.add_argument("--save-reference", default=None, help="write the --check reference to this JSON file")
    p.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default: URL/metrics)")
    p.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics polls")
    p.add_argument("--no-metrics", action="store_true", help="do not poll /metrics")
    p.add_argument("--out", default=None, help="write the JSON report here (plots go beside it)")
    p.add_argument("--plots-dir", default=None, help="folder for PNG plots (default: beside --out)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"sweep: expected comma-separated rates, got {text!r}") from None
    if not rates or any(not (r > 0) for r in rates):
        raise ValueError(f"sweep: rates must be > 0, got {text!r}")
    return rates


def config_from_args(args: argparse.Namespace) -> LoadtestConfig:
    """Validated config; ValueError naming the bad option."""
    output_len = parse_length_range(args.output_len, "output_len")
    if args.prompts_file:
        prompts = load_prompts_file(args.prompts_file, default_max_tokens=output_len.high)
    else:
        prompts = synthetic_prompts(args.num_requests, parse_length_range(args.input_len, "input_len"),
                                    output_len, args.seed)
    if args.check and args.temperature not in (None, 0.0):
        raise ValueError(f"temperature: --check needs greedy decoding (0), got {args.temperature}")
    if args.reference and not args.check:
        raise ValueError("reference: only meaningful with --check")
    if not args.metrics_interval > 0:
        raise ValueError(f"metrics_interval: must be > 0, got {args.metrics_interval}")
    options = RequestOptions(model=args.model or DEFAULT_MODEL, endpoint=args.endpoint,
                             temperature=0.0 if args.check else args.temperature,
                             timeout_s=args.timeout, extra_body=parse_extra_body(args.extra_body))
    common = {"num_requests": args.num_requests, "duration_s": args.duration, "seed": args.seed}
    if args.sweep:
        loads = [LoadSpec(rate=rate, **common) for rate in _parse_rates(args.sweep)]
    elif args.rate is not None:
        loads = [LoadSpec(rate=args.rate, **common)]
    else:
        loads = [LoadSpec(concurrency=args.concurrency, **common)]
    return LoadtestConfig(
        options=options, prompts=prompts, loads=loads, url=args.url, api_key=args.api_key,
        handle_app=args.handle, check=args.check, reference_path=args.reference,
        save_reference_path=args.save_reference, metrics_url="" if args.no_metrics else args.metrics_url,
        metrics_interval_s=args.metrics_interval, progress=not args.no_progress)


def ask_served_model(config: LoadtestConfig) -> None:
    """Every request of an HTTP run without ``--model`` names the server's model (``served_model``)."""
    model = served_model(config.url, config.api_key, min(config.options.timeout_s, 60.0))
    config.options = dataclasses.replace(config.options, model=model)
    print(f"model: {model} (from {config.url.rstrip('/')}/v1/models)")


def write_outputs(report: LoadtestReport, config: LoadtestConfig, args: argparse.Namespace) -> None:
    plots: list[str] = []
    if not args.no_plots and (args.out or args.plots_dir):
        folder = pathlib.Path(args.plots_dir) if args.plots_dir else pathlib.Path(args.out).parent
        stem = pathlib.Path(args.out).stem if args.out else "loadtest"
        plots = write_plots(report, folder, stem)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report_json(report, config, plots), indent=1, allow_nan=False) + "\n")
    for path in plots:
        print(f"plot: {path}")
    if args.out:
        print(f"json: {args.out}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    if args.model is None and config.url is not None:
        try:
            ask_served_model(config)
        except LookupError as err:
            print(f"pagedray loadtest: {err}", file=sys.stderr)
            return 1
    report = asyncio.run(run_loadtest(config))
    print(format_table(report.summaries))
    for check in report.checks:
        if check is not None:
            print(f"check: {check['checked']} checked, {check['mismatched']} mismatched, "
                  f"{check['unchecked']} unchecked")
            for example in check["examples"]:
                print(f"  request {example['index']}: {example['cause']} {example['detail']}")
    write_outputs(report, config, args)
    return 1 if report.mismatches or all(s["completed"] == 0 for s in report.summaries) else 0


