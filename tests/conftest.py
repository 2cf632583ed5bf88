"""Shared test fixtures.

- Triton kernels run under the interpreter when there is no CUDA device (set before triton loads).
- ``ray_session``: one local Ray instance for the whole test session (Ray takes seconds to start).
- ``default_model_path``: the embedded SmolLM2-135M-Instruct, fetched and converted once;
  ``tokenizer``: its tokenizer. ``tiny_llama_path``: a tiny random Llama folder (fast breadth), and
  ``tiny_hf_model`` transformers' model of it (the oracle: ``helpers.hf_oracle.hf_greedy``; EOS is
  ``helpers.tiny_models.TINY_LLAMA_EOS``).
- Shared helpers (the HF oracle, tiny models, fakes, ports) are modules of ``tests/helpers/``.
- Tests marked ``gpu`` are skipped without CUDA.
- CPU linear products: forced to the C GEMM (``PAGEDRAY_CPU_GEMM=c``, inherited by Ray workers and server
  processes) where it runs in float32 and bfloat16, so that a test's products never depend on what timing
  chose on a busy machine; the tests of the timed choice (tests/workers/test_gemm_timing.py) clear it.
  Likewise the C kernels' torch twins (``PAGEDRAY_CPU_TWINS=c``: the C kernel, and decode rows for
  prefill chunks up to ``reference.ROW_CHUNK_MAX``); tests/kernels/test_cpu_twins.py sets its own.
- The CPU kernel choices are kept on disk however loaded the machine is (``cpu_choice.BUSY_WAIT_PER_S`` and
  ``BUSY_LOAD_PER_CPU`` are infinite here; tests/kernels/test_cpu_choice.py sets them to check the rules), so
  that the tests of the cache do not depend on what else the machine runs.
- Benchmarks' dry runs never wait for a quiet machine: ``benchmarks.rounds.SETTLE_MAX_S`` is 0 here (a test
  suite on 2 cores keeps the load above the settle threshold, and each run would wait up to 120 s for nothing).
- Tiers: a module that starts Ray, Serve or another process says ``pytestmark =
  pytest.mark.integration``; any test that asks for ``ray_session`` gets the marker too. ``python3 -m
  pytest -m "not integration"`` is the fast tier, the plain command (what CI runs) runs everything
  but the ``slow`` tests, which run only when the ``-m`` expression names them (``-m slow``).
"""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from pagedray.deploy.cli.ray_env import LOCAL_RAY_ENV  # noqa: E402
from pagedray.kernels.cpu import cpu_choice, cpu_gemm, cpu_twins  # noqa: E402

from benchmarks import rounds  # noqa: E402

if cpu_gemm.available(torch.float32) and cpu_gemm.available(torch.bfloat16):
    os.environ.setdefault(cpu_choice.PRODUCT_ENV, "c")
os.environ.setdefault(cpu_twins.TWINS_ENV, "c")

# every Ray this session starts (the shared one, the e2e clusters, subprocesses) gets the CLI's
# environment: Serve's proxy checks that survive a loaded machine, workers at normal priority
for _name, _value in LOCAL_RAY_ENV.items():
    os.environ.setdefault(_name, _value)

rounds.SETTLE_MAX_S = 0.0
cpu_choice.BUSY_LOAD_PER_CPU = math.inf
cpu_choice.BUSY_WAIT_PER_S = math.inf

RAY_NUM_CPUS = 8


@pytest.hookimpl(tryfirst=True)   # before -m selects, so that it sees the markers added here
def pytest_collection_modifyitems(config, items):
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) and "integration" not in item.keywords:
            item.add_marker(pytest.mark.integration)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
    if "slow" not in (config.getoption("markexpr") or ""):   # slow tests only when -m names them
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def default_model_path():
    from pagedray.workers.weights.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    from helpers.tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """kind -> a tiny random model saved as an HF folder (``helpers.tiny_models``), built once per session."""
    from helpers.tiny_models import save_tiny_model

    paths: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in paths:
            paths[kind] = save_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return paths[kind]

    return get


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_path):
    from helpers.hf_oracle import load_hf_model

    return load_hf_model(tiny_llama_path)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    """Runs the test with 1 and with 2 torch threads (the CPU kernels split their work by thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
