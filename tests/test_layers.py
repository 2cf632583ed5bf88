"""The packages depend one way: deploy -> cluster -> workers -> kernels, block_manager beside them, and
the engine-worker contract (pagedray.workers.contract) imports nothing else of pagedray. Every import
statement counts, also those inside functions; relative imports are resolved."""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("deploy", "cluster", "workers", "kernels", "block_manager")
# what each package may import from pagedray (besides itself)
ALLOWED = {"deploy": {"cluster", "workers", "kernels", "block_manager"},
           "cluster": {"workers", "kernels", "block_manager"},
           "workers": {"kernels"},
           "kernels": set(),
           "block_manager": set()}
CONTRACT = ("workers", "contract")


def module_parts(path: pathlib.Path) -> list[str]:
    """pagedray module path of a source file, as parts below ``pagedray`` (``__init__`` dropped)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def file_imports(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    package = module_parts(path) if path.name == "__init__.py" else module_parts(path)[:-1]
    return pagedray_imports(path.read_text(), package)


def pagedray_imports(source: str, package: list[str]) -> list[tuple[int, list[str]]]:
    """(line, module parts below ``pagedray``) of every import of a pagedray module in ``source``, a
    module of ``pagedray.<package>``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                names = [".".join(["pagedray", *base, *(node.module.split(".") if node.module else [])])]
            else:
                names = [node.module or ""]
        else:
            continue
        found += [(node.lineno, name.split(".")[1:]) for name in names if name.split(".")[0] == "pagedray"]
    return found


def sources(package: str) -> list[pathlib.Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_the_layers(package):
    wrong = [f"{path.relative_to(REPO)}:{line} imports pagedray.{'.'.join(target)}"
             for path in sources(package) for line, target in file_imports(path)
             if target and target[0] != package and target[0] not in ALLOWED[package]]
    assert wrong == []


def test_the_contract_imports_nothing_else_of_pagedray():
    wrong = [f"{path.relative_to(REPO)}:{line} imports pagedray.{'.'.join(target)}"
             for path in (REPO / "workers" / "contract").rglob("*.py") for line, target in file_imports(path)
             if tuple(target[:2]) != CONTRACT]
    assert wrong == []


def test_the_check_sees_relative_and_function_level_imports():
    source = "import os\nfrom . import sampler\n\ndef f():\n    from ..cluster.engine import Engine\n"
    assert pagedray_imports(source, ["workers"]) == [(2, ["workers"]), (5, ["cluster", "engine"])]
    assert pagedray_imports("from ...kernels import api\n", ["workers", "layers"]) == [(1, ["kernels"])]
    assert pagedray_imports("import pagedray.deploy.app\n", ["cluster"]) == [(1, ["deploy", "app"])]
