"""Shared test fixtures.

- Triton kernels run under the interpreter when there is no CUDA device (set before triton loads).
- ``ray_session``: one local Ray instance for the whole test session (Ray takes seconds to start).
- ``default_model_path``: the embedded SmolLM2-135M-Instruct, fetched and converted once.
- Tests marked ``gpu`` are skipped without CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from pagedray.deploy.cli import LOCAL_RAY_ENV  # noqa: E402

# every Ray this session starts (the shared one, the e2e clusters, subprocesses) gets the CLI's
# environment: Serve's proxy checks that survive a loaded machine, workers at normal priority
for _name, _value in LOCAL_RAY_ENV.items():
    os.environ.setdefault(_name, _value)

RAY_NUM_CPUS = 8


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
    from pagedray.workers.default_model import ensure_default_model

    return str(ensure_default_model())
