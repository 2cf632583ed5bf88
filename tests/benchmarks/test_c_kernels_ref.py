"""``benchmarks.c_kernels_ref``'s plumbing (no timing that matters): a git commit's C sources are found in
either layout, built and loaded beside this checkout's, the wrappers call whichever library a system
names, and a dry run reports every case for both systems with a ratio."""

from __future__ import annotations

import shutil

import pytest
import torch
from pagedray.kernels.cpu import cpu_build, cpu_fused, cpu_gemm

from benchmarks import c_kernels_ref
from benchmarks.common import REPO, ref_import_root

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("git") is None
                                or not (REPO / ".git").exists(), reason="needs a C compiler and a git checkout")


def test_sources_are_found_under_kernels_cpu_or_the_flat_kernels_folder(tmp_path):
    (tmp_path / "kernels" / "cpu").mkdir(parents=True)
    (tmp_path / "kernels" / "cpu" / "cpu_gemm.c").write_text("")
    (tmp_path / "kernels" / "cpu_fused.c").write_text("")           # before #62's rooms
    assert c_kernels_ref.c_source(tmp_path, "cpu_gemm") == tmp_path / "kernels" / "cpu" / "cpu_gemm.c"
    assert c_kernels_ref.c_source(tmp_path, "cpu_fused") == tmp_path / "kernels" / "cpu_fused.c"
    with pytest.raises(FileNotFoundError, match="cpu_decode.c"):
        c_kernels_ref.c_source(tmp_path, "cpu_decode")


def test_the_wrappers_call_the_library_a_system_names(monkeypatch):
    for module in c_kernels_ref.MODULES.values():                        # restored after the test
        monkeypatch.setattr(module, "_library", module._library)
    with ref_import_root("HEAD") as root:
        this, ref = c_kernels_ref.load_libraries(REPO), c_kernels_ref.load_libraries(root / "pagedray")
    calls = []

    class Spy:                                                           # records which library ran
        def __init__(self, library, name):
            self.library, self.name = library, name

        def __getattr__(self, attr):
            calls.append(self.name)
            return getattr(self.library, attr)

    gate_up = torch.randn(3, 32)
    outputs = {}
    for name, libraries in (("this", this), ("HEAD", ref)):
        c_kernels_ref.use({**libraries, "cpu_fused": Spy(libraries["cpu_fused"], name)})
        outputs[name] = cpu_fused.silu_and_mul_cpu(gate_up)
    assert calls == ["this", "HEAD"]
    assert torch.equal(outputs["this"], outputs["HEAD"])                # HEAD's sources are this checkout's


def test_a_dry_run_reports_every_case_for_both_systems_and_their_ratio(monkeypatch, tmp_path):
    loaders = {name: module._library for name, module in c_kernels_ref.MODULES.items()}
    report = c_kernels_ref.main(["--dry-run", "--ref", "HEAD", "--out", str(tmp_path / "out.json")])
    with ref_import_root("HEAD") as root:
        both = c_kernels_ref.gemm_dtypes([c_kernels_ref.load_libraries(REPO),
                                          c_kernels_ref.load_libraries(root / "pagedray")])
    cases = c_kernels_ref.build_cases(dry_run=True, gemm=both)
    assert any(name.startswith("decode") for name in cases) and any(name.startswith("silu") for name in cases)
    ratio = report["summary"]["ratios"]["this / HEAD"]
    assert set(ratio) == set(cases) and all(value["median"] > 0 for value in ratio.values())
    assert (tmp_path / "out.json").is_file()
    assert {name: module._library for name, module in c_kernels_ref.MODULES.items()} == loaders   # put back


@pytest.mark.skipif(not cpu_gemm.available(torch.float32), reason="the C GEMM is not built here")
def test_gemm_cases_only_in_the_dtypes_every_systems_library_runs():
    """A REF whose source builds no GEMM for this CPU in some dtype (float32 needed AVX-512 before 2026-12-02)
    times no GEMM case in that dtype; the other cases stay."""
    class Library:
        def __init__(self, *dtypes):
            self.codes = {cpu_build.DTYPE_CODES[d] for d in dtypes}

        def gemm_supported(self, code):
            return int(code in self.codes)
    both, f32 = Library(torch.bfloat16, torch.float32), Library(torch.float32)
    assert c_kernels_ref.gemm_dtypes([{"cpu_gemm": both}, {"cpu_gemm": f32}]) == (torch.float32,)
    assert c_kernels_ref.gemm_dtypes([{"cpu_gemm": both}, {"cpu_gemm": Library()}]) == ()
    names = c_kernels_ref.build_cases(dry_run=True, gemm=(torch.float32,))
    assert any(n.startswith("gemm f32") for n in names) and not any(n.startswith("gemm bf16") for n in names)
    assert any(n.startswith("silu bf16") for n in names)
    assert not any(n.startswith("gemm") for n in c_kernels_ref.build_cases(dry_run=True, gemm=()))
