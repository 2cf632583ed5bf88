"""When this folder is imported as the top-level ``kernels``, hand the name to the installed ``kernels``.

The repository's layout is fixed (``kernels/`` at the root), and Hugging Face's ``kernels`` package has the
same import name: transformers >= 5.25 depends on it and imports it while loading any model config. Wherever
the checkout's root is on ``sys.path`` (pytest's ``pythonpath``, ``python -m benchmarks.X`` from the root,
Ray workers started from the root), ``import kernels`` would find this folder first, and transformers fails
with ``cannot import name ... from 'kernels'``.

``kernels/__init__.py`` calls ``hand_over_to_installed_kernels`` when its ``__name__`` is ``kernels`` (never
as ``pagedray.kernels``): it looks for ``kernels`` on ``sys.path`` without the checkout's root, and if it
finds one, puts it in ``sys.modules["kernels"]`` and runs it there; the import statement that started all
this then returns that module. If no ``kernels`` is installed, the shadowing module stays an empty
placeholder: it has no ``__version__``, so transformers' availability check (``is_kernels_available``)
reads it as absent, which it is. This module imports nothing of pagedray.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


def hand_over_to_installed_kernels(shadowing_init: str) -> types.ModuleType | None:
    """Load the installed ``kernels`` into ``sys.modules["kernels"]`` and return it; None if none is
    installed. ``shadowing_init`` is the ``__file__`` of the ``kernels/__init__.py`` that shadows it."""
    checkout_root = os.path.dirname(os.path.dirname(os.path.realpath(shadowing_init)))
    search_path = [entry for entry in sys.path
                   if os.path.realpath(entry or os.getcwd()) != checkout_root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", search_path)
    if spec is None or spec.loader is None:
        return None
    installed = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = installed          # its own `import kernels.x` now resolve inside it
    spec.loader.exec_module(installed)
    return installed
