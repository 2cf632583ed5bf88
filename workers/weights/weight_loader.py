"""Read slices of tensors from a Hugging Face safetensors model folder.

Layouts accepted: ``model.safetensors.index.json`` + the shards it names (index-sharded), or one or
more ``*.safetensors`` files without an index. PyTorch ``.bin`` checkpoints are not read (they
cannot be sliced without loading everything): the error says to convert them.

Every read goes through ``safe_open(...).get_slice(name)[rows/cols]`` so a rank only ever
materialises its own shard; files are memory-mapped and opened at most once per reader.
Errors are ``WeightLoadError`` (a ValueError) naming the folder, file or tensor.

A quantized checkpoint (``quantization.py``): a read of a linear layer's ``{prefix}.weight`` returns that
weight dequantized to float32 from the checkpoint's packed tensors, sliced the same way.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from pagedray.kernels.quant_gemm import dequantize_packed
from safetensors import safe_open

from . import quantization as quant

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

    def __init__(self, folder: str | Path, quantization: quant.WeightQuantization | None = None,
                 keep_packed: bool = False) -> None:
        self.folder = Path(folder)
        self.quantization = quantization or quant.WeightQuantization()
        self.keep_packed = keep_packed           # read_packed answers (integer formats on CUDA)
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
        if dim not in (None, 0, 1):
            raise ValueError(f"dim: must be None, 0 or 1, got {dim}")
        if self.quantization.method != "none" and name.endswith(".weight"):
            dequantized = self._read_quantized(name, dim, start, end, expect_shape)
            if dequantized is not None:
                return dequantized
        view = self._slice(name)
        shape = list(view.get_shape())
        _check_shape(name, shape, expect_shape)
        if dim is None:
            return view[:] if shape else self._handles[self._weight_map[name]].get_tensor(name)   # 0-d: no slicing
        end = shape[dim] if end is None else end
        if dim == 0:
            return view[start:end]
        return view[:, start:end]

    def _read_quantized(self, name: str, dim, start: int, end, expect_shape) -> torch.Tensor | None:
        """The dequantized slice of a quantized linear weight, or None when ``name`` is stored as it is."""
        q, prefix = self.quantization, name[: -len(".weight")]
        if q.method in ("gptq", "awq") and not self.has(name) and self.has(f"{prefix}.qweight"):
            full = self._packed_shape(prefix)
            _check_shape(name, full, expect_shape)
            end = full[dim] if dim is not None and end is None else end
            packed = self._packed_slice(prefix, full, dim, start, end)
            if packed is not None:
                return dequantize_packed(*_fields(packed)).t()
            weight = dequantize_packed(*_fields(self._packed_slice(prefix, full, None, 0, None))).t()   # [out, in]
            return weight[:, start:end]                     # input columns that split a packed word
        if q.method == "fp8" and not q.online:
            scale = self._fp8_scale(prefix)
            if scale is None:
                return None
            weight = quant.dequantize_fp8(q, self._slice(name)[:], self._slice(scale)[:])
        elif q.online and quant.quantized_online(name):
            weight = quant.round_to_8bit(self._slice(name)[:], q.method)
        else:
            return None
        _check_shape(name, list(weight.shape), expect_shape)
        if dim is None:
            return weight
        end = weight.shape[dim] if end is None else end
        return weight[start:end] if dim == 0 else weight[:, start:end]

    def _fp8_scale(self, prefix: str) -> str | None:
        """The name of an FP8 weight's scale tensor, or None for a weight stored in full precision."""
        return next((f"{prefix}.{s}" for s in ("weight_scale_inv", "weight_scale") if self.has(f"{prefix}.{s}")),
                    None)

    def read_packed(self, name: str, dim: int, start: int, end: int, expect_shape: list[int]):
        """A linear weight's slice (``dim`` 0: output rows, 1: input columns) as a ``PackedIntWeight`` when this
        reader keeps integer weights packed, else None (the caller reads it dense). None too for a slice the
        packing cannot cut (input columns not on a word boundary)."""
        q, prefix = self.quantization, name[: -len(".weight")]
        if not self.keep_packed or (dim == 1 and (start % q.per_word or end % q.per_word)):
            return None
        if q.online and quant.quantized_online(name):
            full = self._slice(name)
            _check_shape(name, list(full.get_shape()), expect_shape)
            packed = quant.rows_packed(full[start:end] if dim == 0 else full[:], q.method)
            return packed if dim == 0 else _cols(packed, start, end)
        if q.method == "fp8" and not q.online:
            scale = self._fp8_scale(prefix)
            if scale is None:
                return None
            full = self._slice(name)
            shape = list(full.get_shape())
            _check_shape(name, shape, expect_shape)
            rows, cols = (range(start, end), range(shape[1])) if dim == 0 else (range(shape[0]), range(start, end))
            weight = full[start:end] if dim == 0 else full[:, start:end]
            return quant.fp8_checkpoint_packed(q, weight, self._slice(scale)[:], rows, cols)
        if q.method not in ("gptq", "awq") or self.has(name) or not self.has(f"{prefix}.qweight"):
            return None
        full = self._packed_shape(prefix)
        _check_shape(name, full, expect_shape)
        return self._packed_slice(prefix, full, dim, start, end)

    def _packed_shape(self, prefix: str) -> list[int]:
        """[out, in] of a GPTQ / AWQ weight from its packed tensors."""
        packed, scales = self.shape(f"{prefix}.qweight"), self.shape(f"{prefix}.scales")
        rows = packed[0] * self.quantization.per_word if self.quantization.method == "gptq" else packed[0]
        return [scales[1], rows]

    def _packed_slice(self, prefix: str, full: list[int], dim, start: int, end) -> quant.PackedIntWeight | None:
        """A GPTQ / AWQ weight's slice (``dim`` 0: output rows, 1: input columns, None: all) in GPTQ's layout,
        reading only its rows of ``qweight`` for an input-column slice; None when that slice splits a word."""
        q = self.quantization
        if dim == 1 and (start % q.per_word or end % q.per_word):
            return None
        rows = slice(start, end) if dim == 1 else slice(0, full[1])                # input rows of the slice
        qweight, scales = self._slice(f"{prefix}.qweight"), self._slice(f"{prefix}.scales")[:]
        if q.method == "awq":                    # words run along the output: repack along the input
            codes = quant.unpack_along_cols(qweight[rows], 4, quant.AWQ_ORDER)    # [rows, out]
            g_idx = (torch.arange(rows.start, rows.stop) // quant.group_of(q)).to(torch.int32)
            zeros = quant.awq_zeros(self._slice(f"{prefix}.qzeros")[:])
            packed = quant.PackedIntWeight(quant.pack_rows(codes, 4), zeros, scales, g_idx, 4)
            return _rows(packed, start, end) if dim == 0 else packed
        g_name = f"{prefix}.g_idx"
        g_idx = (self._slice(g_name)[:].to(torch.int32) if self.has(g_name)
                 else (torch.arange(full[1]) // quant.group_of(q)).to(torch.int32))
        zeros = quant.gptq_zeros(q, self._slice(f"{prefix}.qzeros")[:])
        if dim == 0:                             # output columns: not packed in qweight
            return _rows(quant.PackedIntWeight(qweight[:, start:end], zeros, scales, g_idx, q.bits), start, end,
                         qweight_sliced=True)
        words = slice(rows.start // q.per_word, rows.stop // q.per_word)
        return quant.PackedIntWeight(qweight[words].contiguous(), zeros, scales, g_idx[rows].contiguous(), q.bits)


def _rows(packed: quant.PackedIntWeight, start: int, end: int, qweight_sliced: bool = False) -> quant.PackedIntWeight:
    """Output rows [start, end) of a packed weight: its columns (``qweight_sliced``: its qweight holds them
    already, read so from the checkpoint)."""
    qweight = packed.qweight if qweight_sliced else packed.qweight[:, start:end]
    return replace(packed, qweight=qweight.contiguous(), zeros=packed.zeros[:, start:end].contiguous(),
                   scales=packed.scales[:, start:end].contiguous())


def _fields(packed: quant.PackedIntWeight) -> tuple:
    return packed.qweight, packed.zeros, packed.scales, packed.g_idx, packed.bits


def _cols(packed: quant.PackedIntWeight, start: int, end: int) -> quant.PackedIntWeight:
    """Input columns [start, end) (on word boundaries) of a packed weight: its rows; every group kept."""
    per_word = 32 // packed.bits
    return replace(packed, qweight=packed.qweight[start // per_word:end // per_word].contiguous(),
                   g_idx=packed.g_idx[start:end].contiguous())


def _check_shape(name: str, shape: list[int], expect_shape) -> None:
    if expect_shape is not None and list(shape) != list(expect_shape):
        raise WeightLoadError(f"model: tensor {name!r} has shape {list(shape)}, expected {list(expect_shape)} "
                              "from config.json")


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy a loaded slice into (a view of) a parameter, casting dtype and device."""
    if tuple(param.shape) != tuple(value.shape):
        raise WeightLoadError(f"model: slice of {name!r} has shape {tuple(value.shape)}, "
                              f"this rank expects {tuple(param.shape)}")
    param.copy_(value.to(dtype=param.dtype))
