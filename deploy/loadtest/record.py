"""What the load tester measures about one request, and how a streamed response fills it in.

Definitions (the same as vLLM's and SGLang's serving benchmarks use):
- TTFT: time from sending the request to the first event that carries output text.
- ITL (inter-token latency): the gaps between consecutive text-carrying events. A server that packs
  several tokens into one event shows one gap for them (and a ``0``-ish gap when two events arrive in
  one network read); that is what a streaming client experiences, so it is what is reported.
- TPOT (time per output token): ``(E2E - TTFT) / (output_tokens - 1)``, only for requests with at least
  two output tokens.
- E2E: time from sending the request to the end of its stream.
- Output tokens: the server's own count (``usage.completion_tokens``, asked for with
  ``stream_options.include_usage``) when it reports one, else the number of text-carrying events.

Failure causes are short stable strings: ``http_<status>``, ``timeout``, ``connection``,
``stream_error`` and, from ``--check``, ``check_lost``, ``check_duplicated``, ``check_corrupted``.

The stream parser accepts Server-Sent-Event lines (``data: {...}``, ``data: [DONE]``), whole SSE
strings holding several events, or already-decoded chunk dicts (what a DeploymentHandle may yield). Both
``/v1/completions`` chunks (``choices[0].text``) and chat chunks (``choices[0].delta.content``) work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CAUSE_TIMEOUT = "timeout"
CAUSE_CONNECTION = "connection"
CAUSE_STREAM = "stream_error"


def http_cause(status: int) -> str:
    return f"http_{status}"


class StreamError(Exception):
    """The response stream was malformed or reported an error."""


@dataclass
class RequestRecord:
    """One request. Times are seconds; ``chunk_times`` and ``end_s`` are relative to ``send_s``."""

    index: int                      # issue order within the run
    prompt_index: int               # which prompt it sent
    send_s: float = 0.0             # since the start of the run
    chunk_times: list[float] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    end_s: float | None = None
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False              # saw ``data: [DONE]``
    error: str | None = None        # failure cause, None when it succeeded
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def output_tokens(self) -> int:
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return len(self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.end_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.ttft) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return self.end_s

    def fail(self, cause: str, detail: str) -> None:
        """Mark failed; the first cause recorded wins."""
        if self.error is None:
            self.error = cause
            self.error_detail = detail[:500]


def _choice_text(choice: dict) -> str:
    if "delta" in choice:  # chat completion chunk
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


class StreamParser:
    """Feeds events of one streamed response into its RequestRecord.

    ``clock`` returns the current time in the record's frame (seconds since the request was sent).
    """

    def __init__(self, record: RequestRecord, clock) -> None:
        self.record = record
        self.clock = clock

    def feed_line(self, line: str) -> None:
        """One SSE line; comments, blank lines and non-data fields are ignored."""
        line = line.strip()
        if not line.startswith("data:"):
            return
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            self.record.done = True
            return
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            raise StreamError(f"event is not JSON: {payload[:200]!r}") from None
        self.feed_chunk(chunk)

    def feed_text(self, text: str) -> None:
        """A block of SSE text holding any number of complete lines."""
        for line in text.splitlines():
            self.feed_line(line)

    def feed_chunk(self, chunk: dict) -> None:
        """One decoded completion / chat-completion chunk."""
        if not isinstance(chunk, dict):
            raise StreamError(f"event is not an object: {chunk!r:.200}")
        if "error" in chunk:
            raise StreamError(f"server error event: {json.dumps(chunk['error'])[:300]}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.record.usage_output_tokens = usage.get("completion_tokens")
            self.record.usage_prompt_tokens = usage.get("prompt_tokens")
        for choice in chunk.get("choices") or []:
            text = _choice_text(choice)
            if text:
                self.record.chunk_times.append(self.clock())
                self.record.chunks.append(text)
            if choice.get("finish_reason"):
                self.record.finish_reason = choice["finish_reason"]

    def finish(self) -> None:
        """End of stream: it must have finished properly (a finish reason or [DONE]) and said something."""
        self.record.end_s = self.clock()
        if not (self.record.done or self.record.finish_reason):
            raise StreamError("stream ended before a finish_reason or [DONE]")
        if not self.record.chunks:
            raise StreamError("stream carried no output text")
