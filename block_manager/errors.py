"""Exception types of the block manager.

Every error is raised before any state is changed: a failed call leaves the pool, the prefix cache
and every block table exactly as they were.

- ``CannotAllocateError``: the pool has fewer free blocks than the call needs (the scheduler's cue to
  wait or preempt); the message says "cannot allocate N block(s): only M free".
- ``UnknownSequenceError`` (also a KeyError): the sequence id was never registered.
- ``DoubleFreeError``: a sequence id freed twice (a recently freed id is remembered, so the second
  ``free`` says so instead of "unknown"), or a block whose ref count is already 0 released again.
  It subclasses ``UnknownSequenceError`` so that ``except UnknownSequenceError`` catches both cases
  of "this sequence is not registered".
- ``SequenceExistsError`` (also a ValueError): ``fork`` into an id that is already registered.
"""

from __future__ import annotations


class BlockManagerError(Exception):
    """Base class of every block manager error."""


class UnknownSequenceError(BlockManagerError, KeyError):
    """The sequence id is not registered with the block manager."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DoubleFreeError(UnknownSequenceError):
    """A sequence (or a block) released a second time."""


class CannotAllocateError(BlockManagerError):
    """The pool cannot satisfy the request; nothing was changed."""

    def __init__(self, needed: int, free: int, what: str = "") -> None:
        self.needed = needed
        self.free = free
        suffix = f" ({what})" if what else ""
        super().__init__(f"cannot allocate {needed} block(s): only {free} free{suffix}")


class SequenceExistsError(BlockManagerError, ValueError):
    """The sequence id is already registered."""
