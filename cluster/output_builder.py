"""OutputBuilder: turns request state into streamed RequestOutput deltas.

Each call to ``make(request)`` returns the tokens of every sample produced since the previous call
for that request (a sample with nothing new and not newly finished is left out). The first output of
a request carries the prompt token ids (and their logprobs, when asked for); the output in which
every sample has finished carries ``finished=True`` and is the last one.
A resumed sequence (``Sequence.num_resumed``) streams from its first token generated here.

The streaming cursor lives on the request (``Request.streamed``) and its sequences (``num_streamed``,
``finish_streamed``): building a decode step's outputs reads and bumps two fields per request, with no
table of its own to look up and clean.
"""

from __future__ import annotations

from .outputs import CompletionOutput, RequestOutput, TokenLogprob
from .request import Request, Sequence, SequenceStatus


class OutputBuilder:
    def make(self, request: Request, error: str | None = None) -> RequestOutput:
        first = not request.streamed
        request.streamed = True
        sequences = request.sequences
        if len(sequences) == 1:                 # n = 1 (every step of most requests): no list walk
            completion = _completion(sequences[0])
            completions = [] if completion is None else [completion]
        else:
            completions = [c for c in map(_completion, sequences) if c is not None]
        finished = request.num_unforked == 0 and request.num_finished == len(sequences)   # request.is_finished
        # positional arguments: cheaper than keywords, and this runs once per request and step
        out = RequestOutput(request.request_id, completions, finished,
                            list(request.prompt_token_ids) if first else None, error or request.error,
                            request.num_cached_prompt_tokens, _prompt_logprobs(request) if first else None, False,
                            request.kv_block_seconds)
        if finished and request.params.pooling is not None:
            out.pooled, out.pooled_logits = request.pooled_result(), request.pooled_logits
        return out


def _prompt_logprobs(request: Request) -> list[TokenLogprob | None] | None:
    if request.params.prompt_logprobs is None:
        return None
    return list(request.prompt_logprobs or [None] * len(request.prompt_token_ids))


def _completion(seq: Sequence) -> CompletionOutput | None:
    """The sample's tokens since its last output, and its finish once; None when it has neither."""
    start, output = seq.num_streamed, seq.output_token_ids
    newly_finished = seq.status is SequenceStatus.FINISHED and not seq.finish_streamed
    if start == len(output) and not newly_finished:
        return None
    seq.num_streamed = len(output)
    logprobs = None
    if seq.request.params.logprobs is not None:
        logprobs = [TokenLogprob(token_id=s.token_id, logprob=s.logprob if s.logprob is not None else 0.0,
                                 top_logprobs=list(s.top_logprobs or []))
                    for s in seq.output_logprobs[start - seq.num_resumed:]]
    if newly_finished:
        seq.finish_streamed = True
        return CompletionOutput(seq.index, output[start:], logprobs, seq.finish_reason.value)
    return CompletionOutput(seq.index, output[start:], logprobs)
