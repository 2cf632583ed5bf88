"""TEST DOUBLES that hold a piece of ingress work until the test releases it (no sleeps, no timings).

``Gate``: the shared state of a gated double and of its copies: which gated calls ran on the event
loop's thread (such a call raises instead of waiting: waiting there would block the test itself), which
object each call went through, and the ``release`` event. ``wait_entered(count)`` waits until ``count``
calls are held; its guard is a hang guard only (it returns False when the code under test never lets
that many calls in at once), never a speed limit.

``GatedTokenizer``: the real tokenizer, except that encoding a text that starts with "SLOW" passes the
gate; every text it encodes is counted (``encoded``: lengths). A ``copy.deepcopy`` of it (the ingress
copies the tokenizer once per prepare thread) is a gated copy of the inner tokenizer sharing the same
gate and records, with its own ``copy_no`` (0: the original).

``GatedFormatter``: a LogprobFormatter whose ``prompt_logprobs`` passes the gate (and counts its calls).
"""

from __future__ import annotations

import asyncio
import copy
import threading

HANG_GUARD_S = 120.0   # only ever waited out when the behaviour under test is missing


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Gate:
    def __init__(self) -> None:
        self.on_event_loop: list[bool] = []
        self.holders: list[object] = []     # per gated call: the object it went through
        self.entered, self.release = threading.Event(), threading.Event()
        self._cond = threading.Condition()

    def pass_through(self, holder) -> None:
        loop = on_event_loop()
        with self._cond:
            self.on_event_loop.append(loop)
            self.holders.append(holder)
            self._cond.notify_all()
        self.entered.set()
        if loop:
            raise AssertionError("gated work ran on the event loop")
        self.release.wait(HANG_GUARD_S)

    def wait_entered(self, count: int) -> bool:
        """Whether ``count`` gated calls have entered (blocks; call it through asyncio.to_thread)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.holders) >= count, HANG_GUARD_S)


class GatedTokenizer:
    def __init__(self, inner, gate: Gate | None = None, copy_no: int = 0, copies: list | None = None,
                 encoded: list | None = None) -> None:
        self.inner, self.gate, self.copy_no = inner, gate or Gate(), copy_no
        self.copies = [] if copies is None else copies   # every copy made, shared by all of them
        self.encoded = [] if encoded is None else encoded   # the length of every text encoded, shared
        # the gate's state under the names the older tests use
        self.on_event_loop, self.entered, self.release = self.gate.on_event_loop, self.gate.entered, self.gate.release

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __deepcopy__(self, memo) -> GatedTokenizer:
        twin = GatedTokenizer(copy.deepcopy(self.inner, memo), self.gate, len(self.copies) + 1, self.copies,
                              self.encoded)
        self.copies.append(twin)
        return twin

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        if text.startswith("SLOW"):
            self.gate.pass_through(self)
        return self.inner.encode(text, **kwargs)


class GatedFormatter:
    def __init__(self, inner) -> None:
        self.inner, self.gate, self.prompt_logprobs_calls = inner, Gate(), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prompt_logprobs(self, entries):
        self.prompt_logprobs_calls += 1
        self.gate.pass_through(self)
        return self.inner.prompt_logprobs(entries)
