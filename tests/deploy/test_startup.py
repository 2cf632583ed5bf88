"""`pagedray serve` start-up watch: a replica failure is found in Serve's status and named (no Ray)."""

import threading
from types import SimpleNamespace

import pytest
from pagedray.deploy.cli.startup import (
    GENERIC_HINT,
    StartupFailure,
    deploy_and_watch,
    exception_line,
    hint_for,
    replica_failure,
)

# shaped like Ray Serve 2.60's deployment message after a constructor failure (trimmed traceback)
SERVE_MESSAGE = """A replica failed to start with exception. Retrying 2 more time(s). Error:
ray::ServeReplica:pagedray:PagedEngine.initialize_and_get_metadata() (pid=9369, ip=192.0.2.2)
  File "/usr/lib/python3.11/site-packages/ray/serve/_private/replica.py", line 1928, in initialize
    raise RuntimeError(traceback.format_exc()) from None
RuntimeError: Traceback (most recent call last):
  File "/work/main/cluster/ray_executor.py", line 170, in _init_workers
    self.num_blocks = min(ray.get([a.available_kv_blocks.remote() for a in self.actors]))
ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task, \
ray::RayWorkerBody.__init__() (pid=9430, ip=192.0.2.2)
  File "/work/main/workers/weight_loader.py", line 41, in _weight_map
    raise WeightLoadError(f"model: no *.safetensors weight files in {folder}{hint}")
pagedray.workers.weights.weight_loader.WeightLoadError: model: no *.safetensors weight files in /tmp/badmodel
"""


def app_status(**deployments) -> SimpleNamespace:
    return SimpleNamespace(deployments={name: SimpleNamespace(status=status, message=message)
                                        for name, (status, message) in deployments.items()})


def test_exception_line_is_the_innermost_exception_without_its_module():
    assert exception_line(SERVE_MESSAGE) == "WeightLoadError: model: no *.safetensors weight files in /tmp/badmodel"
    assert exception_line("ImportError: Please install torch and gguf>=0.10.0") == \
        "ImportError: Please install torch and gguf>=0.10.0"
    assert exception_line("something odd\nwithout an exception line\n") == "without an exception line"
    assert exception_line("") == "unknown error (Serve gave no message)"


def test_hints_name_what_to_do():
    assert "pip install" in hint_for("ModuleNotFoundError: No module named 'gguf'")
    assert "--model" in hint_for("WeightLoadError: model: no weights")
    assert "--kv-cache-gib" in hint_for("OutOfMemoryError: CUDA out of memory")
    assert hint_for("ZeroDivisionError: division by zero") == GENERIC_HINT


def test_replica_failure_reads_the_failing_deployment_only():
    healthy = app_status(OpenAIIngress=("HEALTHY", ""), PagedEngine=("UPDATING", ""))
    assert replica_failure(healthy) is None
    assert replica_failure(None) is None
    failing = app_status(OpenAIIngress=("UPDATING", ""), PagedEngine=("UPDATING", SERVE_MESSAGE))
    failure = replica_failure(failing)
    assert failure == StartupFailure("PagedEngine", exception_line(SERVE_MESSAGE), hint_for("WeightLoadError"))
    assert "PagedEngine replica failed to start" in failure.report()
    given_up = app_status(PagedEngine=(SimpleNamespace(value="DEPLOY_FAILED"), "ValueError: max_model_len: 9"))
    assert replica_failure(given_up).exception == "ValueError: max_model_len: 9"


def test_watch_returns_the_first_failure_while_deploy_still_waits():
    release = threading.Event()
    polls = []

    def status():
        polls.append(1)
        return app_status(PagedEngine=("UPDATING", SERVE_MESSAGE if len(polls) >= 3 else ""))

    failure = deploy_and_watch(release.wait, status, poll_s=0.001)
    release.set()
    assert failure is not None and failure.deployment == "PagedEngine"
    assert len(polls) == 3


def test_watch_returns_none_when_deploy_finishes_and_reraises_other_errors():
    assert deploy_and_watch(lambda: None, lambda: app_status(PagedEngine=("HEALTHY", "")), poll_s=0.001) is None

    def broken():
        raise RuntimeError("port 8000 is taken")

    with pytest.raises(RuntimeError, match="port 8000"):
        deploy_and_watch(broken, lambda: None, poll_s=0.001)


@pytest.mark.filterwarnings("ignore:coroutine 'EngineDeployment.__del__' was never awaited")
def test_a_replica_whose_constructor_failed_deletes_quietly():
    import asyncio

    from pagedray.deploy.serve.engine_deployment import EngineDeployment

    cls = EngineDeployment.func_or_class
    half_built = cls.__new__(cls)          # what Serve holds when __init__ raised before the engine existed
    assert asyncio.run(half_built.__del__()) is None
