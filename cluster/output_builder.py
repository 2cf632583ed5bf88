"""OutputBuilder: turns request state into streamed RequestOutput deltas.

Each call to ``make(request)`` returns the tokens of every sample produced since the previous call
for that request (a sample with nothing new and not newly finished is left out). The first output of
a request carries the prompt token ids (and their logprobs, when asked for); the output in which
every sample has finished carries ``finished=True`` and is the last one (the builder then forgets the request).
A resumed sequence (``Sequence.num_resumed``) streams from its first token generated here.
"""

from __future__ import annotations

from .outputs import CompletionOutput, RequestOutput, TokenLogprob
from .request import Request, Sequence


class OutputBuilder:
    def __init__(self) -> None:
        # request_id -> {sample index: tokens already streamed}
        self._streamed: dict[str, dict[int, int]] = {}
        self._finish_reported: set[int] = set()

    def make(self, request: Request, error: str | None = None) -> RequestOutput:
        first = request.request_id not in self._streamed
        streamed = self._streamed.setdefault(request.request_id, {})
        completions = []
        for seq in request.sequences:
            completion = self._completion(seq, streamed)
            if completion is not None:
                completions.append(completion)
        finished = request.is_finished
        out = RequestOutput(
            request_id=request.request_id,
            outputs=completions,
            finished=finished,
            prompt_token_ids=list(request.prompt_token_ids) if first else None,
            error=error or request.error,
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            prompt_logprobs=self._prompt_logprobs(request) if first else None,
        )
        if finished:
            del self._streamed[request.request_id]
            for seq in request.sequences:
                self._finish_reported.discard(seq.seq_id)
        return out

    @staticmethod
    def _prompt_logprobs(request: Request) -> list[TokenLogprob | None] | None:
        if request.params.prompt_logprobs is None:
            return None
        return list(request.prompt_logprobs or [None] * len(request.prompt_token_ids))

    def _completion(self, seq: Sequence, streamed: dict[int, int]) -> CompletionOutput | None:
        start = streamed.get(seq.index, seq.num_resumed)
        new_tokens = seq.output_token_ids[start:]
        newly_finished = seq.is_finished and seq.seq_id not in self._finish_reported
        if not new_tokens and not newly_finished:
            return None
        streamed[seq.index] = len(seq.output_token_ids)
        if newly_finished:
            self._finish_reported.add(seq.seq_id)
        logprobs = None
        if seq.request.params.logprobs is not None:
            logprobs = [TokenLogprob(token_id=s.token_id, logprob=s.logprob if s.logprob is not None else 0.0,
                                     top_logprobs=list(s.top_logprobs or []))
                        for s in seq.output_logprobs[start - seq.num_resumed:]]
        return CompletionOutput(
            index=seq.index,
            token_ids=new_tokens,
            logprobs=logprobs,
            finish_reason=seq.finish_reason.value if newly_finished else None,
        )
