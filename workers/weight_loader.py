"""Read slices of tensors from a Hugging Face safetensors model folder.

Layouts accepted: ``model.safetensors.index.json`` + the shards it names (index-sharded), or one or
more ``*.safetensors`` files without an index. PyTorch ``.bin`` checkpoints are not read (they
cannot be sliced without loading everything): the error says to convert them.

Every read goes through ``safe_open(...).get_slice(name)[rows/cols]`` so a rank only ever
materialises its own shard; files are memory-mapped and opened at most once per reader.
Errors are ``WeightLoadError`` (a ValueError) naming the folder, file or tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """The model folder lacks a weight file or a tensor, or a tensor has an unexpected shape."""


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise WeightLoadError(f"model: {index} is not a valid safetensors index ({exc})") from exc
        missing = sorted({f for f in mapping.values() if not (folder / f).is_file()})
        if missing:
            raise WeightLoadError(f"model: weight files {missing} listed in {index} are missing")
        return dict(mapping)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = " (found PyTorch .bin files: convert them to safetensors)" if any(folder.glob("*.bin")) else ""
        raise WeightLoadError(f"model: no *.safetensors weight files in {folder}{hint}")
    mapping = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            mapping.update({name: file.name for name in handle.keys()})
    return mapping


class CheckpointReader:
    """Slice-wise access to the tensors of one model folder; use as a context manager."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise WeightLoadError(f"model: {self.folder} is not a directory")
        self._weight_map = _weight_map(self.folder)
        self._handles: dict[str, object] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def _slice(self, name: str):
        file = self._weight_map.get(name)
        if file is None:
            raise WeightLoadError(f"model: tensor {name!r} is missing from the weights in {self.folder}")
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.folder / file), framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None,
             expect_shape: list[int] | None = None) -> torch.Tensor:
        """The tensor ``name``, or only ``[start, end)`` along ``dim`` (0 or 1) when dim is given.

        ``expect_shape`` is the full (unsliced) shape the caller requires.
        """
        view = self._slice(name)
        shape = list(view.get_shape())
        if expect_shape is not None and shape != list(expect_shape):
            raise WeightLoadError(f"model: tensor {name!r} has shape {shape}, expected {list(expect_shape)} "
                                  "from config.json")
        if dim is None:
            return view[:]
        end = shape[dim] if end is None else end
        if dim == 0:
            return view[start:end]
        if dim == 1:
            return view[:, start:end]
        raise ValueError(f"dim: must be None, 0 or 1, got {dim}")


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy a loaded slice into (a view of) a parameter, casting dtype and device."""
    if tuple(param.shape) != tuple(value.shape):
        raise WeightLoadError(f"model: slice of {name!r} has shape {tuple(value.shape)}, "
                              f"this rank expects {tuple(param.shape)}")
    param.copy_(value.to(dtype=param.dtype))
