"""Incremental detokenizer and stop-string matcher (no engine, no Ray)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedray.deploy.openai.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello world, this is a plain sentence.",
    "Multi-byte: héllo wörld, 你好世界, emoji 🙂🚀 and 👩‍👩‍👧 family.",
    "  leading spaces\n\nnew lines\tand tabs  ",
    "código ñandú — “quotes” … 1234567890",
]


def _stream(tokenizer, prompt_ids, ids, chunk_sizes):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, i = [], 0
    for size in chunk_sizes:
        deltas.append(detok.add(ids[i:i + size]))
        i += size
    deltas.append(detok.add(ids[i:]))
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt_ids = tokenizer.encode("The answer is:")
    rng = random.Random(len(text))
    for _ in range(5):
        sizes = [rng.randint(1, 3) for _ in range(len(ids))]
        deltas = _stream(tokenizer, prompt_ids, ids, sizes)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        # one token at a time: no delta may show a half-decoded character
        one_by_one = _stream(tokenizer, prompt_ids, ids, [1] * len(ids))
        assert all("\ufffd" not in d for d in one_by_one)
        assert "".join(one_by_one) == text


def test_emoji_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) >= 2, "the rocket emoji must span several byte-level tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids[:-1]) == ""
    assert detok.add(ids[-1:]) == "🚀"


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Done.") + [eos]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say done:"))
    assert detok.add(ids) + detok.flush() == "Done."


def test_truncated_character_is_released_by_flush(tokenizer):
    ids = tokenizer.encode("ok 🚀")[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = detok.add(ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def _feed_all(stops, pieces):
    matcher = StopStringMatcher(stops)
    emitted = [matcher.feed(p) for p in pieces]
    emitted.append(matcher.flush())
    return matcher, emitted


def test_stop_string_split_across_deltas():
    matcher, emitted = _feed_all(["world"], ["Hello wor", "ld and more"])
    assert emitted == ["Hello ", "", ""]
    assert matcher.stopped and matcher.matched == "world"


def test_possible_stop_prefix_is_held_then_released():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("abc##") == "abc"
    assert matcher.feed("x") == "##x"
    assert matcher.feed("#") == ""
    assert matcher.flush() == "#"
    assert not matcher.stopped


def test_first_completed_of_several_stops_wins():
    matcher, emitted = _feed_all(["END", "\n\n"], ["one\n\ntwo END"])
    assert "".join(emitted) == "one"
    assert matcher.matched == "\n\n"


def test_longer_stop_completing_later_does_not_count():
    # "a#a" would start earlier, but "#" completes first: generation stops there
    matcher, emitted = _feed_all(["#", "a#a"], ["a#a"])
    assert "".join(emitted) == "a" and matcher.matched == "#"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n#", max_size=40),
       stops=st.lists(st.text(alphabet="ab\n#", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_emitted_text_is_cut_at_the_first_completed_stop(text, stops, cuts):
    """Any split of the text gives the result of scanning it one character at a time."""
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher, emitted = _feed_all(stops, pieces)
    expected, stopped = text, False
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            expected, stopped = text[:min(starts)], True
            break
    assert "".join(emitted) == expected
    assert matcher.stopped == stopped
