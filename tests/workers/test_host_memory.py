"""host_memory.keep_freed_memory: the mallopt calls it makes, what it reports, that a CPU Worker applies
it unless the option is off, and (in a fresh process with glibc) that freed memory is then reused
instead of coming back as fresh, page-faulting pages."""

import subprocess
import sys
import textwrap

import pytest
from helpers.worker_setup import engine_config
from pagedray.workers import host_memory
from pagedray.workers.contract.config import ModelConfig

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)


def test_sets_the_mmap_and_trim_thresholds():
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 1

    assert host_memory.keep_freed_memory(mallopt) is True
    assert calls == [(host_memory.M_MMAP_THRESHOLD, 32 << 20), (host_memory.M_TRIM_THRESHOLD, 1 << 30)]


def test_reports_a_refused_setting_and_a_missing_mallopt(monkeypatch):
    assert host_memory.keep_freed_memory(lambda param, value: 0) is False
    monkeypatch.setattr(host_memory, "_glibc_mallopt", lambda: None)
    assert host_memory.keep_freed_memory() is False


def test_option_is_validated():
    with pytest.raises(ValueError, match="cpu_keep_freed_memory"):
        ModelConfig(cpu_keep_freed_memory="yes").validate()


@pytest.mark.parametrize("keep", [True, False])
def test_cpu_worker_applies_it_unless_the_option_is_off(monkeypatch, tiny_model_path, keep):
    from pagedray.workers import worker as worker_module

    calls = []
    monkeypatch.setattr(worker_module, "keep_freed_memory", lambda: calls.append(True) or True)
    worker = worker_module.Worker(engine_config(tiny_model_path("llama"), cpu_keep_freed_memory=keep,
                                                cpu_packed_weights=False))
    worker.shutdown()
    assert calls == ([True] if keep else [])


# A 16 MiB block malloc'ed, written and freed three times, minor page faults counted per round. With
# glibc's defaults the first block is mmap'ed and unmapped on free, which raises the mmap threshold, so
# the second comes from a newly grown heap: both rounds fault in every page. With the settings the heap
# keeps the first block and the second round reuses it.
_FAULTS_SCRIPT = textwrap.dedent("""
    import ctypes, ctypes.util, json, resource, sys
    from pagedray.workers.host_memory import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 16 << 20, []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults))
""")


def _faults_per_round(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True,
                         check=True)
    return [int(n) for n in out.stdout.strip().strip("[]").split(",")]


@pytest.mark.skipif(host_memory._glibc_mallopt() is None or not sys.platform.startswith("linux"),
                    reason="needs glibc's malloc")
def test_freed_memory_is_reused_without_page_faults():
    pages = (16 << 20) // 4096
    default = _faults_per_round("default")
    kept = _faults_per_round("keep")
    assert default[1] > pages // 2, f"glibc's defaults were expected to fault the second block in: {default}"
    assert kept[0] > pages // 2, f"the first block must fault in with any setting: {kept}"
    assert kept[1] < pages // 10 and kept[2] < pages // 10, f"freed memory was not reused: {kept}"
