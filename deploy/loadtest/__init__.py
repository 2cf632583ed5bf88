"""The cluster load tester: ``pagedray loadtest`` / ``python -m pagedray.deploy.loadtest`` (see ``main``)."""

from .main import LoadtestConfig, LoadtestReport, build_parser, config_from_args, main, run_loadtest

__all__ = ["LoadtestConfig", "LoadtestReport", "build_parser", "config_from_args", "main", "run_loadtest"]
