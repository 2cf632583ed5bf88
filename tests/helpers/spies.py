"""Spies on module functions: the calls a dispatch made, without changing what the functions do."""

from __future__ import annotations

from collections.abc import Callable


def record_calls(monkeypatch, module, names, describe: Callable | None = None) -> list:
    """Wraps each of ``module``'s functions ``names`` so that every call appends ``describe(name, args)`` (default:
    the name) to the returned list, then runs the original."""
    calls: list = []
    for name in names:
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name if describe is None else describe(_name, args))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls
