"""The inline-PTX code conversions of ``tile_triton.codes_to`` (int8 / e4m3 -> bf16 / fp16), checked without a GPU:
a small interpreter of the PTX instructions they use runs each asm string on every 8-bit code, four to a 32-bit
word as Triton packs them, and the results must equal torch's conversions bit for bit.

The bf16 forms have run on GPUs (the 8-bit decode tests passed on an H100 and an H200), which checks this
interpreter's reading of the instructions; the float16 forms (``F16_MATH``) have not, and this is their
check until a GPU runs them. ``cvt.rn.f16x2.e4m3x2`` is the hardware's exact conversion, stood in for by torch's:
what is checked for it is which byte lands in which half."""

from __future__ import annotations

import re
import struct

import pytest
import torch
from pagedray.kernels.triton import tile_triton

MASK32 = 0xFFFFFFFF


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & MASK32))[0]


def _bits_f32(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _halves(bits: int, dtype: torch.dtype) -> torch.Tensor:
    """A 32-bit register as two 16-bit values of ``dtype`` (low half first), as float32."""
    pair = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
    return pair.view(dtype).float()


def _pack_halves(values: torch.Tensor, dtype: torch.dtype) -> int:
    """Two float32 values rounded to ``dtype`` (to nearest even) -> one 32-bit register, low half first."""
    low, high = (int(v) & 0xFFFF for v in values.to(dtype).view(torch.int16).tolist())
    return low | high << 16


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): result byte i is byte ``selector`` nibble i of the 8 bytes b:a."""
    pool = (a & MASK32) | (b & MASK32) << 32
    out = 0
    for i in range(4):
        nibble = selector >> (4 * i) & 0xF
        byte = pool >> (8 * (nibble & 7)) & 0xFF
        if nibble & 8:                                   # sign-replicate mode bit: not used by these strings
            raise NotImplementedError("prmt sign replication")
        out |= byte << (8 * i)
    return out


def run_asm(asm: str, word: int) -> tuple[int, int]:
    """Run one of ``tile_triton``'s conversion strings on input register ``$2`` -> (``$0``, ``$1``)."""
    regs: dict[str, int] = {"$2": word}

    def val(token: str) -> int:
        token = token.strip()
        if token in regs:
            return regs[token]
        if token.startswith("0f"):
            return int(token[2:], 16)
        return int(token, 0)

    for statement in asm.strip("{} ").split(";"):
        statement = statement.strip().strip("{}").strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        pair = re.fullmatch(r"\{\s*(\w+),\s*(\w+)\s*\},\s*(\S+)", rest)
        if op == "mov.b32" and pair:                    # split a 32-bit register into two 16-bit ones
            regs[pair.group(1)], regs[pair.group(2)] = val(pair.group(3)) & 0xFFFF, val(pair.group(3)) >> 16
            continue
        dst, *args = [part.strip() for part in rest.split(",")]
        a = [val(arg) for arg in args]
        if op == "mov.b32":
            result = a[0]
        elif op == "xor.b32":
            result = a[0] ^ a[1]
        elif op == "and.b32":
            result = a[0] & a[1]
        elif op == "or.b32":
            result = a[0] | a[1]
        elif op == "shr.b32":
            result = (a[0] & MASK32) >> a[1]
        elif op == "prmt.b32":
            result = _prmt(a[0], a[1], a[2])
        elif op == "sub.f32":
            result = _bits_f32(torch.tensor(_f32(a[0]) - _f32(a[1]), dtype=torch.float64).float().item())
        elif op == "sub.f16x2":
            result = _pack_halves(_halves(a[0], torch.float16).double() - _halves(a[1], torch.float16).double(),
                                  torch.float16)
        elif op == "mul.rn.bf16x2":
            result = _pack_halves(_halves(a[0], torch.bfloat16).double() * _halves(a[1], torch.bfloat16).double(),
                                  torch.bfloat16)
        elif op == "cvt.rn.f16x2.e4m3x2":               # low byte -> low half
            codes = torch.tensor([a[0] & 0xFF, a[0] >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn)
            result = _pack_halves(codes.float(), torch.float16)
        else:
            raise NotImplementedError(f"PTX op {op!r} in {statement!r}")
        regs[dst] = result & MASK32
    return regs["$0"], regs["$1"]


def _codes(dtype: torch.dtype) -> list[int]:
    """Every 8-bit code as an unsigned byte (e4m3: its two NaNs left out; the quantizer never stores them)."""
    return [c for c in range(256) if not (dtype == torch.float8_e4m3fn and c & 0x7F == 0x7F)]


CASES = {   # name -> (asm, code dtype, result dtype, what the result adds to each code)
    "int8 -> bf16": (tile_triton.INT8_TO_BF16, torch.int8, torch.bfloat16, 0),
    "int8 -> fp16": (tile_triton.INT8_TO_F16, torch.int8, torch.float16, 0),
    "int8 -> fp16 + 1152": (tile_triton.INT8_TO_F16_BIASED, torch.int8, torch.float16, tile_triton.INT8_BIAS.value),
    "e4m3 -> bf16": (tile_triton.E4M3_TO_BF16, torch.float8_e4m3fn, torch.bfloat16, 0),
    "e4m3 -> fp16": (tile_triton.E4M3_TO_F16, torch.float8_e4m3fn, torch.float16, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_code_converts_exactly_in_word_order(case):
    asm, code_dtype, out_dtype, bias = CASES[case]
    codes = _codes(code_dtype)
    for start in range(0, len(codes), 4):
        word_codes = [codes[(start + i * 37) % len(codes)] for i in range(4)]      # four different codes a word
        word = sum(c << (8 * i) for i, c in enumerate(word_codes))
        low, high = run_asm(str(asm.value if hasattr(asm, "value") else asm), word)
        got = torch.tensor([low & 0xFFFF, low >> 16, high & 0xFFFF, high >> 16], dtype=torch.int32)
        values = torch.tensor(word_codes, dtype=torch.uint8).view(code_dtype).float()
        want = (values + bias if bias else values).to(out_dtype).view(torch.int16)      # (keeping -0.0 without)
        assert torch.equal(got.to(torch.int16), want), (case, [hex(c) for c in word_codes], got.tolist(),
                                                         want.tolist())


def test_the_interpreter_catches_a_wrong_constant():
    """The check can fail: int8 -> fp16 with the bias of 1,151 instead of 1,152 is off by one everywhere."""
    wrong = str(tile_triton.INT8_TO_F16.value).replace("0x64806480", "0x647F647F")
    low, _ = run_asm(wrong, 0x00000000)
    assert _halves(low, torch.float16).tolist() != [0.0, 0.0]
