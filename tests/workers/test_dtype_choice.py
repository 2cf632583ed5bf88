"""dtype "auto": bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, float32 elsewhere; explicit dtypes as given."""

import pytest
import torch
from pagedray.workers.weights.dtype_choice import cpu_flags, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme avx2 avx512f avx512_bf16 sse4_2
processor\t: 1
flags\t\t: fpu
"""


def test_cpu_flags_reads_the_first_flags_line():
    assert cpu_flags(CPUINFO) == frozenset({"fpu", "vme", "avx2", "avx512f", "avx512_bf16", "sse4_2"})
    assert cpu_flags("processor : 0\n") == frozenset()


@pytest.mark.parametrize("flags,expected,named", [
    ({"avx512f", "avx512_bf16"}, torch.bfloat16, "avx512_bf16"),
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, torch.bfloat16, "amx_bf16 and avx512_bf16"),
    ({"avx2", "avx512f"}, torch.float32, "neither AMX nor AVX512-BF16"),
    (set(), torch.float32, "neither AMX nor AVX512-BF16"),
])
def test_auto_on_cpu_follows_the_bf16_fast_path(flags, expected, named):
    choice = resolve_dtype("auto", CPU, frozenset(flags))
    assert choice.dtype == expected and named in choice.reason
    assert choice.name == str(expected).removeprefix("torch.")


def test_auto_on_cuda_and_explicit_dtypes():
    assert resolve_dtype("auto", CUDA, frozenset()).dtype == torch.bfloat16
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        choice = resolve_dtype(name, CPU, frozenset({"amx_bf16"}))
        assert choice.dtype == dtype and "as configured" in choice.reason


def test_auto_on_this_machine_matches_its_flags(tiny_model_path):
    """The worker resolves auto with this CPU's flags, and the executor reports it (so /v1/models can)."""
    from pagedray.cluster import LLM

    fast = {"amx_bf16", "avx512_bf16"} & cpu_flags()
    llm = LLM(tiny_model_path("llama"), num_blocks=16, block_size=8, threads_per_worker=1)
    try:
        assert llm.engine.dtype == ("bfloat16" if fast else "float32")
        assert llm.engine.executor.worker.dtype == (torch.bfloat16 if fast else torch.float32)
    finally:
        llm.shutdown()
