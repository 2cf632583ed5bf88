"""The checkout's ``kernels/`` folder, imported as the top-level ``kernels`` (the root on ``sys.path``), hands
the name to an installed ``kernels`` (Hugging Face's, which transformers >= 5.25 imports) and otherwise stays
an empty placeholder without a version. Each case runs in a fresh interpreter whose ``sys.path`` is set by
hand: the checkout's root first, then (or not) a folder holding a stand-in for the installed package."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# prints what `import kernels` gave, with site-packages (where a real `kernels` may be installed) removed
PROBE = textwrap.dedent("""
    import json, sys
    sys.path[:] = [p for p in sys.path if 'site-packages' not in p and p not in ('', '.')]
    sys.path[:0] = json.loads(sys.argv[1])
    import kernels
    print(json.dumps({"file": kernels.__file__, "version": getattr(kernels, "__version__", None),
                      "part": getattr(kernels, "PART", None), "has_pagedray_api": hasattr(kernels, "paged_decode"),
                      "kernels_modules": sorted(m for m in sys.modules if m.split(".")[0] == "kernels")}))
""")


def import_kernels(path_entries: list[str], cwd: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(path_entries)], cwd=cwd,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def installed_stand_in(root: Path) -> Path:
    """A package named ``kernels`` with a version and a submodule it imports by absolute name."""
    package = root / "kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.19.1"\nfrom kernels.part import PART\n')
    (package / "part.py").write_text('PART = "from the installed package"\n')
    return root


def test_the_installed_kernels_wins_over_the_checkout_folder(tmp_path):
    site = installed_stand_in(tmp_path / "site")
    got = import_kernels([str(REPO), str(site)], cwd=tmp_path)
    assert got["file"] == str(site / "kernels" / "__init__.py")
    assert got["version"] == "0.19.1"
    assert got["part"] == "from the installed package"      # its own submodules resolve inside it
    assert not got["has_pagedray_api"]
    assert got["kernels_modules"] == ["kernels", "kernels.part"]   # nothing of the checkout's folder left


def test_the_root_as_the_working_directory_is_handed_over_too(tmp_path):
    site = installed_stand_in(tmp_path / "site")
    got = import_kernels(["", str(site)], cwd=REPO)            # `python -c` / `python -m` from the root
    assert got["file"] == str(site / "kernels" / "__init__.py")


def test_without_an_installed_kernels_the_folder_is_an_empty_placeholder(tmp_path):
    got = import_kernels([str(REPO)], cwd=tmp_path)
    assert got["file"] == str(REPO / "kernels" / "__init__.py")
    assert got["version"] is None                             # transformers reads "not available"
    assert not got["has_pagedray_api"]                        # pagedray.kernels' surface is not loaded as `kernels`
    assert got["kernels_modules"] == ["kernels"]


def test_pagedray_kernels_is_unaffected():
    import pagedray.kernels

    assert Path(pagedray.kernels.__file__) == REPO / "kernels" / "__init__.py"
    assert callable(pagedray.kernels.paged_decode)
