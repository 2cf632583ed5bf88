"""The packages depend one way: deploy -> cluster -> workers -> kernels, block_manager beside them, and
the engine-worker contract (pagedray.workers.contract) imports nothing else of pagedray. Every import
statement counts, also those inside functions; relative imports are resolved."""

import ast
import pathlib
import subprocess
import sys

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


# pagedray.deploy's rooms and what each may import of the others (deploy/__init__.py): the protocol at the
# bottom, the command that starts Ray at the top; the modules directly in deploy/ are the public import
# paths that Serve YAML names, each re-exporting one room's object
DEPLOY_ROOMS = {"openai": set(), "bridges": {"openai"}, "routing": set(), "http": {"openai", "bridges"},
                "serve": {"openai", "bridges", "http", "routing"},
                "cli": {"openai", "bridges", "http", "routing", "serve", "loadtest"}, "loadtest": set()}
PUBLIC_PATHS = {"app": {"serve"}, "autoscaling": {"routing"}, "__init__": set()}


def deploy_room(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO / "deploy").parts
    return parts[0] if len(parts) > 1 else path.stem


def test_deploy_rooms_import_only_the_rooms_below_them():
    assert {p.name for p in (REPO / "deploy").iterdir() if p.is_dir() and (p / "__init__.py").exists()} == \
        set(DEPLOY_ROOMS)
    wrong = []
    for path in sources("deploy"):
        room = deploy_room(path)
        allowed = DEPLOY_ROOMS.get(room, PUBLIC_PATHS.get(room))
        assert allowed is not None, f"{path.relative_to(REPO)} is in no room of deploy/"
        wrong += [f"{path.relative_to(REPO)}:{line} ({room}) imports pagedray.{'.'.join(target)}"
                  for line, target in file_imports(path)
                  if target[:1] == ["deploy"] and len(target) > 1 and target[1] != room and target[1] not in allowed]
    assert wrong == []


# pagedray.workers' rooms (workers/__init__.py): the contract at the bottom, then the rank's foundations
# (kv_cache, its blocks as bytes kv_blocks, its second tier kv_tier over files or kv_host_tier in host memory, tp_group,
# host_memory), weights, layers, models,
# lora, sampling and runner; worker, ray_worker and step_channel, the rank itself, stand on top and may import any
# of them
WORKER_ROOMS = {"contract": set(), "kv_cache": set(), "tp_group": set(), "host_memory": set(),
                "kv_blocks": {"kv_cache", "layers"}, "kv_host_tier": {"kv_cache", "kv_blocks"},
                "kv_tier": {"kv_cache", "kv_blocks", "kv_host_tier"},
                "weights": {"contract"}, "sampling": {"contract"},
                "layers": {"weights", "kv_cache", "tp_group"},
                "models": {"contract", "weights", "layers", "kv_cache", "tp_group"},
                "lora": {"contract", "layers", "models"},
                "runner": {"contract", "weights", "layers", "models", "sampling", "kv_cache", "tp_group"}}
RANK = ("worker", "ray_worker", "step_channel", "__init__")


def room_violations(package: str, rooms: dict[str, set[str]], exempt: tuple[str, ...]) -> list[str]:
    """Imports of ``pagedray.<package>.<room>`` by a room (a sub-folder, or a module directly in the folder) that
    ``rooms`` does not allow it; the rooms in ``exempt`` may import any. A file in no room fails at once."""
    wrong = []
    for path in sources(package):
        parts = path.relative_to(REPO / package).parts
        room = parts[0] if len(parts) > 1 else path.stem
        if room in exempt:
            continue
        assert room in rooms, f"{path.relative_to(REPO)} is in no room of {package}/"
        wrong += [f"{path.relative_to(REPO)}:{line} ({room}) imports pagedray.{'.'.join(target)}"
                  for line, target in file_imports(path)
                  if target[:1] == [package] and len(target) > 1 and target[1] != room and target[1] not in rooms[room]]
    return wrong


def test_worker_rooms_import_only_the_rooms_below_them():
    assert room_violations("workers", WORKER_ROOMS, RANK) == []


# pagedray.kernels' rooms (kernels/__init__.py): the public surface at the top (api, fused_ops, quant_gemm,
# seeded_uniform, and the package itself) may import every room; the rooms stand on the foundations
# (validation, kv_quant) and the torch references, never on the surface or on each other otherwise
KERNEL_ROOMS = {"kv_quant": set(), "shadowed_name": set(), "validation": {"kv_quant"}, "reference": {"kv_quant"},
                "cpu": {"kv_quant", "validation", "reference"}, "triton": {"kv_quant", "validation"}}
KERNEL_SURFACE = ("api", "fused_ops", "quant_gemm", "seeded_uniform", "gated_delta", "__init__")


def test_kernel_rooms_import_only_the_foundations():
    assert room_violations("kernels", KERNEL_ROOMS, KERNEL_SURFACE) == []


def test_the_room_check_catches_an_import_the_rooms_forbid(monkeypatch):
    monkeypatch.setitem(WORKER_ROOMS, "sampling", set())          # sampling imports the contract
    assert any("(sampling) imports pagedray.workers.contract" in v
               for v in room_violations("workers", WORKER_ROOMS, RANK))


def ray_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every import of Ray and every ``ray.init(...)`` call in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, "import " + a.name) for a in node.names if a.name.split(".")[0] == "ray"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "ray":
            found.append((node.lineno, "from " + node.module))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "init"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"):
            found.append((node.lineno, "ray.init()"))
    return found


def test_openai_imports_no_ray_and_only_cli_starts_ray():
    in_openai = [f"{p.relative_to(REPO)}:{line} {what}" for p in [*sources("deploy/openai"), *sources("deploy/bridges")]
                 for line, what in ray_uses(p.read_text())]
    assert in_openai == []
    starts = [f"{p.relative_to(REPO)}:{line}" for p in sources("deploy") for line, what in ray_uses(p.read_text())
              if what == "ray.init()" and deploy_room(p) != "cli"]
    assert starts == []
    assert any(what == "ray.init()" for p in sources("deploy/cli") for _, what in ray_uses(p.read_text()))


def test_the_room_checks_see_ray_and_cross_room_imports():
    assert ray_uses("import ray.serve\nfrom ray import serve\nfrom .ray import x\nray.init(address='auto')\n") == \
        [(1, "import ray.serve"), (2, "from ray"), (4, "ray.init()")]
    assert pagedray_imports("from ..serve.options import OPTIONS\n", ["deploy", "http"]) == \
        [(1, ["deploy", "serve", "options"])]


# the GPU image (docs/gpu.md, benchmarks/gpu_check.sh) has torch, triton and transformers but no Ray and no
# HTTP stack: its -m gpu tests must collect there
GPU_IMAGE_LACKS = ("ray", "uvicorn", "fastapi", "starlette", "httpx")


def test_the_gpu_tests_collect_without_ray_or_the_http_stack():
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in GPU_IMAGE_LACKS)
    script = (f"import sys; {blocked}; import pytest; "
              "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', '-m', 'gpu', "
              "'tests/kernels', 'tests/workers/test_worker_gpu.py']))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " tests collected" in done.stdout or "selected" in done.stdout, done.stdout[-2000:]
