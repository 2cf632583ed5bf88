"""Fixtures of the worker tests: tiny random models saved as HF folders (``helpers.tiny_models``), built
once per session."""

from __future__ import annotations

import pytest
from helpers.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """kind -> saved folder (built once per session)."""
    paths: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in paths:
            paths[kind] = save_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return paths[kind]

    return get
