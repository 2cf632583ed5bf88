"""``pagedray.deploy.app:build_app``: the import path that Serve YAML files name (``serve deploy``,
``serve run``); the application is built in ``serve/app.py``."""

from .serve.app import build_app

__all__ = ["build_app"]
