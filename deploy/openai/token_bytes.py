"""The true bytes of a vocabulary entry, and its OpenAI logprob string.

A token that stops inside a multi-byte UTF-8 character (half of an emoji) decodes to ``"\\ufffd"``, so
``decode([token_id])`` cannot tell such tokens apart. ``TokenBytes`` recovers each entry's own bytes:
- byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen: the tokenizer's decoder is ``ByteLevel``): each
  character of the entry stands for one byte (GPT-2's byte-to-unicode table, inverted here);
- sentencepiece byte fallback (``<0xE2>``): that one byte;
- anything else (whole words, special tokens): the UTF-8 of ``decode([token_id])`` with special
  tokens kept.
``text(token_id)`` is the entry as text when its bytes are valid UTF-8, else OpenAI's ``bytes:`` form
(``"bytes: \\xf0\\x9f"``: printable ASCII as itself, every other byte escaped), so different partial
tokens never share a string.
"""

from __future__ import annotations

import functools
import json
import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable bytes map to themselves, the other 68 bytes to
    the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


@functools.lru_cache(maxsize=4)   # parsed once per tokenizer: this module and prompt_bound.py read it
def backend_spec(tokenizer) -> dict | None:
    """The fast tokenizer's tokenizer.json as a dict (None for a slow tokenizer). Do not mutate it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else json.loads(backend.to_str())


def _is_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    decoder = spec.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


class TokenBytes:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(backend_spec(tokenizer))
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._lookup(token_id)
        return raw

    def _lookup(self, token_id: int) -> bytes:
        entry = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(entry, str) and token_id not in self._special:
            if self._byte_level and all(ch in _UNICODE_TO_BYTE for ch in entry):
                return bytes(_UNICODE_TO_BYTE[ch] for ch in entry)
            match = _BYTE_FALLBACK.fullmatch(entry)
            if match:
                return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7f and b != 0x5c else f"\\x{b:02x}" for b in raw)
