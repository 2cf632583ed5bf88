"""A cheap upper bound on prompt length, checked before any tokenizing.

``max_prompt_chars(tokenizer, max_model_len)``: a prompt with more characters than this cannot fit in
``max_model_len`` tokens, so it is refused (400) without running the tokenizer on it (a multi-megabyte
prompt took seconds of tokenizer time only to be refused afterwards).

Why the bound holds: a character is at least one UTF-8 byte, and a token stands for at most
``longest`` bytes of text (the longest vocabulary entry, decoded; a partial-character entry counts as
the 3 bytes of U+FFFD, which only overestimates). A normaliser may shrink text before it is split:
Unicode NFC / NFKC by at most 4x (a 4-byte letter such as U+1D400 becomes "A"), ``Prepend`` and
``Replace`` rules whose replacement is not shorter than their pattern not at all. For a normaliser
that can drop characters (strip, lowercase of special forms, any other or unknown kind) there is no
bound: None, and prompts are only checked after tokenizing.
"""

from __future__ import annotations

from .token_bytes import backend_spec

NFKC_SHRINK = 4
_SHRINK_BY_TYPE = {"NFC": NFKC_SHRINK, "NFKC": NFKC_SHRINK, "NFD": 1, "NFKD": NFKC_SHRINK, "Prepend": 1}


def normalizer_shrink(spec: dict | None) -> int | None:
    """How many times shorter (in bytes) the normaliser ``spec`` (tokenizer.json form) can make a text;
    None when it can drop characters."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            shrink = normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":
        pattern = spec.get("pattern", {}).get("String")
        content = spec.get("content", "")
        if pattern is None or len(content.encode()) < len(pattern.encode()):
            return None
        return 1
    return _SHRINK_BY_TYPE.get(kind)


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """Characters above which a prompt cannot fit in ``max_model_len`` tokens; None when unknown."""
    spec = backend_spec(tokenizer)
    if spec is None:
        return None
    shrink = normalizer_shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    vocab = tokenizer.get_vocab()
    longest = max(len(tokenizer.convert_tokens_to_string([token]).encode()) for token in vocab)
    return max(1, longest) * max_model_len * shrink
