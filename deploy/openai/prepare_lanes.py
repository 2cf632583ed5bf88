"""The ingress' prepare lanes: where parsing, validation, chat templates and tokenizing run.

Never on the event loop: on worker threads, in two lanes chosen by the size of the request's body
(``input_within``, a walk that stops at ``SMALL_INPUT`` characters and entries). Small bodies get a
thread of their own (``SHORT_PREPARE_THREADS``), larger ones, and any that asks for structured output
or tools (a grammar check may take its whole budget, however short the body: ``asks_for_grammar``),
share ``BULK_PREPARE_THREADS``: a short
request then waits only behind other short ones, never behind a client's big prompts; two bulk threads
so that one big request does not hold the others' either, and because the Rust tokenizer releases the
GIL while it encodes (a second core helps).

A Hugging Face fast tokenizer is not safe to call from several threads at once, so each prepare thread
encodes with its own copy (``copy.deepcopy``, made when the thread starts; ``PrepareLanes.tokenizer``
is the calling thread's copy); the event loop keeps the original (detokenizing, logprob strings). A
tokenizer that cannot be copied is shared, and then the prepare threads take turns with it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

# a body of at most SMALL_INPUT string characters + list / dict entries (about 4k tokens of prompt,
# milliseconds to prepare) goes to the short lane
SMALL_INPUT = 16_384
SHORT_PREPARE_THREADS = 1
BULK_PREPARE_THREADS = 2
PREPARE_THREADS = SHORT_PREPARE_THREADS + BULK_PREPARE_THREADS


def input_within(value, budget: int) -> bool:
    """True when the JSON value holds at most ``budget`` units: a string's characters, a list's or
    dict's entries (and its keys' characters), 1 per other value. Stops as soon as the budget is spent,
    so it takes at most about ``budget`` steps whatever the body (it runs on the event loop)."""
    stack = [value]
    while stack:
        item = stack.pop()
        budget -= len(item) if isinstance(item, (str, list, dict)) else 1
        if budget < 0:
            return False
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


GRAMMAR_FIELDS = ("response_format", "structured_outputs", "tools")


def asks_for_grammar(body) -> bool:
    """Whether a body may need a grammar compiled (its check costs up to the budget of
    workers/sampling/grammar_limits.py, however small the body): such bodies go to the bulk lane."""
    return isinstance(body, dict) and any(body.get(name) for name in GRAMMAR_FIELDS)


async def off_loop_if(big: bool, build: Callable):
    """``build()`` on a worker thread when ``big``, else here (a thread hop costs more than small work)."""
    return await asyncio.to_thread(build) if big else build()


class PrepareLanes:
    """The two thread pools and each prepare thread's tokenizer copy (module docstring)."""

    def __init__(self, tokenizer) -> None:
        self._shared = tokenizer
        self._local = threading.local()   # each prepare thread's own tokenizer copy
        self._shared_lock = threading.Lock()   # for a tokenizer that cannot be copied
        self._short = ThreadPoolExecutor(SHORT_PREPARE_THREADS, thread_name_prefix="pagedray-prepare-short",
                                         initializer=self._start_thread)
        self._bulk = ThreadPoolExecutor(BULK_PREPARE_THREADS, thread_name_prefix="pagedray-prepare-bulk",
                                        initializer=self._start_thread)

    def _start_thread(self) -> None:
        try:
            self._local.tokenizer = copy.deepcopy(self._shared)
        except Exception:  # noqa: BLE001 - a failed initializer would break the pool for good
            logger.warning("the tokenizer cannot be copied; the prepare threads take turns with one", exc_info=True)
            self._local.tokenizer = None

    @property
    def tokenizer(self):
        """The calling prepare thread's own tokenizer (the shared one off the prepare threads)."""
        return getattr(self._local, "tokenizer", None) or self._shared

    def _call(self, work: Callable, body):
        """``work(body)`` on this prepare thread; with a shared tokenizer, one thread at a time."""
        if getattr(self._local, "tokenizer", None) is not None:
            return work(body)
        with self._shared_lock:
            return work(body)

    @staticmethod
    def lane(body) -> str:
        """"short" or "bulk": the lane of a request body (module docstring)."""
        return "short" if input_within(body, SMALL_INPUT) and not asks_for_grammar(body) else "bulk"

    async def call(self, work: Callable, body):
        """``work(body)`` on the body's lane."""
        pool = self._short if self.lane(body) == "short" else self._bulk
        return await asyncio.get_running_loop().run_in_executor(pool, self._call, work, body)
